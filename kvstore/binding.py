"""Where a server listens and what address it gives others: loopback unless secured.

Every listener binds loopback by default. Binding one to any other address
(a host address, ``0.0.0.0``, ``::``) needs ``--auth``: without it a server
refuses to start (:func:`check_binding`, one line, exit code 2), unless
``--insecure`` is given, which logs a warning at start and every minute.

A server bound to a wildcard never advertises the wildcard: it gives
``--advertise-host``, else the address of its interface that reaches the
peer it reports to (a node: its master), else the address its host name
resolves to (:func:`advertised_host`).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading

log = logging.getLogger(__name__)

_WILDCARDS = ("0.0.0.0", "::", "")
INSECURE_WARNING_INTERVAL_S = 60.0


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (an IPv6 host in brackets, ``[::1]:50051``) as (host, port).

    Raises:
        InvalidArgument: no host, no port, or a port outside 1-65535 (gRPC
            would dial another port: 99999 wraps to 34463).
    """
    from kvstore.errors import InvalidArgument

    host, sep, port = str(address).strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidArgument(f"{address!r} is not an address HOST:PORT (port 1-65535)")
    return host.strip("[]"), int(port)


class BindRefused(ValueError):
    """A non-loopback listener without authentication (and without ``--insecure``)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this host's loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback
                       for info in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def check_binding(service: str, host: str, authenticated: bool, insecure: bool) -> None:
    """Refuse an unauthenticated listener that other hosts can reach.

    Raises:
        BindRefused: ``host`` is not loopback, no ``--auth``, no ``--insecure``.
    """
    if is_loopback(host) or authenticated:
        return
    if not insecure:
        raise BindRefused(f"refusing to listen on {host} without --auth (every connection "
                          f"from another host must authenticate); pass --insecure to allow it")
    _warn_insecure(service, host)
    thread = threading.Thread(target=_keep_warning, args=(service, host), daemon=True,
                              name="insecure-warning")
    thread.start()


def _warn_insecure(service: str, host: str) -> None:
    log.warning("%s listens on %s WITHOUT authentication (--insecure): anyone who can reach "
                "it can read, write and remove", service, host)


def _keep_warning(service: str, host: str) -> None:
    stop = threading.Event()
    while not stop.wait(INSECURE_WARNING_INTERVAL_S):
        _warn_insecure(service, host)


def advertised_host(bind_host: str, advertise_host: str = "", toward: str = "") -> str:
    """The address to give others for a server bound to ``bind_host``.

    Args:
        advertise_host: ``--advertise-host``; wins when given.
        toward: ``host:port`` of a peer; a wildcard bind advertises the
            address of the interface that reaches it.
    """
    if advertise_host:
        return advertise_host
    if bind_host not in _WILDCARDS:
        return bind_host
    if toward:
        host, _, port = toward.rpartition(":")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host.strip("[]"), int(port or 9)))   # no packet is sent
                return s.getsockname()[0]
        except (OSError, ValueError):
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
