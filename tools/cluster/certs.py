"""``kvstore certs DIR --host H ...``: a CA and certificates for a test cluster.

    DIR/ca.pem, ca.key          a self-signed CA (valid ten years)
    DIR/server.pem, server.key  a certificate for every --host (IP or name) and
                                localhost/127.0.0.1: give it to every server
                                (--tls-cert, --tls-key; --tls-ca DIR/ca.pem)
    DIR/client.pem, client.key  a client certificate for mutual TLS
                                ($KVSTORE_TLS_CERT, $KVSTORE_TLS_KEY)

For trying TLS on one machine or a lab cluster; a production cluster takes
its certificates from the organisation's CA. Needs ``cryptography``
(``pip install 'kvstore[tls]'``). Keys are written with mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer


@dataclass(frozen=True, slots=True)
class CertSet:
    """The files :func:`make_certs` wrote."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _names(hosts: list[str]):
    from cryptography import x509

    out, seen = [], set()
    for h in ["localhost", "127.0.0.1", *hosts]:
        if h in seen:
            continue
        seen.add(h)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def make_certs(folder: str | os.PathLike, hosts: list[str]) -> CertSet:
    """Write a CA, a server certificate for ``hosts`` and a client certificate.

    Raises:
        ModuleNotFoundError: ``cryptography`` is not installed.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def write(name: str, data: bytes, private: bool = False) -> Path:
        path = folder / name
        path.write_bytes(data)
        if private:
            path.chmod(0o600)
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvstore test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=3650))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def issue(common_name: str, usage, sans=None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
                   .issuer_name(ca_name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=825))
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    server_key, server = issue("kvstore server", [ExtendedKeyUsageOID.SERVER_AUTH,
                                                    ExtendedKeyUsageOID.CLIENT_AUTH], _names(hosts))
    client_key, client = issue("kvstore client", [ExtendedKeyUsageOID.CLIENT_AUTH])
    pem = serialization.Encoding.PEM
    write("ca.key", key_pem(ca_key), private=True)
    return CertSet(ca=write("ca.pem", ca.public_bytes(pem)),
                   server_cert=write("server.pem", server.public_bytes(pem)),
                   server_key=write("server.key", key_pem(server_key), private=True),
                   client_cert=write("client.pem", client.public_bytes(pem)),
                   client_key=write("client.key", key_pem(client_key), private=True))


def certs_command(
    folder: Annotated[str, typer.Argument(help="Folder to write the PEM files into.")],
    host: Annotated[list[str], typer.Option(help="An IP or DNS name the server "
                                               "certificate must be valid for (repeat).")] = [],
) -> None:
    """Write a test CA and certificates (see the module docstring)."""

    try:
        made = make_certs(folder, host)
    except ModuleNotFoundError:
        typer.echo("kvstore certs: error: needs the cryptography package "
                   "(pip install 'kvstore[tls]')", err=True)
        raise typer.Exit(2)
    typer.echo(f"CA {made.ca}; server {made.server_cert} ({', '.join(['localhost', '127.0.0.1', *host])}); "
               f"client {made.client_cert}")
