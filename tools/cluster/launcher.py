"""The one launcher: kvstore's services as processes on this machine.

    shard 0: master [+ standby]    shard 1: master [+ standby]   ...   (static shard map)
        ^ register / heartbeat with every shard (leader found by trying its masters)
    node n0, n1, ... (DRAM, shared memory [, SSD])
    [engines: prefill0.., decode0..   conductor (+ HTTP front)]        (LocalCluster)

:func:`start_store_cluster` starts the store (``kvstore up``, ``kvstore
chaos``, the tests); :class:`LocalCluster` adds the engines and the
conductor on top of a one-shard store (``kvstore demo``). Master ports are
picked before start (the static shard map names them); every other port is
chosen by its process and read from its READY line. With ``etcd`` each
shard runs ``standbys`` extra masters and elects its leader through an etcd
lease (:mod:`kvstore.master.election`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field

from kvstore.master.election import Etcd, EtcdError
from kvstore.tools.cluster.processes import (Child, ChildFailed, ProcessGroup, free_ports,
                                             service_args, terminate)


@dataclass
class StoreCluster:
    """A started store; stop it with :meth:`stop` (or use it as a context manager)."""

    procs: ProcessGroup
    shard_map: str                         # --shard-map value: "a|b,c|d"
    shards: list[list[Child]]              # per shard: its master processes
    nodes: dict[str, Child] = field(default_factory=dict)
    etcd: "EtcdServer | None" = None
    master_args: list[str] = field(default_factory=list)   # common to every master
    node_args: list[str] = field(default_factory=list)     # common to every node
    dram: str = "64MiB"                    # each node's DRAM tier
    ssd: str = ""                          # each node's SSD tier ("" none) ...
    ssd_dir: str = ""                      # ... under ssd_dir/<node id>
    env: dict = field(default_factory=dict)  # for every process (e.g. KVSTORE_TOKEN)
    # Without etcd, each master keeps its shard's roster of nodes in its own folder
    # here (--state-dir), so that a restart waits for exactly the nodes it knew.
    state_dir: str = ""

    @property
    def master(self) -> str:
        """Seed address for clients and nodes (shard 0's masters)."""
        return self.shard_map.split(",")[0]

    def start_node(self, node_id: str, dram: str | None = None,
                   timeout_s: float = 60.0) -> Child:
        """Start (or restart, on its SSD path) store node ``node_id``; ``timeout_s``: for
        its READY (a node with millions of SSD objects takes minutes)."""
        args = ["--master", self.master, "--node-id", node_id, "--dram", dram or self.dram,
                *self.node_args]
        if self.ssd:
            args += ["--ssd", self.ssd, "--ssd-path", os.path.join(self.ssd_dir, node_id)]
        child = self.procs.start(node_id, service_args("node", *args), env=self.env,
                                 timeout_s=timeout_s)
        self.nodes[node_id] = child
        return child

    def master_state(self, name: str) -> list[str]:
        """The ``--state-dir`` option of master ``name`` (none with etcd)."""
        return ["--state-dir", os.path.join(self.state_dir, name)] if self.state_dir else []

    def restart_master(self, shard_id: int, which: int = 0, timeout_s: float = 60.0) -> Child:
        """Start a (stopped or killed) master of a shard again on the same port (and
        state folder)."""
        old = self.shards[shard_id][which]
        base, _, n = old.name.partition("-r")
        name = f"{base}-r{int(n or 0) + 1}"          # master0-r1, master0-r2, ...
        child = self.procs.start(name, service_args(
            "master", "--shard-id", str(shard_id), "--shard-map", self.shard_map,
            "--port", str(old.info["port"]), *self.master_state(base), *self.master_args),
            env=self.env, timeout_s=timeout_s)
        self.shards[shard_id][which] = child
        return child

    def stop(self) -> None:
        self.procs.stop()
        if self.etcd is not None:
            self.etcd.stop()
        if self.state_dir:
            shutil.rmtree(self.state_dir, ignore_errors=True)

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
                        eviction_policy: str = "none", ssd: str = "", ssd_dir: str = "",
                        node_args: tuple[str, ...] = (), node_prefix: str = "n",
                        master_args: tuple[str, ...] = (), env: dict | None = None,
                        procs: ProcessGroup | None = None, on_step=None) -> StoreCluster:
    """Start ``masters`` master shards (each with ``standbys`` standbys) and ``nodes`` nodes.

    Args:
        etcd: etcd URL for leader election; ``"local"``: the one named by
            ``$KVSTORE_ETCD`` if set (CI starts one), else a throwaway one;
            ``"spawn"``: always a throwaway one (``cluster.etcd``); None
            (default): no election (then ``standbys`` must be 0).
        eviction_policy: every node's ``--eviction-policy`` ("none": a full
            node answers NoSpace, the store rules the tests check).
        ssd, ssd_dir: give each node an SSD tier of ``ssd`` bytes under
            ``ssd_dir/<node id>``.
        node_args: more options for every node.
        master_args: more options for every master (e.g. ``--auth FILE``).
        env: environment for every process (e.g. ``KVSTORE_TOKEN`` of the nodes).
        node_prefix: nodes are named ``<prefix>0``, ``<prefix>1``, ...
        procs: start the processes in this group (default: a new one).
        on_step: called with a line per started process (for a CLI).

    Raises:
        ChildFailed: a process did not come up.
        ValueError: standbys without etcd.
    """
    if standbys and not etcd:
        raise ValueError("standbys need etcd for leader election")
    procs = procs or ProcessGroup(log_dir=log_dir)
    say = on_step or (lambda line: None)
    etcd_server = cluster = None
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
        common = ["--node-ttl-ms", str(node_ttl_ms), *master_args]
        if etcd:
            common += ["--etcd", etcd, "--cluster-name", f"c{uuid.uuid4().hex[:8]}",
                       "--lease-ttl-s", str(lease_ttl_s)]
        cluster = StoreCluster(procs, shard_map, [], etcd=etcd_server, master_args=common,
                               node_args=["--eviction-policy", eviction_policy, *node_args],
                               dram=dram, ssd=ssd, ssd_dir=ssd_dir, env=dict(env or {}),
                               state_dir="" if etcd else tempfile.mkdtemp(prefix="kvstore-master-"))
        for i, addrs in enumerate(shard_addrs):
            cluster.shards.append([])
            for j, addr in enumerate(addrs):
                name = f"master{i}" + (f"-{j}" if per > 1 else "")
                args = ["--port", addr.rsplit(":", 1)[1], *cluster.master_state(name), *common]
                if masters > 1 or per > 1:
                    args += ["--shard-id", str(i), "--shard-map", shard_map]
                cluster.shards[i].append(procs.start(name, service_args("master", *args),
                                                     env=cluster.env))
                say(f"{name}: shard {i} at {addr}")
        # A node is READY once its registration (and inventory) is applied, and a
        # master with a fresh roster serves at once: no warm-up to sleep through.
        for k in range(nodes):
            child = cluster.start_node(f"{node_prefix}{k}")
            say(f"{node_prefix}{k}: node at {child.address}")
    except BaseException:
        if cluster is not None:
            cluster.stop()           # its processes, etcd and state folders
        else:
            procs.stop()
            if etcd_server is not None:
                etcd_server.stop()
        raise
    return cluster


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """What :class:`LocalCluster` starts."""

    num_nodes: int = 2
    node_dram: str = "512MiB"          # per node
    num_prefill: int = 1
    num_decode: int = 1
    model: str = "tiny"
    block_tokens: int = 16
    kv_pages: int = 4096               # per engine
    use_cache: bool = True
    log_dir: str | None = None
    http_port: int | None = None       # serve the HTTP front on it (0: any free port); None: off
    conductor_args: tuple[str, ...] = ()   # extra conductor options (deadlines, probes)
    metrics: bool = False              # every process serves --metrics-port 0 (READY: metrics_address)


