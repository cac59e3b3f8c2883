"""The partition layout: one master shard, three nodes and a client host, on two networks.

    host x    etcd (on its control address)
    host m0   shard 0 master        host m1   shard 0 master (the other candidate)
    host b    node b0               host c    node c0               host d   node d0
    host e    the load (writer, readers, probes)

    control network "net"  : x m0 m1 b c d e   masters, etcd, the nodes' agents,
                                                clients' gRPC
    data network    "data" : b c d e            the nodes' data ports (clients' reads
                                                and writes, repair copies)

Two networks so that one path can be cut and the other kept: a node whose
control link is down is cut off from its master while clients still reach
it; a node whose data link is down is cut off from clients while its master
still hears it. Every server runs with ``--auth`` (admin, client and node
tokens of :func:`~kvstore.tools.cluster.multihost.make_credentials`), and with TLS
when asked.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.tools.cluster.multihost import ETCD_PORT, Credentials, make_credentials, start_etcd
from kvstore.tools.cluster.netns import NetHosts
from kvstore.tools.cluster.processes import Child, ProcessGroup, service_args

HOSTS = ["x", "m0", "m1", "b", "c", "d", "e"]
DATA_HOSTS = ["b", "c", "d", "e"]
NODES = {"b0": "b", "c0": "c", "d0": "d"}      # node id -> host
MASTER_PORT = 7001
CONTROL_SUBNET = "198.18.6.0/24"
DATA_SUBNET = "198.18.7.0/24"


def make_hosts() -> NetHosts:
    """The layout's hosts (not started)."""
    return NetHosts(HOSTS, subnet=CONTROL_SUBNET, extra={"data": (DATA_SUBNET, DATA_HOSTS)})


@dataclass
class PartitionCluster:
    """The started layout; :meth:`stop` ends its processes (not the hosts)."""

    hosts: NetHosts
    creds: Credentials
    procs: ProcessGroup
    masters: dict[str, Child] = field(default_factory=dict)    # host (m0, m1) -> master
    nodes: dict[str, Child] = field(default_factory=dict)      # node id -> node
    etcd: subprocess.Popen | None = None
    node_ttl_ms: int = 2000

    @property
    def seed(self) -> str:
        """Clients' and nodes' ``--master``: both candidates."""
        return "|".join(m.address for m in self.masters.values())

    def master_host(self, address: str) -> str:
        """The host (m0, m1) of the master at ``address``."""
        return next(h for h, m in self.masters.items() if m.address == address)

    def stop(self) -> None:
        self.procs.stop()
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            self.etcd.wait()


def start_partition_cluster(hosts: NetHosts, folder: str | Path, *, tls: bool = False,
                            node_ttl_ms: int = 2000, node_dram: str = "128MiB",
                            on_step=None) -> PartitionCluster:
    """Start etcd, the shard's two masters and the three nodes on started ``hosts``.

    Raises:
        ChildFailed: a process did not come up (what was started is stopped).
    """
    say = on_step or (lambda line: None)
    folder = Path(folder)
    addresses = [h.address for h in hosts.links.values()]
    creds = make_credentials(folder / "credentials", addresses, tls=tls)
    server = creds.server_args()
    procs = ProcessGroup(log_dir=str(folder / "logs"))
    pc = PartitionCluster(hosts, creds, procs, node_ttl_ms=node_ttl_ms)
    try:
        x = hosts["x"].address
        pc.etcd = start_etcd(hosts, folder / "etcd", host="x", address=x)
        say(f"etcd on host x at {x}:{ETCD_PORT}")
        shard_map = "|".join(f"{hosts[h].address}:{MASTER_PORT}" for h in ("m0", "m1"))
        for h in ("m0", "m1"):
            pc.masters[h] = procs.start(f"master-{h}", service_args(
                "master", "--host", hosts[h].address, "--port", str(MASTER_PORT),
                "--shard-map", shard_map, "--etcd", f"http://{x}:{ETCD_PORT}",
                "--cluster-name", f"part{hosts.id}", "--node-ttl-ms", str(node_ttl_ms),
                *server), prefix=hosts.exec_args(h))
            say(f"master on host {h} at {pc.masters[h].address}")
        for node_id, h in NODES.items():
            pc.nodes[node_id] = procs.start(node_id, service_args(
                "node", "--master", shard_map, "--host", hosts.on(h, "data").address,
                "--node-id", node_id, "--dram", node_dram, *server),
                env=creds.client_env("node"), prefix=hosts.exec_args(h))
            say(f"node {node_id} on host {h}: data port {pc.nodes[node_id].address}")
    except BaseException:
        pc.stop()
        raise
    return pc
