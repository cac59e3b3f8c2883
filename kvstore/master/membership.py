"""Store-node membership: registration, heartbeats, liveness, space, orders.

A node is alive while its heartbeats arrive within ``node_ttl_ms``. A node
that registers is first SYNCING, not alive, while its inventory arrives
(:mod:`kvstore.master.inventory`; each chunk counts as a heartbeat): its
replicas are not offered and nothing is placed on it until the index agrees
with what it holds. The
master sends each node the objects it must free (drop orders) and the
repair copies it must make (copy orders) in heartbeat replies, so neither
needs a connection from master to node. Placement reads each node's free
space from here::

    free = capacity - used (last heartbeat, plus stored since) - reserved (puts placed here)

Thread safety: owned by the master's event loop; not locked.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass, field

from kvstore.errors import IdTaken, InvalidArgument, NodesLate, NoLiveNode, Unavailable
from kvstore.types import CopyOrder, DropOrder, NodeAddress, NodeId, ObjectId, ObjectKey, TierStats

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeRegistration:
    """What a node says about itself when it (re)registers."""

    address: NodeAddress
    capacity_bytes: int          # of its DRAM tier, where puts land
    max_object_bytes: int = 0    # largest object it could ever hold (0: capacity_bytes)
    tiers: tuple[TierStats, ...] = ()
    incarnation: str = ""        # random per node process: binds the id to one process ...
    owner: str = ""              # ... and to one token (its fingerprint; "" without --auth)


@dataclass(frozen=True, slots=True)
class NodeHeartbeat:
    """What a node reports on each heartbeat."""

    node_id: NodeId
    used_bytes: int
    num_objects: int
    tiers: tuple[TierStats, ...] = ()         # () keeps the last report
    counters: dict[str, int] | None = None    # None keeps the last report
    incarnation: str = ""                     # must be the registered one ...
    owner: str = ""                           # ... from the registered token
    leaving: bool = False                     # a clean stop: the node is dead from now on


@dataclass(slots=True)
class NodeInfo:
    address: NodeAddress          # how clients reach the node
    capacity_bytes: int
    max_object_bytes: int         # largest object the node could ever hold
    used_bytes: int = 0           # from the last heartbeat (+ objects stored since)
    reserved_bytes: int = 0       # repair copies ordered here, not yet stored
    num_objects: int = 0
    last_heartbeat_ms: int = 0
    alive: bool = True
    drops: list[DropOrder] = field(default_factory=list)    # to send with the next heartbeat
    tiers: tuple[TierStats, ...] = ()                       # per tier, from the last report
    counters: dict[str, int] = field(default_factory=dict)  # the node's own, last heartbeat
    copies: list[CopyOrder] = field(default_factory=list)   # repair orders for the next heartbeat
    failures: list[int] = field(default_factory=list)  # ms of recent transfer failures reported
    quarantined_until_ms: int = 0  # no new puts or repair copies land here before this
    incarnation: str = ""          # the registered process (see NodeRegistration)
    owner: str = ""                # the registered token's fingerprint
    syncing: bool = False          # registered, its inventory not all applied yet (not alive)

    @property
    def node_id(self) -> NodeId:
        return self.address.node_id

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes - self.reserved_bytes)


MAX_NODE_ID_CHARS = 128
MAX_HOST_CHARS = 253          # a DNS name's limit
MAX_NAME_CHARS = 255          # shm names, host ids, metrics addresses


def check_address(a: NodeAddress) -> None:
    """Refuse a node address no client could use, before it is handed to any.

    Raises:
        InvalidArgument: an empty or overlong node id, host or name; a host that
            is neither an IP address nor a DNS name (IDNA); a port outside 1-65535.
    """
    def bad(what: str) -> InvalidArgument:
        return InvalidArgument(f"node address: {what}")

    if not a.node_id or len(a.node_id) > MAX_NODE_ID_CHARS or not a.node_id.isprintable():
        raise bad(f"node id must be 1-{MAX_NODE_ID_CHARS} printable characters")
    if not 1 <= a.data_port <= 65535:
        raise bad(f"data port {a.data_port} is outside 1-65535")
    for name, value in (("shm name", a.shm_name), ("host id", a.host_id),
                        ("metrics address", a.metrics_address)):
        if len(value) > MAX_NAME_CHARS or not value.isprintable():
            raise bad(f"{name} must be at most {MAX_NAME_CHARS} printable characters")
    host = a.host
    if not host or len(host) > MAX_HOST_CHARS:
        raise bad(f"host must be 1-{MAX_HOST_CHARS} characters")
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    try:
        host.encode("idna")
    except UnicodeError as exc:
        raise bad(f"host {host[:64]!r} is not a host name ({exc})") from None
    if any(c.isspace() or c in "/:@[]" for c in host):
        raise bad(f"host {host[:64]!r} is not a host name")


class Membership:
    """The nodes a master shard knows.

    Args:
        node_ttl_ms: a node with no heartbeat for this long is dead.
        heartbeat_interval_ms: what nodes are told to use.
        forget_ms: a node with no heartbeat for this long is removed, with its
            replicas (:meth:`ObjectIndex.forget_nodes`); at least ``node_ttl_ms``.
    """

    def __init__(self, node_ttl_ms: int = 3000, heartbeat_interval_ms: int = 500,
                 forget_ms: int = 600_000):
        self.node_ttl_ms = node_ttl_ms
        self.forget_ms = max(forget_ms, node_ttl_ms)
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.nodes: dict[NodeId, NodeInfo] = {}
        self.failures_to_quarantine = 5      # reported transfer failures ...
        self.failure_window_ms = 10_000      # ... within this window ...
        self.quarantine_ms = 30_000          # ... keep new puts off the node this long
        self.lost_ms = 0                     # when heartbeats last stopped (expire), 0: never

    def register(self, reg: NodeRegistration, now_ms: int,
                 syncing: bool = False) -> tuple[NodeInfo, bool]:
        """Add or re-add a node. Returns (info, was_known).

        Args:
            syncing: its inventory follows: not alive until :meth:`synced`.

        Raises:
            InvalidArgument: an address clients could not use (see :func:`check_address`).
            IdTaken: the id is alive under another incarnation or token
                (a second process claiming a live node's id is refused, not obeyed;
                a restarted node is accepted once its old registration expired).
        """
        check_address(reg.address)
        node_id = reg.address.node_id
        old = self.nodes.get(node_id)
        if old is not None and self._alive_now(old, now_ms):
            self.check_identity(old, reg.incarnation, reg.owner)
        info = NodeInfo(address=reg.address, capacity_bytes=reg.capacity_bytes,
                        max_object_bytes=reg.max_object_bytes or reg.capacity_bytes,
                        last_heartbeat_ms=now_ms, tiers=reg.tiers, alive=not syncing,
                        syncing=syncing, incarnation=reg.incarnation, owner=reg.owner)
        if old is not None:
            # Drops ordered while it was away still apply to what it kept (its SSD).
            info.drops = old.drops
        self.nodes[node_id] = info
        log.info("node %s registered (%s:%d, %d B)%s", node_id, reg.address.host,
                 reg.address.data_port, reg.capacity_bytes, " again" if old else "")
        return info, old is not None

    def heartbeat(self, beat: NodeHeartbeat, now_ms: int) -> NodeInfo | None:
        """Record a heartbeat; None when the node is unknown (it must register again).

        Raises:
            IdTaken: not the registered incarnation or token.
        """
        info = self.nodes.get(beat.node_id)
        if info is None:
            return None
        self.check_identity(info, beat.incarnation, beat.owner)
        if beat.leaving:
            # Dead from now on, its id free to register again at once; forgotten (with
            # its replicas) only after forget_ms, as any dead node: it may come back
            # with its SSD, and what the shard replaced meanwhile must stay replaced
            # (kvstore.master.superseded).
            info.alive = False
            info.last_heartbeat_ms = now_ms
            log.info("node %s stopped", beat.node_id)
            return info
        if info.syncing:
            pass                      # alive once its inventory is applied (synced)
        elif not info.alive:
            log.info("node %s is back", beat.node_id)
            info.alive = True
        info.used_bytes = beat.used_bytes
        info.num_objects = beat.num_objects
        info.last_heartbeat_ms = now_ms
        if beat.tiers:
            info.tiers = beat.tiers
        if beat.counters is not None:
            info.counters = dict(beat.counters)
        return info

    # ---- space: what placement sees between heartbeats ----
    def reserve(self, node_id: NodeId, size_bytes: int) -> None:
        """A repair copy was ordered to the node: its bytes are spoken for until it lands
        or fails."""
        info = self.nodes.get(node_id)
        if info is not None:
            info.reserved_bytes += size_bytes

    def unreserve(self, node_id: NodeId, size_bytes: int) -> None:
        info = self.nodes.get(node_id)
        if info is not None:
            info.reserved_bytes = max(0, info.reserved_bytes - size_bytes)

    def account_stored(self, node_id: NodeId, size_bytes: int) -> None:
        """The node holds ``size_bytes`` more: counted as used until its next heartbeat
        reports them (otherwise placement sees the space as free in between)."""
        info = self.nodes.get(node_id)
        if info is not None:
            info.used_bytes += size_bytes

    # ---- orders, delivered with the next heartbeat reply ----
    def order_drop(self, node_id: NodeId, key: ObjectKey, object_id: ObjectId) -> None:
        info = self.nodes.get(node_id)
        if info is not None:
            info.drops.append(DropOrder(key, object_id))

    def ordered_drops(self, node_id: NodeId) -> set[tuple[ObjectKey, ObjectId]]:
        """(key, object_id) of the drops ordered to the node and not yet delivered."""
        info = self.nodes.get(node_id)
        return {(d.key, d.object_id) for d in info.drops} if info is not None else set()

    def order_copy(self, node_id: NodeId, order: CopyOrder) -> None:
        info = self.nodes.get(node_id)
        if info is not None:
            info.copies.append(order)

    def take_drops(self, node_id: NodeId) -> list[DropOrder]:
        info = self.nodes.get(node_id)
        if info is None:
            return []
        drops, info.drops = info.drops, []
        return drops

    def take_copies(self, node_id: NodeId) -> list[CopyOrder]:
        info = self.nodes.get(node_id)
        if info is None:
            return []
        copies, info.copies = info.copies, []
        return copies

    # ---- health ----
    def report_failure(self, node_id: NodeId, now_ms: int) -> bool:
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

    def is_quarantined(self, node_id: NodeId, now_ms: int) -> bool:
        info = self.nodes.get(node_id)
        return info is not None and now_ms < info.quarantined_until_ms

    def synced(self, node_id: NodeId, now_ms: int) -> None:
        """The node's whole inventory is applied: it is alive from now."""
        info = self.nodes.get(node_id)
        if info is not None and info.syncing:
            info.syncing = False
            info.alive = True
            info.last_heartbeat_ms = max(info.last_heartbeat_ms, now_ms)

    def expire(self, now_ms: int) -> list[NodeId]:
        """Mark nodes without a recent heartbeat dead (a syncing node: without a chunk of
        its inventory); returns the newly dead."""
        dead = []
        for info in self.nodes.values():
            if (info.alive or info.syncing) and now_ms - info.last_heartbeat_ms > self.node_ttl_ms:
                log.warning("node %s missed heartbeats for %d ms: dead%s", info.node_id,
                            now_ms - info.last_heartbeat_ms,
                            " (its registration stalled)" if info.syncing else "")
                info.alive = info.syncing = False
                dead.append(info.node_id)
        if dead:
            self.lost_ms = now_ms
        return dead

    def touch(self, node_id: NodeId, now_ms: int) -> None:
        """A live node was heard from (it reported events): as alive as a heartbeat
        would make it. A node busy storing values may send its reports on time
        while its heartbeat thread waits for a core; it is not dead."""
        info = self.nodes.get(node_id)
        if info is not None and (info.alive or info.syncing) and now_ms > info.last_heartbeat_ms:
            info.last_heartbeat_ms = now_ms

    def no_live_node(self, now_ms: int) -> Unavailable:
        """The error for a placement that finds no live node: final (:class:`NoLiveNode`;
        the SDKs raise it at once), except within ``node_ttl_ms`` of the last node's
        heartbeats stopping. A node that was only late (a starved process, a brief
        partition) may be back any moment: until then, an Unavailable the SDKs retry."""
        if self.lost_ms and now_ms - self.lost_ms < self.node_ttl_ms:
            return NodesLate("every store node missed its heartbeats just now; retry")
        return NoLiveNode("no live store node")

    def forget(self, now_ms: int) -> list[NodeId]:
        """Remove nodes dead for longer than ``forget_ms`` (their heartbeats stopped
        ``forget_ms`` ago); returns their ids. A forgotten node that comes back
        registers as new, its inventory indexed again."""
        gone = [info.node_id for info in self.nodes.values()
                if not info.alive and now_ms - info.last_heartbeat_ms > self.forget_ms]
        for node_id in gone:
            del self.nodes[node_id]
            log.info("node %s dead for over %d ms: forgotten", node_id, self.forget_ms)
        return gone

    def _alive_now(self, info: NodeInfo, now_ms: int) -> bool:
        return (info.alive or info.syncing) and now_ms - info.last_heartbeat_ms <= self.node_ttl_ms

    @staticmethod
    def check_identity(info: NodeInfo, incarnation: str, owner: str) -> None:
        """Raises IdTaken (a PermissionDenied) unless ``incarnation`` and ``owner`` are the
        registered ones."""
        if incarnation != info.incarnation or owner != info.owner:
            raise IdTaken(
                f"node id {info.node_id} is registered by another live process "
                f"({'another token' if owner != info.owner else 'another incarnation'}); "
                f"refused until it stops or its registration expires")

    def is_known(self, node_id: NodeId) -> bool:
        """Registered with this shard (alive or not)."""
        return node_id in self.nodes

    def is_alive(self, node_id: NodeId) -> bool:
        info = self.nodes.get(node_id)
        return info is not None and info.alive

    def alive_nodes(self) -> list[NodeInfo]:
        return [n for n in self.nodes.values() if n.alive]

    def healthy_nodes(self, now_ms: int) -> list[NodeInfo]:
        """Alive nodes that are not quarantined (where new bytes may land)."""
        return [n for n in self.alive_nodes() if not self.is_quarantined(n.node_id, now_ms)]
