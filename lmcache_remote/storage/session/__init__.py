"""The Redis session: who the client talks to, whether it may, and how the fleet shares it.

- `client`: `make_client` (one server, TLS, a UNIX socket, Sentinel, a Cluster), the retry
  policy, `RemoteCaller`, error translation (`translate`: no password in a message), the
  sockets a call holds (`shut_down_in_use`);
- `health`: `HealthGate`, the backoff after a failure;
- `access`: may this ACL user read, write, script (checked at start-up);
- `scan`: SCAN over every primary of a cluster;
- `pins`: the fleet's pin registry and its scripts (docs/pins.md);
- `publisher`: the engine's published figures and the fleet's chores;
- `channel`: `Channel`, every batch's way to Redis for chunks and pages alike, each command's
  reply or `FAILED` (`ServerChannel` for one server; `open_channel` chooses, once), and
  `write_values`, each chunk or page by one atomic command;
- `cluster_scatter`: `ClusterScatter`, a cluster's channel: a batch as one bulk pipeline per
  node in parallel under the call's deadline;
- `connection_count`: how many connections an engine opens (pool sizes, the scatter's node
  threads).

It stands on `wire` and `local`; chunks, pages and the manager stand on it.
"""
