"""TLS test certificates (made with the `openssl` command line) and a TLS-only redis-server.

`make_pki(dir)` writes a CA, a server certificate for 127.0.0.1/localhost and a client
certificate signed by it, plus a second CA with its own server certificate and a certificate
of the first CA for another host name (for the "does not match" cases). `TlsRedisServer`
listens with TLS only (`--port 0 --tls-port P`); its `url` (for the readiness PING) presents
the client certificate and checks nothing; `tls_url(host, **params)` builds the tests' URLs.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlencode

from servers import RedisServer


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    other_server_cert: Path
    other_server_key: Path
    wrong_host_cert: Path
    wrong_host_key: Path


def _openssl(*args: str) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise RuntimeError("the TLS tests need the openssl command (apt-get install openssl)")
    subprocess.run([binary, *args], check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.crt"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             f"/CN={name}", "-keyout", str(key), "-out", str(cert))
    return cert, key


def _leaf(d: Path, name: str, ca: tuple[Path, Path], san: str | None,
          client: bool = False) -> tuple[Path, Path]:
    key, csr, cert, ext = (d / f"{name}.key", d / f"{name}.csr", d / f"{name}.crt",
                           d / f"{name}.ext")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
             "-keyout", str(key), "-out", str(csr))
    lines = ["basicConstraints=CA:FALSE",
             f"extendedKeyUsage={'clientAuth' if client else 'serverAuth'}"]
    if san:
        lines.append(f"subjectAltName={san}")
    ext.write_text("\n".join(lines) + "\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
             "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))
    return cert, key


def make_pki(d: Path) -> Pki:
    ca = _ca(d, "test-ca")
    other = _ca(d, "other-ca")
    server = _leaf(d, "server", ca, "IP:127.0.0.1,DNS:localhost")
    client = _leaf(d, "client", ca, None, client=True)
    other_server = _leaf(d, "other-server", other, "IP:127.0.0.1,DNS:localhost")
    wrong_host = _leaf(d, "wrong-host", ca, "DNS:cache.example.invalid")
    return Pki(ca[0], *server, *client, other[0], *other_server, *wrong_host)


class TlsRedisServer(RedisServer):
    """A redis-server that speaks TLS only; `auth_clients` is `--tls-auth-clients`."""

    def __init__(self, pki: Pki, cert: Path, key: Path, auth_clients: str = "yes",
                 *extra_args: str) -> None:
        super().__init__(*extra_args)
        self.pki = pki
        self.tls_args = ["--tls-cert-file", str(cert), "--tls-key-file", str(key),
                         "--tls-ca-cert-file", str(pki.ca), "--tls-auth-clients", auth_clients]

    def command(self) -> list[str]:
        argv = super().command()
        i = argv.index("--port")
        return [*argv[:i], "--port", "0", "--tls-port", argv[i + 1], *argv[i + 2:],
                *self.tls_args]

    def tls_url(self, host: str = "127.0.0.1", **params: str) -> str:
        query = f"?{urlencode(params)}" if params else ""
        return f"rediss://{host}:{self.port}/0{query}"

    @property
    def url(self) -> str:
        """For the readiness PING only: the client certificate, no server check (the servers
        of these tests have certificates that are wrong on purpose). Tests build their own
        URLs with `tls_url`."""
        return self.tls_url(ssl_cert_reqs="none", ssl_certfile=str(self.pki.client_cert),
                            ssl_keyfile=str(self.pki.client_key))


def peer_tls_args(pki: Pki) -> tuple[str, ...]:
    """Server options for TLS between servers too: the cluster bus and replication, each
    server presenting the client certificate when it connects to another."""
    return ("--tls-cluster", "yes", "--tls-replication", "yes",
            "--tls-client-cert-file", str(pki.client_cert),
            "--tls-client-key-file", str(pki.client_key))


def tls_node_maker(pki: Pki) -> Callable[..., TlsRedisServer]:
    """`make(*extra_args)`: a TLS-only server (the good certificate, client certificates
    required) that also speaks TLS to its peers; what `ClusterServers` and `SentinelSetup`
    take as `server_cls`."""

    def make(*extra_args: str) -> TlsRedisServer:
        return TlsRedisServer(pki, pki.server_cert, pki.server_key, "yes", *extra_args,
                              *peer_tls_args(pki))

    return make


def sentinel_tls_args(pki: Pki) -> tuple[str, ...]:
    """A sentinel that listens in plain text (as `rediss+sentinel://` expects: TLS is for the
    master connections) and reaches the TLS-only master and replica over TLS."""
    return ("--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key),
            "--tls-ca-cert-file", str(pki.ca), "--tls-replication", "yes",
            "--tls-client-cert-file", str(pki.client_cert),
            "--tls-client-key-file", str(pki.client_key))


def cli_tls_args(pki: Pki) -> tuple[str, ...]:
    """redis-cli's options to reach these servers (e.g. for `--cluster create`)."""
    return ("--tls", "--cacert", str(pki.ca), "--cert", str(pki.client_cert),
            "--key", str(pki.client_key))


def client_tls_query(pki: Pki) -> str:
    """The URL query that verifies these servers and presents the client certificate."""
    return urlencode({"ssl_ca_certs": str(pki.ca), "ssl_certfile": str(pki.client_cert),
                      "ssl_keyfile": str(pki.client_key)})
