"""Store node process: ``kvstore node`` / ``python -m kvstore.store.server``.

Registers with the master, heartbeats (applying the drop orders it gets
back), and serves the data plane over TCP and same-host shared memory.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import uuid

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.process import announce_ready, setup_logging
from kvstore.sizes import parse_size
from kvstore.store.data_server import DataServer
from kvstore.store.node import StoreNode
from kvstore.store.tiers.dram import DramTier
from kvstore.transfer.shm import host_id

log = logging.getLogger(__name__)


class NodeAgent:
    """A store node's link to its master: registration and heartbeats.

    Args:
        node: the object table.
        address: how clients reach this node.
        master: master address host:port.
    """

    def __init__(self, node: StoreNode, address: pb.NodeAddress, master: str):
        self.node = node
        self.address = address
        self.channel = grpc.insecure_channel(master)
        self.stub = pb_grpc.MasterStub(self.channel)
        self.interval_s = 0.5
        self._stop = threading.Event()
        self._unreported: list[tuple[str, int]] = []
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def register(self, timeout_s: float = 10.0) -> None:
        stats = self.node.stats()
        resp = self.stub.RegisterNode(pb.RegisterNodeRequest(
            address=self.address, tier=pb.DRAM, capacity_bytes=stats.capacity_bytes,
            max_object_bytes=stats.capacity_bytes), timeout=timeout_s, wait_for_ready=True)
        self.interval_s = resp.heartbeat_interval_ms / 1000.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.node.events_ready.set()
        self._thread.join(timeout=5)
        self.channel.close()

    def beat(self) -> None:
        """One heartbeat: report usage and evictions, apply drop orders.

        Evictions stay queued here until a heartbeat carrying them succeeds.
        """
        self._unreported.extend(self.node.take_events())
        stats = self.node.stats()
        resp = self.stub.Heartbeat(pb.HeartbeatRequest(
            node_id=self.address.node_id, used_bytes=stats.used_bytes,
            num_objects=stats.num_objects,
            removed=[pb.DropOrder(key=k, object_id=oid) for k, oid in self._unreported]),
            timeout=5)
        self._unreported.clear()
        if not resp.known:
            log.warning("master does not know this node: registering again")
            self.register()
            return
        for d in resp.drops:
            self.node.drop(d.key, d.object_id)

    def _loop(self) -> None:
        # Beat every interval, and at once when the node evicted something, so
        # the index stops offering what the node no longer holds.
        while not self._stop.is_set():
            self.node.events_ready.wait(self.interval_s)
            if self._stop.is_set():
                return
            try:
                self.beat()
            except grpc.RpcError as exc:
                log.warning("heartbeat failed: %s", exc.code())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvstore node", description="Run a store node.")
    p.add_argument("--master", required=True, help="master address host:port")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=0, help="data port; 0 picks a free port")
    p.add_argument("--node-id", default="", help="stable node id (default: random)")
    p.add_argument("--dram", default="256MiB", help="DRAM tier capacity, e.g. 512MiB, 4GiB")
    p.add_argument("--eviction-policy", default="default", help="lru, lfu or default")
    p.add_argument("--high-watermark", type=float, default=0.95,
                   help="evict when DRAM use passes this fraction of capacity")
    p.add_argument("--low-watermark", type=float, default=0.85, help="... down to this fraction")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    setup_logging(args.log_level)

    node_id = args.node_id or f"node-{uuid.uuid4().hex[:8]}"
    tier = DramTier(parse_size(args.dram))
    node = StoreNode(tier, args.eviction_policy, args.high_watermark, args.low_watermark)
    server = DataServer(node, args.host, args.port).start()
    address = pb.NodeAddress(node_id=node_id, host=args.host, data_port=server.port,
                             shm_name=tier.name, host_id=host_id())
    agent = NodeAgent(node, address, args.master)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        agent.register()
        agent.start()
        announce_ready({"role": "node", "node_id": node_id,
                        "address": f"{args.host}:{server.port}", "shm_name": tier.name})
        log.info("node %s serving %s:%d, DRAM %d B in shm %s", node_id, args.host, server.port,
                 tier.capacity_bytes, tier.name)
        stop.wait()
    finally:
        agent.stop()
        server.stop()
        tier.close()
        log.info("node %s stopped", node_id)


if __name__ == "__main__":
    main()
