"""Store-node membership: registration, heartbeats, liveness, drop orders.

A node is alive while its heartbeats arrive within ``node_ttl_ms``. The
master sends each node the objects it must free (drop orders) in heartbeat
replies, so freeing needs no connection from master to node.

Thread safety: owned by the master's event loop; not locked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from kvstore._proto import kvstore_pb2 as pb

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeInfo:
    address: pb.NodeAddress       # how clients reach the node
    tier: int                     # pb.Tier
    capacity_bytes: int
    max_object_bytes: int         # largest object the node could ever hold
    used_bytes: int = 0           # from the last heartbeat
    reserved_bytes: int = 0       # pending puts placed here, not yet in used_bytes
    num_objects: int = 0
    last_heartbeat_ms: int = 0
    alive: bool = True
    drops: list[pb.DropOrder] = field(default_factory=list)  # to send with the next heartbeat
    tiers: list[pb.TierStat] = field(default_factory=list)   # per tier, from the last report
    counters: dict[str, int] = field(default_factory=dict)   # the node's own, last heartbeat
    copies: list[pb.CopyOrder] = field(default_factory=list)  # repair orders for the next heartbeat
    failures: list[int] = field(default_factory=list)  # ms of recent transfer failures reported
    quarantined_until_ms: int = 0  # no new puts or repair copies land here before this

    @property
    def node_id(self) -> str:
        return self.address.node_id

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes - self.reserved_bytes)


class Membership:
    """The nodes a master shard knows.

    Args:
        node_ttl_ms: a node with no heartbeat for this long is dead.
        heartbeat_interval_ms: what nodes are told to use.
    """

    def __init__(self, node_ttl_ms: int = 3000, heartbeat_interval_ms: int = 500):
        self.node_ttl_ms = node_ttl_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.nodes: dict[str, NodeInfo] = {}
        self.failures_to_quarantine = 5      # reported transfer failures ...
        self.failure_window_ms = 10_000      # ... within this window ...
        self.quarantine_ms = 30_000          # ... keep new puts off the node this long

    def register(self, req: pb.RegisterNodeRequest, now_ms: int) -> tuple[NodeInfo, bool]:
        """Add or re-add a node. Returns (info, was_known)."""
        node_id = req.address.node_id
        old = self.nodes.get(node_id)
        known = old is not None
        info = NodeInfo(address=pb.NodeAddress(), tier=req.tier or pb.DRAM,
                        capacity_bytes=req.capacity_bytes,
                        max_object_bytes=req.max_object_bytes or req.capacity_bytes,
                        last_heartbeat_ms=now_ms, tiers=list(req.tiers))
        info.address.CopyFrom(req.address)
        if old is not None:
            # Drops ordered while it was away still apply to what it kept (its SSD).
            info.drops = old.drops
        self.nodes[node_id] = info
        log.info("node %s registered (%s:%d, %d B)%s", node_id, req.address.host,
                 req.address.data_port, req.capacity_bytes, " again" if known else "")
        return info, known

    def heartbeat(self, req: pb.HeartbeatRequest, now_ms: int) -> NodeInfo | None:
        info = self.nodes.get(req.node_id)
        if info is None:
            return None
        if not info.alive:
            log.info("node %s is back", req.node_id)
        info.alive = True
        info.used_bytes = req.used_bytes
        info.num_objects = req.num_objects
        info.last_heartbeat_ms = now_ms
        if req.tiers:
            info.tiers = list(req.tiers)
        if req.counters:
            info.counters = dict(req.counters)
        return info

    def take_drops(self, node_id: str) -> list[pb.DropOrder]:
        info = self.nodes.get(node_id)
        if info is None:
            return []
        drops, info.drops = info.drops, []
        return drops

    def take_copies(self, node_id: str) -> list[pb.CopyOrder]:
        info = self.nodes.get(node_id)
        if info is None:
            return []
        copies, info.copies = info.copies, []
        return copies

    def report_failure(self, node_id: str, now_ms: int) -> bool:
        """A client could not move bytes to or from this node. A node that
        keeps failing while it heartbeats is quarantined for ``quarantine_ms``.
        Returns True when this report quarantined it."""
        info = self.nodes.get(node_id)
        if info is None:
            return False
        info.failures = [t for t in info.failures if now_ms - t < self.failure_window_ms]
        info.failures.append(now_ms)
        if len(info.failures) >= self.failures_to_quarantine and not self.is_quarantined(node_id, now_ms):
            info.quarantined_until_ms = now_ms + self.quarantine_ms
            info.failures.clear()
            log.warning("node %s failed %d transfers in %d ms: quarantined for %d ms", node_id,
                        self.failures_to_quarantine, self.failure_window_ms, self.quarantine_ms)
            return True
        return False

    def is_quarantined(self, node_id: str, now_ms: int) -> bool:
        info = self.nodes.get(node_id)
        return info is not None and now_ms < info.quarantined_until_ms

    def order_drop(self, node_id: str, key: str, object_id: int) -> None:
        info = self.nodes.get(node_id)
        if info is not None:
            info.drops.append(pb.DropOrder(key=key, object_id=object_id))

    def expire(self, now_ms: int) -> list[str]:
        """Mark nodes without a recent heartbeat dead; returns the newly dead."""
        dead = []
        for info in self.nodes.values():
            if info.alive and now_ms - info.last_heartbeat_ms > self.node_ttl_ms:
                info.alive = False
                dead.append(info.node_id)
                log.warning("node %s missed heartbeats for %d ms: dead", info.node_id,
                            now_ms - info.last_heartbeat_ms)
        return dead

    def is_alive(self, node_id: str) -> bool:
        info = self.nodes.get(node_id)
        return info is not None and info.alive

    def alive_nodes(self) -> list[NodeInfo]:
        return [n for n in self.nodes.values() if n.alive]
