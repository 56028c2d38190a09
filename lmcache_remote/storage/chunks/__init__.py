"""Chunks in Redis: the remote tier of `CacheEngine`.

- `lookup`: `RemoteLookup`, which chunks a server holds (keys, `contains`, values found
  foreign, LRU refreshes, admission counts): all the vLLM scheduler needs;
- `reads`: `get`, whole chunks, checked, or none; `writes`: `put_each`, each chunk whole or
  absent (each value through `storage.value`, the path pages take too);
- `redis_tier`: `RedisTier`, the tier (a lookup with its reads and writes, its state,
  `delete`, its lanes), over one server or a cluster alike: its channel
  (`session.channel`) is chosen when it is built; `toucher`: LRU refreshes of chunks served
  locally;
- `factory`: `make_remote_tier`, `make_remote_lookup`, the tier a `remote_url` names.

Every tier keeps `storage.tier.StorageTier`.
"""
