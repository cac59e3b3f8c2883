"""Several hosts on one machine: Linux network namespaces joined by a bridge.

    host a (netns kvs-<id>-a)  198.18.0.1/24  veth --+
    host b (netns kvs-<id>-b)  198.18.0.2/24  veth --+-- bridge br0 (netns kvs-<id>-sw)
    ...                                              |
    host e (netns kvs-<id>-e)  198.18.0.5/24  veth --+

Every host is a network namespace of its own with a loopback and one veth
link to a bridge that lives in a namespace of its own (the "switch"); a
host may also sit on further networks (``extra``: one more bridge and one
more veth link each, e.g. a data network apart from the control network, so
that one path between two hosts can be cut and another kept); the
root namespace gets no interface, address or route, so nothing leaves the
namespaces :class:`NetHosts` made. Addresses come from 198.18.0.0/15 only
(RFC 2544's benchmarking range) and :class:`NetHosts` refuses any other.
A process runs on a host through ``ip netns exec`` (:meth:`NetHosts.exec_args`):
it sees only that host's interfaces, its own loopback and its own abstract
Unix sockets (so kvstore's same-host paths stay inside a host; shared
memory is keyed by a host identity that includes the namespace).

:meth:`NetHosts.cut` takes a host's link down (and :meth:`NetHosts.mend`
brings it back): a network partition, since ``tc netem`` is not available
everywhere. With several networks, a cut names the network. Closing (also on a failed start, and at interpreter exit)
deletes every namespace, which removes the veths and the bridge with them.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and ``ip`` (iproute2);
:func:`unavailable` says why not before anything is made.
"""

from __future__ import annotations

import atexit
import ipaddress
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass

#: The only range hosts may use (RFC 2544, set aside for benchmarking).
ALLOWED = ipaddress.ip_network("198.18.0.0/15")
DEFAULT_SUBNET = "198.18.0.0/24"


class NetnsError(RuntimeError):
    """A namespace, link or address could not be made (the ``ip`` command's message)."""


@dataclass(frozen=True, slots=True)
class Host:
    name: str        # "a", "b", ...
    netns: str       # the namespace: kvs-<id>-<name>
    address: str     # its address on the bridge, 198.18.x.y
    dev: str         # its veth, inside its namespace


