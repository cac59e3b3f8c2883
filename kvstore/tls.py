"""TLS on every port that crosses hosts: gRPC, the data port, HTTP.

A server is given ``--tls-cert`` and ``--tls-key`` (PEM); with ``--tls-ca``
it also verifies its peers' certificates, and a client (a node, an engine,
the conductor, the SDK) then presents one too (mutual TLS). Clients take
their files from :class:`TlsFiles` or the environment::

    KVSTORE_TLS_CA      the CA that signed the servers' certificates (enables TLS)
    KVSTORE_TLS_CERT    this client's certificate ... (mutual TLS)
    KVSTORE_TLS_KEY     ... and its key

Certificates name the hosts they serve (subjectAltName: IP addresses and DNS
names): clients check them. ``kvstore certs`` makes a CA and certificates for
a test cluster. Same-host shared memory, and the node's Unix socket, are
never encrypted: they do not leave the host.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

import grpc

CA_ENV = "KVSTORE_TLS_CA"
CERT_ENV = "KVSTORE_TLS_CERT"
KEY_ENV = "KVSTORE_TLS_KEY"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: a server's (cert, key[, ca]) or a client's (ca[, cert, key])."""

    cert: str = ""      # this side's certificate
    key: str = ""       # ... and its private key
    ca: str = ""        # the CA that signs the peers' certificates ("" : peers are not verified)

    @staticmethod
    def client_from_env() -> "TlsFiles | None":
        """A client's files from ``$KVSTORE_TLS_*``; None when ``$KVSTORE_TLS_CA`` is unset."""
        ca = os.environ.get(CA_ENV, "")
        if not ca:
            return None
        return TlsFiles(cert=os.environ.get(CERT_ENV, ""), key=os.environ.get(KEY_ENV, ""), ca=ca)

    def check_server(self) -> None:
        """Raises ValueError unless a server's cert and key are given and readable."""
        if not (self.cert and self.key):
            raise ValueError("TLS needs --tls-cert and --tls-key together")
        for path in (self.cert, self.key, self.ca):
            if path and not os.path.isfile(path):
                raise ValueError(f"TLS file {path} does not exist")


def _read(path: str) -> bytes | None:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def grpc_server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """A server's gRPC credentials; with a CA, clients must present certificates."""
    return grpc.ssl_server_credentials([(_read(files.key), _read(files.cert))],
                                       root_certificates=_read(files.ca),
                                       require_client_auth=bool(files.ca))


def grpc_channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """A client's gRPC credentials (its certificate too, for mutual TLS)."""
    return grpc.ssl_channel_credentials(root_certificates=_read(files.ca),
                                        private_key=_read(files.key),
                                        certificate_chain=_read(files.cert))


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """An ``ssl`` server context (data port, HTTP): TLS 1.2+, client certs with a CA."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files.cert, files.key)
    if files.ca:
        ctx.load_verify_locations(files.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """An ``ssl`` client context: verifies the server against the CA (and its name)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(files.ca)
    if files.cert:
        ctx.load_cert_chain(files.cert, files.key or None)
    return ctx