class LocalCluster:
    """The embedded local cluster: a one-shard store, engines and the conductor.

        master <- store nodes node0, node1 (shm DRAM)      engines: N prefill, M decode
                                       conductor -> engines, store
                                       (+ OpenAI-style HTTP front inside it, optional)

    Stopping it (context manager, Ctrl-C or a failed child) stops every process.
    """

    def __init__(self, spec: ClusterSpec):
        self.spec = spec
        self.procs = ProcessGroup(log_dir=spec.log_dir)
        self.master = ""
        self.conductor = ""
        self.http = ""                  # HTTP front host:port, "" when off

    def start(self, on_step=None) -> "LocalCluster":
        s = self.spec
        step = on_step or (lambda name: None)
        try:
            observed = ("--metrics-port", "0") if s.metrics else ()
            store = start_store_cluster(1, s.num_nodes, dram=s.node_dram, eviction_policy="default",
                                        node_prefix="node", procs=self.procs, on_step=step,
                                        master_args=observed, node_args=observed)
            self.master = store.master
            common = ["--master", self.master, "--model", s.model, "--block-tokens",
                      str(s.block_tokens), "--kv-pages", str(s.kv_pages), *observed]
            routes = []
            for role, count in (("prefill", s.num_prefill), ("decode", s.num_decode)):
                for i in range(count):
                    step(f"{role} engine {i}")
                    c = self.procs.start(f"{role}{i}", service_args(
                        role, *common, "--instance-id", f"{role}{i}"), timeout_s=120)
                    routes += [f"--{role}", f"{role}{i}={c.address}"]
            step("conductor")
            args = ["--master", self.master, "--model", s.model, "--block-tokens",
                    str(s.block_tokens), *routes, *observed]
            if not s.use_cache:
                args.append("--no-cache")
            if s.http_port is not None:
                args += ["--http-port", str(s.http_port)]
            args += list(s.conductor_args)
            c = self.procs.start("conductor", service_args("conductor", *args), timeout_s=120)
            self.conductor = c.address
            self.http = c.info.get("http_address", "")
        except BaseException:
            self.stop()
            raise
        return self

    def process(self, name: str) -> Child:
        """The child called ``name`` ("master0", "node0", "prefill1", "decode0", "conductor")."""
        return self.procs.child(name)

    def check(self) -> None:
        """Raise ChildFailed if any process died."""
        self.procs.check()

    def stop(self) -> None:
        self.procs.stop()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
