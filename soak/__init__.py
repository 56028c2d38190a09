"""The soak: lmcache-remote under hours-like load in minutes, every retrieved token checked.

One command, bounded in time, stopping everything it starts:

    python -m soak --minutes 2 --mode fault-free|faults|both [--json report.json]

It starts a private `redis-server` at a small `maxmemory` with `allkeys-lru`, then one engine
process (`lmcache_remote.CacheEngine`, a tiny bfloat16 geometry, small local tiers that fill
within seconds) per role: `rw` (lookup, retrieve, store the rest: vLLM's flow), `ro` (lookup
and retrieve only) and `nolocal` (read-write, `local_cpu=False`). Prompts are a shared system
prompt, 1-6 documents drawn Zipf-like from 200 and a unique question; the KV of every token is
a function of its prefix, so every retrieved token is compared bit for bit with what it must
be. Mode `faults` injects SIGSTOP, kill -9 and restart, CLIENT KILL, DEBUG SLEEP, corrupted
values, deleted part keys and a maxmemory squeeze on a schedule.

Per window it prints, per engine: retrieved/lookup, hit tokens per tier, wrong KV tokens,
exceptions, the slowest call and RSS; at the end the hit rate by the popularity of the first
document (reported, not judged), the criteria (`soak.report`) and the exit code: 0 passed,
1 failed, 130 interrupted. `--no-lru-touch` runs the engines without the LRU refresh
(`remote_lru_touch: false`), `--restart-every S` restarts them with empty local tiers,
`--integrity-key file:PATH` gives every engine that `integrity_key`.
docs/reliability.md has the figures of long runs (and of the refresh on and off),
docs/testing.md how the short run is part of the test command.

Modules: `settings` (the knobs), `workload` (prompts, expected KV, the paged cache),
`worker` (one engine process), `faults` (the fault schedule), `controller` (start, collect,
stop), `report` (criteria, tables, JSON), `cli`.
"""
