"""A store node's link to its master shards: registration, heartbeats, events, orders.

The node registers with every shard (with an inventory of what it holds,
e.g. its SSD after a restart), heartbeats (reporting per-tier stats and the
node's events, applying the drop orders it gets back, running the repair
copies it is ordered). With several master shards (learned from the seed
master's shard map) it does all of this with every shard, each for the keys
of its slots; a shard named ``a|b`` (leader and standbys) is reached by
trying its masters in turn.

Thread safety: each agent runs its own heartbeat thread; the node locks itself.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import grpc

from kvstore import rpc, wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shardmap import ShardMap
from kvstore.store.node import StoreNode
from kvstore.store.repair import Copier
from kvstore.store.stats import NodeStats

log = logging.getLogger(__name__)


class _LazyCopier:
    """The :class:`Copier` (and its thread) starts at the first copy order."""

    def __init__(self, node: StoreNode):
        self.node = node
        self._copier: Copier | None = None

    def submit(self, order: pb.CopyOrder) -> None:
        if self._copier is None:
            self._copier = Copier(self.node)
        self._copier.submit(order)

    def take_results(self) -> list[pb.CopyResult]:
        return self._copier.take_results() if self._copier is not None else []

    def stop(self) -> None:
        if self._copier is not None:
            self._copier.stop()


class NodeAgent:
    """A store node's link to its master: registration and heartbeats.

    Args:
        node: the object table.
        address: how clients reach this node.
        masters: the shard's masters, host:port (a leader and standbys).
        min_beat_interval_s: event-driven heartbeats are at least this far
            apart, so a burst of demotions travels in a few heartbeats.
        full_stats_interval_s: how often a heartbeat recounts the per-object
            stats (evictable, pinned, ...: O(objects) under the node's lock);
            the beats in between refresh only usage and counters.
    """

    def __init__(self, node: StoreNode, address: pb.NodeAddress, masters: tuple[str, ...],
                 min_beat_interval_s: float = 0.02, full_stats_interval_s: float = 1.0,
                 owns=None):
        self.node = node
        self.master = "|".join(masters)       # for logs
        # A shard's masters as "a|b|...": a leader and standbys. The agent
        # talks to one; on a failed RPC it moves on to the next (a new
        # leader does not know the node, so the node registers again there).
        self._addrs = masters
        self._cur = 0
        # Which keys this master shard owns (None: every key). A sharded node
        # runs one agent per shard; each sees only its shard's inventory and events.
        self.owns = owns
        self.address = address
        self.rpc_timeout_s = 2.0
        self._connect()
        self.interval_s = 0.5
        self.min_beat_interval_s = min_beat_interval_s
        self.full_stats_interval_s = full_stats_interval_s
        self._stats: NodeStats | None = None
        self._stats_at = 0.0
        self._stop = threading.Event()
        self._unreported: list = []
        self._copied: list[pb.CopyResult] = []   # repair results not yet reported
        self.copier = _LazyCopier(node)
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def _connect(self) -> None:
        self.channel = rpc.channel(self._addrs[self._cur])
        self.stub = pb_grpc.MasterStub(self.channel)

    def failover(self) -> None:
        """Move on to the shard's next master (after a failed RPC)."""
        if len(self._addrs) == 1:
            return
        self.channel.close()
        self._cur = (self._cur + 1) % len(self._addrs)
        self._connect()

    def register(self, timeout_s: float = 10.0, take_events: bool = True) -> None:
        """Register with an inventory of everything the node holds now.

        Events queued before the inventory is taken are dropped: the
        inventory already reflects them, and the master rebuilds this node's
        part of its index from it. (With ``take_events`` False, as in a
        sharded node, the node's queue stays for the other shards' agents; an
        event reported after the inventory is at worst a no-op for the master.)
        """
        if take_events:
            self.node.take_events()
        self._unreported.clear()
        inventory = [pb.InventoryItem(key=k, object_id=oid, size_bytes=size, checksum=ck, tier=t)
                     for k, oid, size, ck, t in self.node.holdings()
                     if self.owns is None or self.owns(k)]
        stats = self.node.stats()
        req = pb.RegisterNodeRequest(
            address=self.address, tier=pb.DRAM, capacity_bytes=stats.capacity_bytes,
            max_object_bytes=stats.capacity_bytes, tiers=[wire.tier_stats_pb(t) for t in stats.tiers],
            inventory=inventory)
        if len(self._addrs) == 1:
            resp = self.stub.RegisterNode(req, timeout=timeout_s, wait_for_ready=True)
        else:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    resp = self.stub.RegisterNode(req, timeout=1.0)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    self.failover()
                    time.sleep(0.05)
        self.interval_s = resp.heartbeat_interval_ms / 1000.0
        if inventory:
            log.info("registered with %d object(s) in the inventory", len(inventory))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.node.events_ready.set()
        self._thread.join(timeout=5)
        self.copier.stop()
        self.channel.close()

    def beat(self) -> None:
        """One heartbeat: report per-tier stats and events, apply drop orders.

        Events stay queued here until a heartbeat carrying them succeeds, so
        the master sees each at least once and in order.
        """
        if self.owns is None:
            self._unreported.extend(self.node.take_events())
        now = time.monotonic()
        if self._stats is None or now - self._stats_at >= self.full_stats_interval_s:
            self._stats, self._stats_at = self.node.stats(), now
        else:
            self._stats = self.node.refresh_usage(self._stats)
        stats = self._stats
        self._copied.extend(self.copier.take_results())
        n = len(self._unreported)    # a sharded node appends from another thread meanwhile
        resp = self.stub.Heartbeat(pb.HeartbeatRequest(
            node_id=self.address.node_id, used_bytes=stats.used_bytes,
            num_objects=stats.num_objects, events=[wire.node_event_pb(e) for e in self._unreported[:n]],
            tiers=[wire.tier_stats_pb(t) for t in stats.tiers], counters=stats.counters, copied=self._copied),
            timeout=self.rpc_timeout_s)
        del self._unreported[:n]
        self._copied.clear()
        for order in resp.copies:
            self.copier.submit(order)
        if not resp.known:
            log.warning("master %s does not know this node: registering again", self.master)
            self.register(take_events=self.owns is None)
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
                self.failover()
            self._stop.wait(self.min_beat_interval_s)


class ShardedAgents:
    """One :class:`NodeAgent` per master shard, each on its own heartbeat thread.

    The node registers and heartbeats with every shard; each shard gets the
    inventory items and events of the keys in its slot range, and sends back
    drop orders and copy orders for its own keys. A shard that is down or
    hung delays no other shard's heartbeats.

    Args:
        node: the object table.
        address: how clients reach this node.
        shard_map: the static map of master shards.
    """

    def __init__(self, node: StoreNode, address: pb.NodeAddress, shard_map: ShardMap,
                 min_beat_interval_s: float = 0.02):
        self.node = node
        self.shard_map = shard_map
        self.agents = [NodeAgent(node, address, r.addresses, min_beat_interval_s,
                                 owns=self._owner(r.shard_id)) for r in shard_map.ranges]
        self.min_beat_interval_s = min_beat_interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(a,), daemon=True,
                                          name=f"heartbeat-{i}") for i, a in enumerate(self.agents)]

    def _owner(self, shard_id: int):
        shard_map = self.shard_map
        return lambda key: shard_map.shard_for_key(key).shard_id == shard_id

    def register(self, timeout_s: float = 10.0) -> None:
        """Register with every shard (each must answer within ``timeout_s``)."""
        self.node.take_events()
        for agent in self.agents:
            agent.register(timeout_s, take_events=False)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        self.node.events_ready.set()
        for t in self._threads:
            t.join(timeout=5)
        for agent in self.agents:
            agent.copier.stop()
            agent.channel.close()

    def _distribute(self) -> None:
        """Hand the node's new events to the agents of the shards owning their keys."""
        with self._lock:
            events = self.node.take_events()
            for agent in self.agents:
                agent._unreported.extend(e for e in events if agent.owns(e.key))

    def _loop(self, agent: NodeAgent) -> None:
        while not self._stop.is_set():
            self.node.events_ready.wait(agent.interval_s)
            if self._stop.is_set():
                return
            self._distribute()
            try:
                agent.beat()
            except grpc.RpcError as exc:
                log.warning("heartbeat to shard %s failed: %s", agent.master, exc.code())
                agent.failover()
            self._stop.wait(self.min_beat_interval_s)


def make_agent(node: StoreNode, address: pb.NodeAddress, seeds: tuple[str, ...],
               timeout_s: float = 30.0) -> "NodeAgent | ShardedAgents":
    """The node's link to the control plane: one agent, or one per shard.

    Asks the ``seeds`` (one shard's masters) for the shard map, waiting up to
    ``timeout_s`` for one to come up; a map with one shard of one master
    keeps the plain single-master agent.
    """
    addrs = seeds
    deadline = time.monotonic() + timeout_s
    for i in itertools.count():
        with rpc.channel(addrs[i % len(addrs)]) as ch:
            try:
                msg = pb_grpc.MasterStub(ch).GetShardMap(
                    pb.GetShardMapRequest(), timeout=timeout_s if len(addrs) == 1 else 1.0,
                    wait_for_ready=True)
                break
            except grpc.RpcError:
                if time.monotonic() > deadline:
                    raise
    shard_map = wire.shard_map(msg)
    if len(shard_map.ranges) <= 1 and len(shard_map.ranges[0].addresses) == 1:
        return NodeAgent(node, address, seeds)
    log.info("shard map v%d: %d master shards", shard_map.version, len(shard_map.ranges))
    return ShardedAgents(node, address, shard_map)
