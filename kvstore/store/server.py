"""Store node process: ``kvstore node`` / ``python -m kvstore.store.server``.

Registers with the master (with an inventory of what it holds, e.g. its SSD
after a restart), heartbeats (reporting per-tier stats and the node's events,
applying the drop orders it gets back), and serves the data plane over TCP
and same-host shared memory.

Tiers and their defaults (README-ready)::

    --dram 256MiB                      DRAM: shared-memory segment; every put lands here
    --gpu SIZE [--gpu-device cuda]     GPU: device memory, below DRAM (needs CUDA; off by default)
    --ssd SIZE --ssd-path DIR          SSD: lmdb environment in DIR (off by default)
    [--ssd-map-size SIZE]              lmdb map size (default 3 x SSD + 64 MiB)
    --high-watermark 0.95 --low-watermark 0.85            DRAM and GPU
    --ssd-high-watermark 0.95 --ssd-low-watermark 0.90    SSD

Each tier evicts when its use passes its high watermark, down to its low
watermark. DRAM and GPU victims are demoted to the next tier while it has
room (the SSD evicts its own victims to make room), and evicted only when no
tier below can take them. A node restarted on the same ``--ssd-path``
re-announces the SSD's intact objects (checksums checked) under the node id
recorded there, so ``--node-id`` may be omitted on restart.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
import uuid

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.process import announce_ready, setup_logging
from kvstore.sizes import parse_size
from kvstore.store.data_server import DataServer
from kvstore.store.node import NodeStats, StoreNode
from kvstore.store.tiers.base import Tier
from kvstore.store.tiers.dram import DramTier
from kvstore.transfer.shm import host_id

log = logging.getLogger(__name__)


def tier_stats_proto(stats: NodeStats) -> list[pb.TierStat]:
    return [pb.TierStat(tier=t.kind, capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes,
                        free_bytes=t.free_bytes, evictable_bytes=t.evictable_bytes,
                        num_objects=t.num_objects, num_reading=t.num_reading,
                        num_pinned=t.num_pinned, num_soft_pinned=t.num_soft_pinned,
                        num_protected=t.num_protected, high_watermark=t.high_watermark,
                        low_watermark=t.low_watermark, eviction_blocked=t.eviction_blocked)
            for t in stats.tiers]


class NodeAgent:
    """A store node's link to its master: registration and heartbeats.

    Args:
        node: the object table.
        address: how clients reach this node.
        master: master address host:port.
        min_beat_interval_s: event-driven heartbeats are at least this far
            apart, so a burst of demotions travels in a few heartbeats.
        full_stats_interval_s: how often a heartbeat recounts the per-object
            stats (evictable, pinned, ...: O(objects) under the node's lock);
            the beats in between refresh only usage and counters.
    """

    def __init__(self, node: StoreNode, address: pb.NodeAddress, master: str,
                 min_beat_interval_s: float = 0.02, full_stats_interval_s: float = 1.0):
        self.node = node
        self.address = address
        self.channel = grpc.insecure_channel(master, options=[
            ("grpc.max_send_message_length", 64 * 1024 * 1024)])
        self.stub = pb_grpc.MasterStub(self.channel)
        self.interval_s = 0.5
        self.min_beat_interval_s = min_beat_interval_s
        self.full_stats_interval_s = full_stats_interval_s
        self._stats: NodeStats | None = None
        self._stats_at = 0.0
        self._stop = threading.Event()
        self._unreported: list = []
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def register(self, timeout_s: float = 10.0) -> None:
        """Register with an inventory of everything the node holds now.

        Events queued before the inventory is taken are dropped: the
        inventory already reflects them, and the master rebuilds this node's
        part of its index from it.
        """
        self.node.take_events()
        self._unreported.clear()
        inventory = [pb.InventoryItem(key=k, object_id=oid, size_bytes=size, checksum=ck, tier=t)
                     for k, oid, size, ck, t in self.node.holdings()]
        stats = self.node.stats()
        resp = self.stub.RegisterNode(pb.RegisterNodeRequest(
            address=self.address, tier=pb.DRAM, capacity_bytes=stats.capacity_bytes,
            max_object_bytes=stats.capacity_bytes, tiers=tier_stats_proto(stats),
            inventory=inventory), timeout=timeout_s, wait_for_ready=True)
        self.interval_s = resp.heartbeat_interval_ms / 1000.0
        if inventory:
            log.info("registered with %d object(s) in the inventory", len(inventory))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.node.events_ready.set()
        self._thread.join(timeout=5)
        self.channel.close()

    def beat(self) -> None:
        """One heartbeat: report per-tier stats and events, apply drop orders.

        Events stay queued here until a heartbeat carrying them succeeds, so
        the master sees each at least once and in order.
        """
        self._unreported.extend(self.node.take_events())
        now = time.monotonic()
        if self._stats is None or now - self._stats_at >= self.full_stats_interval_s:
            self._stats, self._stats_at = self.node.stats(), now
        else:
            self._stats = self.node.refresh_usage(self._stats)
        stats = self._stats
        resp = self.stub.Heartbeat(pb.HeartbeatRequest(
            node_id=self.address.node_id, used_bytes=stats.used_bytes,
            num_objects=stats.num_objects, events=[e.to_proto() for e in self._unreported],
            tiers=tier_stats_proto(stats), counters=stats.counters), timeout=5)
        self._unreported.clear()
        if not resp.known:
            log.warning("master does not know this node: registering again")
            self.register()
            return
        for d in resp.drops:
            self.node.drop(d.key, d.object_id)

    def _loop(self) -> None:
        # Beat every interval, and soon after the node changed what it holds
        # (evicted, demoted, promoted), so the index stops offering stale replicas.
        while not self._stop.is_set():
            self.node.events_ready.wait(self.interval_s)
            if self._stop.is_set():
                return
            try:
                self.beat()
            except grpc.RpcError as exc:
                log.warning("heartbeat failed: %s", exc.code())
            self._stop.wait(self.min_beat_interval_s)


def build_tiers(args: argparse.Namespace) -> list[Tier]:
    """The node's tier chain from the command line: DRAM [-> GPU] [-> SSD].

    Raises:
        SystemExit: inconsistent SSD options, or a GPU tier without a usable device.
    """
    tiers: list[Tier] = [DramTier(parse_size(args.dram))]
    try:
        if args.gpu:
            from kvstore.store.tiers.gpu import GpuTier

            try:
                tiers.append(GpuTier(parse_size(args.gpu), args.gpu_device))
            except RuntimeError as exc:
                raise SystemExit(f"kvstore node: {exc}") from None
        if args.ssd or args.ssd_path:
            if not (args.ssd and args.ssd_path):
                raise SystemExit("kvstore node: --ssd SIZE and --ssd-path DIR go together")
            from kvstore.store.tiers.ssd import SsdInUse, SsdTier

            try:
                tiers.append(SsdTier(args.ssd_path, parse_size(args.ssd),
                                     parse_size(args.ssd_map_size) if args.ssd_map_size else None))
            except (SsdInUse, ValueError) as exc:
                raise SystemExit(f"kvstore node: {exc}") from None
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers


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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvstore node", description="Run a store node.")
    p.add_argument("--master", required=True, help="master address host:port")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=0, help="data port; 0 picks a free port")
    p.add_argument("--node-id", default="",
                   help="stable node id (default: the one recorded on --ssd-path, else random)")
    p.add_argument("--dram", default="256MiB", help="DRAM tier capacity, e.g. 512MiB, 4GiB")
    p.add_argument("--gpu", default="", help="GPU tier capacity (needs CUDA); default none")
    p.add_argument("--gpu-device", default="cuda", help="torch device of the GPU tier")
    p.add_argument("--ssd", default="", help="SSD tier capacity, e.g. 256MiB; default none")
    p.add_argument("--ssd-path", default="", help="directory of the SSD tier's lmdb environment")
    p.add_argument("--ssd-map-size", default="", help="lmdb map size (default 3 x --ssd + 64MiB)")
    p.add_argument("--eviction-policy", default="default", help="lru, lfu, default or none")
    p.add_argument("--high-watermark", type=float, default=0.95,
                   help="DRAM/GPU: evict when use passes this fraction of capacity")
    p.add_argument("--low-watermark", type=float, default=0.85, help="... down to this fraction")
    p.add_argument("--ssd-high-watermark", type=float, default=0.95,
                   help="SSD: evict when use passes this fraction of capacity")
    p.add_argument("--ssd-low-watermark", type=float, default=0.90, help="... down to this fraction")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    setup_logging(args.log_level)

    tiers = build_tiers(args)
    try:
        node_id = resolve_node_id(args.node_id, tiers)
        t0 = time.monotonic()
        node = StoreNode(tiers, args.eviction_policy, args.high_watermark, args.low_watermark,
                         ssd_watermarks=(args.ssd_high_watermark, args.ssd_low_watermark))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    if node.counters["recovered"]:
        log.info("recovered %d object(s) in %.2f s", node.counters["recovered"],
                 time.monotonic() - t0)
    dram = tiers[0]
    server = DataServer(node, args.host, args.port).start()
    address = pb.NodeAddress(node_id=node_id, host=args.host, data_port=server.port,
                             shm_name=dram.name, host_id=host_id())
    agent = NodeAgent(node, address, args.master)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        agent.register()
        agent.start()
        announce_ready({"role": "node", "node_id": node_id,
                        "address": f"{args.host}:{server.port}", "shm_name": dram.name,
                        "tiers": {t.kind.name: t.capacity_bytes for t in tiers},
                        "recovered": node.counters["recovered"]})
        log.info("node %s serving %s:%d, tiers %s", node_id, args.host, server.port,
                 ", ".join(f"{t.kind.name} {t.capacity_bytes} B" for t in tiers))
        stop.wait()
    finally:
        agent.stop()
        server.stop()
        node.close()
        log.info("node %s stopped", node_id)


if __name__ == "__main__":
    main()
