"""kvstore with TLS on (``--tls``): a second master and node serving mutual TLS and tokens.

Rows (``kvstore``), each the twin of a plain row at the same size and op::

    tcp+tls        get, put   as ``tcp``, over mutual TLS
    tcp-batch+tls  get, put   as ``tcp-batch``, over mutual TLS

The run makes a throwaway CA and certificates
(:func:`kvstore.tools.cluster.certs.make_certs`) and a token file in a temporary
folder, removed when the run ends. The master and the node serve with
``--tls-cert server.pem --tls-key server.key --tls-ca ca.pem --auth FILE``;
the node holds the node token (``$KVSTORE_TOKEN``) and, as a client of the
master, presents its own server certificate. The measured client holds a
client token and the client certificate, a second one an admin token for
the node's stats between rows.

The rows are measured exactly as their plain twins
(:mod:`~kvstore.tools.bench.kvstore_peer`), right after them at each size,
so the report's ``vs plain`` ratio compares the two under one state of the
machine. Tokens cost one challenge-response per connection, not per value:
the ratio is the cost of TLS. Shared memory never leaves the host and is
never encrypted, so there are no shm rows; nor concurrent or exists ones.
"""

from __future__ import annotations

import os
import secrets
import tempfile

from kvstore.tools.bench.harness import BenchConfig
from kvstore.tools.bench.kvstore_peer import KvstorePeer, Secured


def secure_folder(folder: str) -> Secured:
    """Write certificates and a token file (admin, client, node) into ``folder``.

    Raises:
        RuntimeError: ``cryptography`` is not installed (``pip install 'kvstore[tls]'``).
    """
    from kvstore.tls import TlsFiles
    from kvstore.tools.cluster.certs import make_certs

    try:
        certs = make_certs(folder, ["127.0.0.1"])
    except ModuleNotFoundError as exc:
        raise RuntimeError("--tls needs the cryptography package "
                           "(pip install 'kvstore[tls]')") from exc
    tokens = {role: secrets.token_hex(16) for role in ("admin", "client", "node")}
    auth = os.path.join(folder, "tokens")
    fd = os.open(auth, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{role} {token}\n" for role, token in tokens.items())
    client_tls = TlsFiles(cert=str(certs.client_cert), key=str(certs.client_key),
                          ca=str(certs.ca))
    return Secured(
        server_args=("--auth", auth, "--tls-cert", str(certs.server_cert),
                     "--tls-key", str(certs.server_key), "--tls-ca", str(certs.ca)),
        env={"KVSTORE_TOKEN": tokens["node"]},
        client={"token": tokens["client"], "tls": client_tls},
        admin={"token": tokens["admin"], "tls": client_tls})


class KvstoreTlsPeer(KvstorePeer):
    """:class:`KvstorePeer` on a secured cluster; its certificates go when it stops."""

    def __init__(self, cfg: BenchConfig, log_dir: str):
        self.folder = tempfile.TemporaryDirectory(prefix="kvstore-bench-tls-")
        try:
            super().__init__(cfg, log_dir, secure_folder(self.folder.name))
        except BaseException:
            self.folder.cleanup()
            raise

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.folder.cleanup()


def start(cfg: BenchConfig, log_dir: str) -> KvstoreTlsPeer | None:
    """The secured cluster and its clients when ``cfg.tls``, else None."""
    return KvstoreTlsPeer(cfg, log_dir) if cfg.tls else None
