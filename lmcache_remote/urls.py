"""Remote URLs: the one place a `remote_url` is parsed into what kind of deployment it names.

Accepted forms (docs/deploy.md has examples):

- `redis://[user[:password]@]host[:port][/db][?...]`, `rediss://...` (TLS), `unix:///path...`:
  one server, handed to redis-py as is (kind `single`).
- `redis+cluster://[user[:password]@]host:port[,host:port...][/][?ssl_*=...]`,
  `rediss+cluster://...` (TLS): a Redis/Valkey Cluster; the hosts are seed nodes, the client
  discovers the rest (kind `cluster`). A cluster has only database 0, so the path is empty,
  `/` or `/0`. Default port 6379.
- `redis+sentinel://[user[:password]@]host:port[,host:port...]/service_name[/db][?...]`,
  `rediss+sentinel://...`: the master of `service_name` as Sentinel reports it (kind
  `sentinel`). The hosts are the sentinels (default port 26379); user and password belong to
  the Redis master; `sentinel_username`/`sentinel_password` in the query authenticate to the
  sentinels. TLS (`rediss+`) applies to the master connections.

Query parameters of the cluster and sentinel forms: the `ssl_*` options (`ssl_ca_certs`,
`ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs`, TLS schemes only) and, for sentinel, the two
`sentinel_*` credentials; anything else is refused, so a typo never passes silently.

`parse_remote_url` raises `ConfigError("remote_url", ...)` for a malformed URL; its messages
never repeat a password.
"""

from __future__ import annotations

import dataclasses
import urllib.parse

from lmcache_remote.errors import ConfigError

SINGLE_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
SCHEMES = SINGLE_SCHEMES + CLUSTER_SCHEMES + SENTINEL_SCHEMES
SSL_QUERY_PARAMS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
SENTINEL_QUERY_PARAMS = ("sentinel_username", "sentinel_password")
DEFAULT_PORT = 6379
DEFAULT_SENTINEL_PORT = 26379
FIELD = "remote_url"


@dataclasses.dataclass(frozen=True)
class RemoteURL:
    """A parsed remote URL. For kind `single` only `url` and `tls` are filled in."""

    kind: str
    """`single`, `cluster` or `sentinel`."""
    url: str = dataclasses.field(repr=False)
    tls: bool = False
    nodes: tuple[tuple[str, int], ...] = ()
    """Cluster seed nodes, or the sentinels."""
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    service: str | None = None
    """Sentinel: the monitored master's name."""
    db: int = 0
    query: tuple[tuple[str, str], ...] = dataclasses.field(default=(), repr=False)
    """The remaining query parameters (`ssl_*`, `sentinel_*`), in order."""

    def param(self, name: str) -> str | None:
        return next((v for k, v in self.query if k == name), None)

    @property
    def ssl_params(self) -> dict[str, str]:
        return {k: v for k, v in self.query if k in SSL_QUERY_PARAMS}


def _fail(message: str) -> ConfigError:
    return ConfigError(FIELD, message)


def parse_remote_url(url: str) -> RemoteURL:
    """Parse and validate `url`; `ConfigError` naming `remote_url` when it is malformed."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES or not rest:
        raise _fail(
            f"unknown URL form; use one of {', '.join(s + '://' for s in SCHEMES)}"
        )
    if scheme in SINGLE_SCHEMES:
        return RemoteURL("single", url, tls=scheme == "rediss")
    tls = scheme.startswith("rediss+")
    sentinel = scheme in SENTINEL_SCHEMES
    try:
        parts = urllib.parse.urlsplit("x://" + rest)
    except ValueError:
        raise _fail(f"{scheme}://: malformed host list") from None
    if parts.fragment:
        raise _fail(f"{scheme}:// URLs take no #fragment")
    authority = parts.netloc
    userinfo, at, hosts = authority.rpartition("@")
    username, password = _userinfo(userinfo) if at else (None, None)
    nodes = _nodes(hosts, DEFAULT_SENTINEL_PORT if sentinel else DEFAULT_PORT, scheme)
    query = _query(parts.query, scheme, tls, sentinel)
    if sentinel:
        service, db = _sentinel_path(parts.path)
    else:
        service, db = None, _cluster_path(parts.path)
    return RemoteURL(
        "sentinel" if sentinel else "cluster", url, tls, nodes, username, password,
        service, db, query,
    )


def _userinfo(userinfo: str) -> tuple[str | None, str | None]:
    user, colon, password = userinfo.partition(":")
    return (
        urllib.parse.unquote(user) or None,
        urllib.parse.unquote(password) if colon else None,
    )


def _nodes(hosts: str, default_port: int, scheme: str) -> tuple[tuple[str, int], ...]:
    if not hosts:
        raise _fail(f"{scheme}:// needs at least one host:port")
    return tuple(_node(item, default_port, scheme) for item in hosts.split(","))


def _node(item: str, default_port: int, scheme: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [IPv6]:port
        host, bracket, tail = item[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise _fail(f"{scheme}://: bad IPv6 address {item!r}")
        port_text = tail[1:] if tail else ""
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise _fail(f"{scheme}://: empty host in {item!r} (hosts are host:port,host:port)")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _fail(f"{scheme}://: bad port in {item!r}")
    return host, int(port_text)


def _query(
    text: str, scheme: str, tls: bool, sentinel: bool
) -> tuple[tuple[str, str], ...]:
    try:
        pairs = urllib.parse.parse_qsl(text, keep_blank_values=True, strict_parsing=bool(text))
    except ValueError:
        raise _fail(f"{scheme}://: malformed query string") from None
    allowed = SSL_QUERY_PARAMS + (SENTINEL_QUERY_PARAMS if sentinel else ())
    for key, _ in pairs:
        if key not in allowed:
            raise _fail(
                f"{scheme}://: unknown query parameter {key!r} (allowed: {', '.join(allowed)})"
            )
        if key in SSL_QUERY_PARAMS and not tls:
            tls_scheme = scheme.replace("redis", "rediss", 1)
            raise _fail(f"{scheme}://: {key} needs the TLS form ({tls_scheme}://)")
    return tuple(pairs)


def _cluster_path(path: str) -> int:
    if path not in ("", "/", "/0"):
        raise _fail(f"a cluster has only database 0; drop the path {path!r}")
    return 0


def _sentinel_path(path: str) -> tuple[str, int]:
    segments = [urllib.parse.unquote(s) for s in path.strip("/").split("/")] if path else []
    if not segments or not segments[0] or len(segments) > 2:
        raise _fail(
            "redis+sentinel:// needs the service name: "
            "redis+sentinel://host:port[,host:port...]/service_name[/db]"
        )
    db = 0
    if len(segments) == 2:
        if not segments[1].isdigit():
            raise _fail(f"sentinel database must be a number, got {segments[1]!r}")
        db = int(segments[1])
    return segments[0], db
