"""A store node's server: its tiers, its data server and its link to the masters.

Run as ``kvstore node`` (:mod:`kvstore.tools.cli.services` parses the options into
a :class:`NodeConfig`). Tiers and their defaults::

    --dram 256MiB                      DRAM: shared-memory segment; every put lands here
    [--no-prefault]                    its pages are mapped at start unless this is given
    --gpu SIZE [--gpu-device cuda]     GPU: device memory, below DRAM (needs CUDA; off by default)
    --ssd SIZE --ssd-path DIR          SSD: lmdb environment in DIR (off by default)
    [--ssd-map-size SIZE]              lmdb map size (default 3 x SSD + 64 MiB)
    [--ssd-quarantine]                 a corrupt DIR is moved aside, its intact objects
                                       copied into a fresh DIR (else the node refuses it)
    --high-watermark 0.95 --low-watermark 0.85            DRAM and GPU
    --ssd-high-watermark 0.95 --ssd-low-watermark 0.90    SSD

Each tier evicts when its use passes its high watermark, down to its low
watermark. DRAM and GPU victims are demoted to the next tier while it has
room (the SSD evicts its own victims to make room), and evicted only when no
tier below can take them. A node restarted on the same ``--ssd-path``
re-announces the SSD's intact objects (checksums checked) under the node id
recorded there, so ``--node-id`` may be omitted on restart. The SSD is opened,
checked and scanned before the DRAM segment is made, so a node that cannot
start on it leaves no segment behind; a truncated or damaged lmdb file is
refused in one line naming ``--ssd-quarantine``
(:mod:`kvstore.store.tiers.ssd_salvage`). The node talks to its masters
through :mod:`kvstore.store.agent` and serves the data plane (TCP, same-host
shared memory, RDMA) through :mod:`kvstore.store.data_server`.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import threading
import time
import uuid
from dataclasses import dataclass

from kvstore.binding import advertised_host, check_binding
from kvstore.errors import Unavailable
from kvstore.health import Health, State
from kvstore.metrics import MetricsConfig, ProcessMetrics, check_metrics_binding, start_metrics
from kvstore.process import announce_ready, freeze_survivors, memory_limit_bytes
from kvstore.rpc import ClientCredentials, ServerSecurity
from kvstore.store.agent import make_agent, no_master_yet
from kvstore.store.lease import MasterLease
from kvstore.store import metrics as node_metrics
from kvstore.store.data_server import DataServer
from kvstore.store.levels import DEFAULT_WATERMARKS
from kvstore.store.limits import default_max_objects
from kvstore.store.node import StoreNode
from kvstore.store.tiers.base import Tier
from kvstore.types import TierKind
from kvstore.store.tiers.dram import DramTier
from kvstore.transfer.protocol import local_address
from kvstore.tls import server_context
from kvstore.transfer.shm import host_id
from kvstore.types import NodeAddress, NodeId

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """What one store node process holds and serves."""

    masters: tuple[str, ...]           # one shard's masters (any shard: the node learns the map)
    dram_bytes: int = 256 << 20        # DRAM tier (shared-memory segment)
    prefault: bool = True              # map the DRAM segment's pages at start (DramTier)
    host: str = "127.0.0.1"            # bind address (loopback by default)
    port: int = 0                      # data port; 0 picks a free one
    node_id: str = ""                  # "" : the one recorded on the SSD, else a fresh one
    gpu_bytes: int = 0                 # GPU tier (0: none)
    gpu_device: str = "cuda"           # torch device of the GPU tier
    ssd_bytes: int = 0                 # SSD tier (0: none) ...
    ssd_path: str = ""                 # ... its lmdb environment's directory
    ssd_map_size_bytes: int | None = None   # lmdb map size (None: 3 x SSD + 64 MiB)
    ssd_quarantine: bool = False       # a corrupt SSD directory: moved aside, intact objects kept
    eviction_policy: str = "default"   # a name in kvstore.store.eviction's registry
    high_watermark: float = DEFAULT_WATERMARKS[TierKind.DRAM][0]   # DRAM and GPU
    low_watermark: float = DEFAULT_WATERMARKS[TierKind.DRAM][1]
    ssd_high_watermark: float = DEFAULT_WATERMARKS[TierKind.SSD][0]
    ssd_low_watermark: float = DEFAULT_WATERMARKS[TierKind.SSD][1]
    rdma_device: str = ""              # serve one-sided RDMA on this device ("" none)
    rdma_port: int = 1
    rdma_gid_index: int | None = None
    write_timeout_s: float = 30.0      # a writer silent this long mid-value loses its space
    send_timeout_s: float | None = None   # a reader taking no reply byte this long is dropped
                                          # (None: write_timeout_s); also TCP keepalive's bound
    max_connections: int | None = None   # data connections at once (None: fd limit - 128)
    security: ServerSecurity = ServerSecurity()   # --auth (data port) and --tls-* (TCP port)
    creds: ClientCredentials = ClientCredentials()   # the node's own token, to its masters
    insecure: bool = False             # allow a non-loopback bind without --auth (warned)
    advertise_host: str = ""           # the data address clients get ("" : see kvstore.binding)
    metrics: MetricsConfig = MetricsConfig()   # --metrics-port, --metrics-host
    drain_s: float = 0.0               # SIGTERM: NOT_SERVING this long before stopping
    max_objects: int = 0               # objects held at most (0: limits.default_max_objects)
    busy_poll_us: int | None = None    # polls for a request / a master's answer (None: 200 / 250
                                       # µs; 0: never; kvstore.store.polling)


def build_tiers(cfg: NodeConfig) -> list[Tier]:
    """The node's tier chain: DRAM [-> GPU] [-> SSD]. The SSD is opened and scanned
    (``recover``) first, before the DRAM segment exists: a start that fails on it
    leaves nothing in shared memory.

    Raises:
        ValueError: a DRAM tier of 0 B.
        SystemExit: inconsistent SSD options, a corrupt or busy SSD directory, or a
            GPU tier without a usable device.
    """
    if cfg.dram_bytes <= 0:
        raise ValueError(f"--dram must be larger than 0 B, got {cfg.dram_bytes} B")
    made: list[Tier] = []
    try:
        ssd = _open_ssd(cfg)
        if ssd is not None:
            made.append(ssd)
        dram = DramTier(cfg.dram_bytes, prefault=cfg.prefault)
        made.insert(0, dram)
        if cfg.gpu_bytes:
            from kvstore.store.tiers.gpu import GpuTier

            try:
                made.insert(1, GpuTier(cfg.gpu_bytes, cfg.gpu_device))
            except RuntimeError as exc:
                raise SystemExit(f"kvstore node: {exc}") from None
    except BaseException:
        for t in made:
            t.close()
        raise
    return made


def _open_ssd(cfg: NodeConfig) -> Tier | None:
    """The SSD tier, its directory checked and scanned (None: no SSD tier).

    Raises:
        SystemExit: inconsistent options, a busy directory, or a corrupt one
            without ``--ssd-quarantine`` (one line naming it).
    """
    if not (cfg.ssd_bytes or cfg.ssd_path):
        return None
    if not (cfg.ssd_bytes and cfg.ssd_path):
        raise SystemExit("kvstore node: --ssd SIZE and --ssd-path DIR go together")
    from kvstore.store.tiers.ssd import SsdCorrupt, SsdInUse, SsdTier

    try:
        try:
            return _scanned(SsdTier(cfg.ssd_path, cfg.ssd_bytes, cfg.ssd_map_size_bytes))
        except SsdCorrupt as exc:
            if not cfg.ssd_quarantine:
                raise SystemExit(
                    f"kvstore node: {exc}; start the node with --ssd-quarantine to move it "
                    f"aside and serve the objects it still holds intact") from None
            from kvstore.store.tiers.ssd_salvage import quarantine

            tier, _salvage = quarantine(cfg.ssd_path, cfg.ssd_bytes, cfg.ssd_map_size_bytes,
                                        reason=str(exc))
            return _scanned(tier)
    except (SsdInUse, SsdCorrupt, ValueError) as exc:
        raise SystemExit(f"kvstore node: {exc}") from None


def _scanned(tier: Tier) -> Tier:
    """``tier`` once its ``recover`` scan ran (closed if it failed)."""
    try:
        tier.recover()
    except BaseException:
        tier.close()
        raise
    return tier


def resolve_node_id(requested: str, tiers: list[Tier]) -> str:
    """The node id: as requested, else the one recorded on the SSD, else a fresh one.

    Raises:
        SystemExit: the SSD belongs to another node id.
    """
    ssd = next((t for t in tiers if t.persistent), None)
    owner = ssd.owner if ssd is not None else None
    if requested and owner and requested != owner:
        raise SystemExit(f"kvstore node: SSD path {ssd.path} belongs to node {owner!r}, "
                         f"not {requested!r}")
    node_id = requested or owner or f"node-{uuid.uuid4().hex[:8]}"
    if ssd is not None and owner is None:
        ssd.claim(node_id)
    return node_id


def _unless_stopped(fn, stop: threading.Event):
    """``fn()`` on a thread of its own, so that a SIGTERM meanwhile (``stop``) is obeyed
    at once: linking to unreachable masters waits up to 30 s. None when ``stop`` came
    first (the thread is left to end with the process).

    Raises:
        whatever ``fn`` raised (Unavailable, grpc.RpcError: no master answered).
    """
    done, out = threading.Event(), []

    def call() -> None:
        try:
            out.append(fn())
        except BaseException as exc:     # raised again on the main thread
            out.append(exc)
        finally:
            done.set()

    threading.Thread(target=call, name="link", daemon=True).start()
    while not done.wait(0.1):
        if stop.is_set():
            return None
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def run_node(cfg: NodeConfig) -> None:
    """Serve until SIGTERM / SIGINT (announces READY once registered with the masters).

    Raises:
        ValueError, SystemExit: bad tier options (see :func:`build_tiers`), an
            SSD of another node, an unusable RDMA device.
        grpc.RpcError: no master answered.
    """
    # A fatal signal (lmdb faulting on a damaged file, ...) says where, on stderr.
    faulthandler.enable()
    check_binding("node", cfg.host, cfg.security.tokens is not None, cfg.insecure)
    check_metrics_binding("node", cfg.metrics, cfg.host, cfg.security.tokens is not None,
                          cfg.insecure)
    t0 = time.monotonic()
    tiers = build_tiers(cfg)
    try:
        node_id = resolve_node_id(cfg.node_id, tiers)
        node = StoreNode(tiers, cfg.eviction_policy, cfg.high_watermark, cfg.low_watermark,
                         ssd_watermarks=(cfg.ssd_high_watermark, cfg.ssd_low_watermark),
                         max_objects=cfg.max_objects or default_max_objects(
                             memory_limit_bytes(), cfg.dram_bytes))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    if node.counters["recovered"]:
        log.info("recovered %d object(s) in %.2f s", node.counters["recovered"],
                 time.monotonic() - t0)
    # Writes wait (and then fail) until the agents link the node to its masters:
    # nothing is acknowledged that no master was told about.
    node.events.set_delivery(no_master_yet)
    tokens = cfg.security.tokens
    tls = server_context(cfg.security.tls) if cfg.security.tls is not None else None
    dram = tiers[0]
    rdma = server = agent = mserver = None
    lease = MasterLease()
    lease.watch(dram.lease)      # same-host readers without a reference honour the fence
    metrics = ProcessMetrics("node") if cfg.metrics.port is not None else None
    health = Health()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        # Inside the try: a busy port or an unreachable master must not leave the
        # shm segment behind.
        if cfg.rdma_device:
            from kvstore.transfer.rdma import RdmaNodeEndpoint

            try:
                rdma = RdmaNodeEndpoint(cfg.rdma_device, dram.segment.view, port=cfg.rdma_port,
                                        gid_index=cfg.rdma_gid_index)
            except Unavailable as exc:
                raise SystemExit(f"kvstore node: --rdma-device {cfg.rdma_device}: "
                                 f"{exc.message}") from None
        # --busy-poll-us: both polls (None: each its own default).
        poll_s = None if cfg.busy_poll_us is None else cfg.busy_poll_us / 1e6
        server = DataServer(node, cfg.host, cfg.port, local_address(dram.name), rdma,
                            tokens=tokens, tls=tls, metrics=metrics,
                            write_timeout_s=cfg.write_timeout_s,
                            send_timeout_s=cfg.send_timeout_s or cfg.write_timeout_s,
                            max_connections=cfg.max_connections, lease=lease,
                            poll_s=poll_s).start()
        if tokens is not None:
            # Tenants' shares (eviction order): the file's now, a reload's later (off the
            # signal handler: it takes the node's lock).
            node.tenants.configure(tokens.quotas)
            tokens.on_reload.append(lambda table: threading.Thread(
                target=node.tenants.configure, args=(table.quotas,), daemon=True,
                name="tenant-quotas").start())
            signal.signal(signal.SIGHUP, lambda *_: tokens.reload())
        host = advertised_host(cfg.host, cfg.advertise_host, toward=cfg.masters[0])
        maddress = ""
        if metrics is not None:
            node_metrics.register(metrics, node, server)
            mserver, maddress = start_metrics(cfg.metrics, cfg.host, metrics, health,
                                              cfg.security, host)
        address = NodeAddress(NodeId(node_id), host, server.port, dram.name, host_id(),
                              tls=tls is not None, metrics_address=maddress)
        def link():
            linked = make_agent(node, address, cfg.masters, creds=cfg.creds, lease=lease,
                                answer_spin_s=poll_s)
            linked.register()
            return linked

        agent = _unless_stopped(link, stop)
        if agent is None:
            log.info("stopped before a master answered")
            return
        agent.start()
        info = {"role": "node", "node_id": node_id, "address": f"{host}:{server.port}",
                "shm_name": dram.name, "tiers": {t.kind.name: t.capacity_bytes for t in tiers},
                "recovered": node.counters["recovered"]}
        if maddress:
            info["metrics_address"] = maddress
        health.set(State.SERVING)
        announce_ready(info)
        log.info("node %s serving %s:%d, tiers %s", node_id, host, server.port,
                 ", ".join(f"{t.kind.name} {t.capacity_bytes} B" for t in tiers))
        # Degraded (the data port cannot accept: out of fds), or fenced (no master
        # acknowledged the node lately): /health 503 until it can serve again.
        while not stop.wait(0.25):
            freeze_survivors()    # the table's objects out of the cyclic GC's full scans
            health.set(State.STANDBY if server.degraded or not lease.held_all()
                       else State.SERVING)
        health.set(State.DRAINING)      # probes see it first; then the port closes
        if cfg.drain_s > 0:
            time.sleep(cfg.drain_s)
    finally:
        if mserver is not None:
            mserver.stop()
        if server is not None:
            server.stop()      # no write in flight after this; every connection's queue pairs closed
        if agent is not None:
            agent.stop()
        if rdma is not None:
            rdma.close()
        node.close()
        log.info("node %s stopped", node_id)

