"""Many kvstore processes on one machine: ``kvstore up`` and the tests' cluster.

    shard 0: master [+ standby]    shard 1: master [+ standby]   ...   (static shard map)
        ^ register / heartbeat with every shard (leader found by trying a|b)
    node n0, n1, ... (DRAM, shared memory)

Master ports are picked before start (the static shard map names them);
every other port is chosen by its process and read from its READY line.
With ``etcd`` each shard runs ``standbys`` extra masters and elects its
leader through an etcd lease (:mod:`kvstore.master.election`).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from kvstore.process import Child, ChildFailed, Cluster, terminate


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago (bound together, then released)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class StoreCluster:
    """A started cluster; stop it with :meth:`stop` (or use it as a context manager)."""

    procs: Cluster
    shard_map: str                         # --shard-map value: "a|b,c|d"
    shards: list[list[Child]]              # per shard: its master processes
    nodes: dict[str, Child] = field(default_factory=dict)
    etcd: "EtcdServer | None" = None
    master_args: list[str] = field(default_factory=list)   # common to every master
    node_args: list[str] = field(default_factory=list)     # common to every node

    @property
    def master(self) -> str:
        """Seed address for clients and nodes (shard 0's masters)."""
        return self.shard_map.split(",")[0]

    def start_node(self, node_id: str, dram: str = "64MiB") -> Child:
        child = self.procs.start(node_id, ["-m", "kvstore.store.server", "--master", self.master,
                                           "--node-id", node_id, "--dram", dram,
                                           *self.node_args])
        self.nodes[node_id] = child
        return child

    def restart_master(self, shard_id: int, which: int = 0) -> Child:
        """Start a (stopped or killed) master of a shard again on the same port."""
        old = self.shards[shard_id][which]
        port = old.info["port"]
        child = self.procs.start(f"{old.name}-r", ["-m", "kvstore.master.server",
                                                  "--shard-id", str(shard_id), "--shard-map",
                                                  self.shard_map, "--port", str(port),
                                                  *self.master_args])
        self.shards[shard_id][which] = child
        return child

    def stop(self) -> None:
        self.procs.stop()
        if self.etcd is not None:
            self.etcd.stop()

    def __enter__(self) -> "StoreCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class EtcdServer:
    """A throwaway single-member etcd on loopback (data in a temp dir)."""

    def __init__(self, log_dir: str | None = None):
        if shutil.which("etcd") is None:
            raise FileNotFoundError("etcd is not on PATH (apt-get install etcd-server)")
        client, peer = free_ports(2)
        self.url = f"http://127.0.0.1:{client}"
        self.dir = tempfile.mkdtemp(prefix="kvstore-etcd-")
        log = open(os.path.join(log_dir, "etcd.log"), "ab") if log_dir else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            ["etcd", "--name", "kv", "--data-dir", self.dir,
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"kv=http://127.0.0.1:{peer}"],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        if log_dir:
            log.close()
        self._wait()

    def _wait(self, timeout_s: float = 20.0) -> None:
        from kvstore.master.election import Etcd, EtcdError

        etcd = Etcd(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                etcd.get("/kvstore/ping")
                return
            except EtcdError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise ChildFailed(f"etcd did not start on {self.url}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        terminate(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def start_store_cluster(masters: int = 1, nodes: int = 2, *, standbys: int = 0,
                        etcd: str | None = None, dram: str = "64MiB", node_ttl_ms: int = 3000,
                        lease_ttl_s: int = 3, log_dir: str | None = None,
                        eviction_policy: str = "none", on_step=None) -> StoreCluster:
    """Start ``masters`` master shards (each with ``standbys`` standbys) and ``nodes`` nodes.

    Args:
        etcd: etcd URL for leader election; ``"local"``: the one named by
            ``$KVSTORE_ETCD`` if set (CI starts one), else a throwaway one;
            ``"spawn"``: always a throwaway one (``cluster.etcd``); None
            (default): no election (then ``standbys`` must be 0).
        on_step: called with a line per started process (for a CLI).

    Raises:
        ChildFailed: a process did not come up.
    """
    if standbys and not etcd:
        raise ValueError("standbys need etcd for leader election")
    procs = Cluster(log_dir=log_dir)
    etcd_server = None
    try:
        if etcd == "local" and os.environ.get("KVSTORE_ETCD"):
            etcd = os.environ["KVSTORE_ETCD"]
        if etcd in ("local", "spawn"):
            etcd_server = EtcdServer(log_dir)
            etcd = etcd_server.url
        per = 1 + standbys
        ports = free_ports(masters * per)
        shard_addrs = [[f"127.0.0.1:{ports[i * per + j]}" for j in range(per)]
                       for i in range(masters)]
        shard_map = ",".join("|".join(a) for a in shard_addrs)
        master_args = ["--node-ttl-ms", str(node_ttl_ms)]
        if etcd:
            master_args += ["--etcd", etcd, "--cluster-name", f"c{uuid.uuid4().hex[:8]}",
                            "--lease-ttl-s", str(lease_ttl_s)]
        cluster = StoreCluster(procs, shard_map, [], etcd=etcd_server, master_args=master_args,
                               node_args=["--eviction-policy", eviction_policy])
        for i, addrs in enumerate(shard_addrs):
            cluster.shards.append([])
            for j, addr in enumerate(addrs):
                name = f"master{i}" + (f"-{j}" if per > 1 else "")
                args = ["-m", "kvstore.master.server", "--port", addr.rsplit(":", 1)[1],
                        *master_args]
                if masters > 1 or per > 1:
                    args += ["--shard-id", str(i), "--shard-map", shard_map]
                cluster.shards[i].append(procs.start(name, args))
                if on_step:
                    on_step(f"{name}: shard {i} at {addr}")
        for k in range(nodes):
            child = cluster.start_node(f"n{k}", dram)
            if on_step:
                on_step(f"n{k}: node at {child.address}")
    except BaseException:
        procs.stop()
        if etcd_server is not None:
            etcd_server.stop()
        raise
    return cluster
