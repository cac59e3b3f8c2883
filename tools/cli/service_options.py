"""The options every service's command line shares, and the checks made on them.

:mod:`kvstore.tools.cli.services` builds each service's parser on
:func:`service_parser` (logging, its listener's security, its own credentials
as a client, observability), turns the shared options into config fields
(:func:`secured`, :func:`client_creds`) and answers ``--check-config``
(:func:`checked`). A bad option is one line and exit status 2
(:func:`require` raises ValueError; :class:`OneLineParser`).
"""

from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    """A TCP port number, 0 (pick a free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port (0-65535)")
    return port


class OneLineParser(argparse.ArgumentParser):
    """A parser whose usage errors are one line on stderr and status 2, as the
    checks after parsing are (argparse prints the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def service_parser(name: str, description: str, client: bool = True,
            observed: bool = True, one_line: bool = False) -> argparse.ArgumentParser:
    """A service's parser with the options every service shares: logging, its own
    listener's security and, for services that are clients too, their credentials.
    ``one_line``: usage errors are one line (no usage text before them)."""
    cls = OneLineParser if one_line else argparse.ArgumentParser
    p = cls(prog=f"kvstore {name}", description=description)
    p.add_argument("--log-level", default="INFO")
    g = p.add_argument_group("security (see docs/security.md)")
    g.add_argument("--auth", default="", metavar="FILE",
                   help="authenticate every connection: a file of 'ROLE TOKEN' lines "
                        "(roles admin, client, node, metrics); re-read on SIGHUP")
    g.add_argument("--tls-cert", default="", metavar="PEM", help="serve TLS with this certificate")
    g.add_argument("--tls-key", default="", metavar="PEM", help="... and its private key")
    g.add_argument("--tls-ca", default="", metavar="PEM",
                   help="verify peers against this CA: clients must present certificates "
                        "(mutual TLS), and this process checks the servers it calls")
    g.add_argument("--insecure", action="store_true",
                   help="allow listening on a non-loopback address without --auth (warned)")
    g.add_argument("--advertise-host", default="",
                   help="the address others reach this process by (default: the bind "
                        "address, or for 0.0.0.0 the interface that reaches the master)")
    if client:
        g.add_argument("--token-file", default="", metavar="FILE",
                       help="this process's own token as a client of the store "
                            "(default: $KVSTORE_TOKEN or $KVSTORE_TOKEN_FILE)")
    p.add_argument("--check-config", action="store_true",
                   help="parse the options and read the files they name, then exit "
                        "(0: usable, 2: not) without serving")
    p.set_defaults(metrics_port=None, metrics_host="", drain_s=0.0)
    if not observed:
        return p
    o = p.add_argument_group("observability (see docs/operations.md)")
    o.add_argument("--metrics-port", type=port_number, default=None,
                   help="serve /metrics (Prometheus), /health and /ready on this port "
                        "(0: a free one; default: none)")
    o.add_argument("--metrics-host", default="",
                   help="bind address of the metrics port (default: the service's --host)")
    o.add_argument("--drain-s", type=float, default=0.0,
                   help="on SIGTERM, report NOT_SERVING this long (s) before the listener "
                        "stops; calls in flight then finish")
    return p


def server_security(a: argparse.Namespace):
    """The listener's ServerSecurity from --auth and --tls-*.

    Raises:
        ValueError: a bad token file or incomplete TLS options (one line, exit 2).
        OSError: a file that cannot be read.
    """
    from kvstore.auth import TokenFile
    from kvstore.rpc import ServerSecurity
    from kvstore.tls import TlsFiles

    tls = None
    if a.tls_cert or a.tls_key:
        tls = TlsFiles(a.tls_cert, a.tls_key, a.tls_ca)
        tls.check_server()
    elif a.tls_ca:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key")
    return ServerSecurity(tokens=TokenFile(a.auth) if a.auth else None, tls=tls)


def client_creds(a: argparse.Namespace):
    """The process's credentials as a client: its token (--token-file or the
    environment) and TLS files (its own certificate and CA when it serves TLS,
    else $KVSTORE_TLS_*)."""
    from kvstore.rpc import ClientCredentials
    from kvstore.tls import TlsFiles

    tls = TlsFiles(a.tls_cert, a.tls_key, a.tls_ca) if a.tls_ca else None
    return ClientCredentials.resolve(token_file=getattr(a, "token_file", "") or None, tls=tls)


def require(ok: bool, message: str) -> None:
    """A check of the options that --check-config and a real start share.

    Raises:
        ValueError: ``message`` (one line, exit 2).
    """
    if not ok:
        raise ValueError(message)


def check_common(a: argparse.Namespace) -> None:
    import logging
    import math

    require(isinstance(logging.getLevelName(a.log_level.upper()), int),
             f"--log-level {a.log_level!r}: not a logging level (DEBUG, INFO, WARNING, ERROR)")
    require(math.isfinite(a.drain_s) and a.drain_s >= 0,
             f"--drain-s must be a number of seconds >= 0, got {a.drain_s}")
    from kvstore.binding import split_address

    for address in (getattr(a, "master", None) or "").split("|"):
        if address.strip():
            split_address(address)        # InvalidArgument: not HOST:PORT (one line, exit 2)
    port = getattr(a, "port", 0)
    for other in ("metrics_port", "http_port"):
        value = getattr(a, other, None)
        require(not (port and value and value == port),
                 f"--{other.replace('_', '-')} {value} is the service's own --port")


def secured(a: argparse.Namespace) -> dict:
    """The config fields every service takes: security, metrics, draining."""
    from kvstore.metrics import MetricsConfig

    check_common(a)
    return dict(security=server_security(a), insecure=a.insecure, advertise_host=a.advertise_host,
                metrics=MetricsConfig(a.metrics_port, a.metrics_host), drain_s=a.drain_s)


def checked(name: str, a: argparse.Namespace, cfg) -> bool:
    """With --check-config: check the listeners' binding rules, print one line and
    say True (the caller exits without serving).

    Raises:
        BindRefused: a non-loopback listener without --auth or --insecure.
    """
    if not a.check_config:
        return False
    from kvstore.binding import check_binding

    authenticated = cfg.security.tokens is not None
    metrics = getattr(cfg, "metrics", None)
    hosts = {cfg.host, (metrics.host if metrics is not None else "") or cfg.host}
    if getattr(cfg, "http_port", None) is not None:
        hosts.add(cfg.http_host)
    for host in hosts:
        if host and not cfg.insecure:       # --insecure: allowed (serving warns)
            check_binding(name, host, authenticated, insecure=False)
    print(f"kvstore {name}: configuration ok")
    return True
