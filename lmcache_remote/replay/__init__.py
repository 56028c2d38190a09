"""Replaying request traces through the cache: a trace's requests (`trace`), what caches of
a given size would hit on them (`offline`, `published`, over `simcache.SimCache`), and the
replay of the same requests through the real engine against a real Redis (`driver`), with
the report that puts them side by side and plots them (`report`). docs/replay.md says how to
run it; `lmcache-remote replay` is its command."""