def _addresses(subnet: str, count: int) -> list[str]:
    """The first ``count`` host addresses of ``subnet`` (inside 198.18.0.0/15, /24 wide)."""
    net = ipaddress.ip_network(subnet)
    if not net.subnet_of(ALLOWED):
        raise ValueError(f"{subnet} is outside {ALLOWED} (the only range hosts may use)")
    if net.prefixlen != 24:
        raise ValueError(f"{subnet}: host subnets are /24")
    addrs = list(net.hosts())
    if len(addrs) < count:
        raise ValueError(f"{subnet} has room for {len(addrs)} hosts, not {count}")
    return [str(a) for a in addrs[:count]]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"kvs-probe-{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def sweep_stale(prefix: str = "kvs") -> list[str]:
    """Delete namespaces ``<prefix>-<pid>.*`` whose owner process is gone.

    Returns:
        The names deleted.
    """
    listed = _ip("netns", "list", check=False).stdout.split()
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)\.[0-9a-f]+-\w+$")
    gone = []
    for name in listed:
        m = pattern.match(name)
        if m and not _alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class NetHosts:
    """Hosts ``names`` (each a network namespace) on one bridge; a context manager.

    Args:
        names: host names, short (``a``, ``b``, ...): interface names are
            limited to 15 characters.
        subnet: where the addresses come from (inside 198.18.0.0/15); the
            hosts get its first addresses in order.
        extra: further networks, name -> (subnet, member hosts): each its own
            bridge, each member one more veth (``<name>-<host>``) and an
            address from that subnet (in ``names`` order). Names are short
            (<= 6 characters) and differ from ``net``, the first network's.
        prefix: namespaces are named ``<prefix>-<pid>.<random>-<name>``, the
            pid being the owner's; :meth:`start` first deletes namespaces of
            this prefix whose owner is dead (one killed by SIGKILL could not
            clean up after itself).

    Raises:
        ValueError: a subnet outside 198.18.0.0/15, too small, or bad names.
    """

    def __init__(self, names: list[str], subnet: str = DEFAULT_SUBNET, prefix: str = "kvs",
                 extra: dict[str, tuple[str, list[str]]] | None = None):
        if len(set(names)) != len(names) or not all(n.isalnum() and len(n) <= 8 for n in names):
            raise ValueError(f"host names must be distinct, alphanumeric, <= 8 chars: {names}")
        addrs = _addresses(subnet, len(names))
        self.prefix = prefix
        self.id = f"{os.getpid()}.{secrets.token_hex(2)}"
        self.prefixlen = 24
        self.switch = f"{prefix}-{self.id}-sw"
        self.hosts: dict[str, Host] = {
            n: Host(n, f"{prefix}-{self.id}-{n}", addrs[i], f"eth-{n}")
            for i, n in enumerate(names)}
        # (network, host) -> Host on that network; the first network is "net".
        self.links: dict[tuple[str, str], Host] = {("net", n): h for n, h in self.hosts.items()}
        for net_name, (net_subnet, members) in (extra or {}).items():
            if net_name == "net" or not net_name.isalnum() or len(net_name) > 6:
                raise ValueError(f"network names are alphanumeric, <= 6 chars, not 'net': "
                                 f"{net_name!r}")
            unknown = set(members) - set(names)
            if unknown:
                raise ValueError(f"network {net_name}: unknown hosts {sorted(unknown)}")
            members = [n for n in names if n in members]
            for n, addr in zip(members, _addresses(net_subnet, len(members))):
                self.links[(net_name, n)] = Host(n, self.hosts[n].netns, addr, f"{net_name}-{n}")
        self._made: list[str] = []

    # ---- life cycle ----
    def start(self) -> "NetHosts":
        """Make the namespaces, the bridge and the links.

        Raises:
            NetnsError: something could not be made (what was made is removed).
        """
        sweep_stale(self.prefix)
        atexit.register(self.close)
        try:
            self._add_netns(self.switch)
            for h in self.hosts.values():
                self._add_netns(h.netns)
                _ip("-n", h.netns, "link", "set", "lo", "up")
            bridges: dict[str, str] = {}
            for i, ((net_name, _n), h) in enumerate(self.links.items()):
                if net_name not in bridges:
                    bridges[net_name] = "br0" if net_name == "net" else f"br-{net_name}"
                    _ip("-n", self.switch, "link", "add", bridges[net_name], "type", "bridge")
                    _ip("-n", self.switch, "link", "set", bridges[net_name], "up")
                port = f"p{i}"
                _ip("link", "add", h.dev, "netns", h.netns, "type", "veth",
                    "peer", "name", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", bridges[net_name])
                _ip("-n", self.switch, "link", "set", port, "up")
                _ip("-n", h.netns, "addr", "add", f"{h.address}/{self.prefixlen}", "dev", h.dev)
                _ip("-n", h.netns, "link", "set", h.dev, "up")
        except BaseException:
            self.close()
            raise
        return self

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def close(self) -> None:
        """Delete every namespace made (with their links); safe to call twice."""
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)
        atexit.unregister(self.close)

    def __enter__(self) -> "NetHosts":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- use ----
    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def exec_args(self, name: str) -> list[str]:
        """The prefix that runs a command on host ``name``: ``ip netns exec NS``."""
        return ["ip", "netns", "exec", self.hosts[name].netns]

    def run(self, name: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``argv`` on host ``name`` to completion (``subprocess.run`` keywords)."""
        return subprocess.run([*self.exec_args(name), *argv], **kwargs)

    def popen(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on host ``name`` (``ip netns exec`` execs it: the pid is its own)."""
        return subprocess.Popen([*self.exec_args(name), *argv], **kwargs)

    def on(self, name: str, network: str = "net") -> Host:
        """Host ``name`` as seen on ``network`` (its address and veth there).

        Raises:
            KeyError: the host is not on that network.
        """
        return self.links[(network, name)]

    def cut(self, name: str, network: str = "net") -> None:
        """Take host ``name``'s link to ``network`` down: over that network it
        reaches no other host and none reaches it."""
        h = self.on(name, network)
        _ip("-n", h.netns, "link", "set", h.dev, "down")

    def mend(self, name: str, network: str = "net") -> None:
        """Bring host ``name``'s link to ``network`` back up."""
        h = self.on(name, network)
        _ip("-n", h.netns, "link", "set", h.dev, "up")

    def table(self) -> list[tuple[str, str, str]]:
        """(host, namespace, address) of every host, for people."""
        return [(h.name, h.netns, h.address) for h in self.hosts.values()]
