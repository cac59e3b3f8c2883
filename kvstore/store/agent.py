"""A store node's link to its master shards: registration, events, heartbeats, orders.

    node events (EventLog) --EventRouter--> one queue per shard --ReportEvents--> shard k
    heartbeat (stats, copy results)  ------------------------------Heartbeat----> shard k
                                      <-- drop orders, copy orders --

The node registers with every shard (with an inventory of what it holds,
e.g. its SSD after a restart), delivers its events to the shard owning each
event's key (:meth:`NodeAgent.deliver`: in order, at least once, a failed
delivery retried with the same events first), and heartbeats every
``interval_s`` (per-tier stats and counters; the reply carries drop orders
to apply and repair copies to run). A shard served by a leader and
standbys is reached by trying its masters in turn; a master that does not
know the node (a new leader, a restart) makes it register again. Events
are never dropped at a registration: replayed in order after the
inventory, they end where the node is (the master applies each idempotently).

One loop per shard (:meth:`NodeAgent._loop`) delivers events as soon as
they are appended and beats on its interval; a writer waiting for its
STORED event delivers through :meth:`Agents.deliver` in its own thread.

Thread safety: each agent's deliveries and registrations are serialized by
its lock; heartbeats run on its own thread; the node locks itself.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from typing import Callable

import grpc

from kvstore import rpc, wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import IdTaken, KVStoreError, Unavailable, error_for_code, from_rpc_error
from kvstore.rpc import ClientCredentials
from kvstore.shardmap import ShardMap
from kvstore.store.event_stream import EventStream
from kvstore.store.events import EventLog, Ticket
from kvstore.store.inventory import send_inventory
from kvstore.store.lease import MasterLease
from kvstore.store.node import StoreNode
from kvstore.store.repair import Copier
from kvstore.transfer.report_link import ReportLink
from kvstore.types import EventKind, NodeAddress

log = logging.getLogger(__name__)
LINK_BACKOFF_MAX_S = 300.0    # a failing report link is tried again at most this far apart
#: How long a channel left by a failover stays open for calls other threads already began on it (s).
RETIRE_S = 60.0
#: Inventory items per SyncInventory chunk (at most kvstore.master.limits.MAX_INVENTORY_CHUNK).
INVENTORY_CHUNK = 4096


class EventRouter:
    """Hands each shard's agent the node's events for the keys that shard owns.

    Args:
        events: the node's event log.
        shard_of: key -> index of its agent (None: one shard owns every key).
    """

    def __init__(self, events: EventLog, shard_of: Callable[[str], int] | None, num_shards: int):
        self.events = events
        self.shard_of = shard_of
        self._queues: list[list[Ticket]] = [[] for _ in range(num_shards)]
        self._lock = threading.Lock()

    def shard_index(self, key: str) -> int:
        """The index of the agent whose shard owns ``key``."""
        return self.shard_of(key) if self.shard_of else 0

    def take_for(self, shard: int) -> list[Ticket]:
        """The events of ``shard`` appended since its last take, in order."""
        with self._lock:
            for ticket in self.events.take():
                self._queues[self.shard_index(ticket.event.key)].append(ticket)
            taken, self._queues[shard] = self._queues[shard], []
            return taken


class _LazyCopier:
    """The :class:`Copier` (and its thread) starts at the first copy order."""

    def __init__(self, node: StoreNode, creds: ClientCredentials | None):
        self.node = node
        self.creds = creds
        self._copier: Copier | None = None

    def submit(self, order) -> None:
        if self._copier is None:
            self._copier = Copier(self.node, creds=self.creds)
        self._copier.submit(order)

    def take_results(self) -> list:
        return self._copier.take_results() if self._copier is not None else []

    def stop(self) -> None:
        if self._copier is not None:
            self._copier.stop()


class NodeAgent:
    """The node's link to one master shard.

    Args:
        node: the object table.
        address: how clients reach this node.
        masters: the shard's masters, host:port (a leader and standbys).
        router: where the agent takes its shard's events.
        shard: this agent's index in the router.
        incarnation: a random id of this node process: the master binds the
            node id to it while the node is alive.
        owns: key -> whether this shard owns it (None: every key).
        creds: the node's credentials (a ``node`` token; TLS files) for its
            masters and for the repair copies it writes to other nodes.
        min_beat_interval_s: deliveries from the agent's own thread are at
            least this far apart, so a burst of demotions travels in a few reports.
        full_stats_interval_s: how often a heartbeat recounts the per-object
            stats (evictable, pinned, ...: O(objects)), at most; a node with many
            objects recounts less often (:meth:`StoreNode.full_stats`), and the
            beats in between refresh only usage and counters.
        lease: renewed by each acknowledged registration and heartbeat (after
            its drop orders were applied); see :mod:`kvstore.store.lease`.
    """

    def __init__(self, node: StoreNode, address: NodeAddress, masters: tuple[str, ...],
                 router: EventRouter, shard: int = 0, owns: Callable[[str], bool] | None = None,
                 creds: ClientCredentials | None = None, incarnation: str = "",
                 min_beat_interval_s: float = 0.02, full_stats_interval_s: float = 1.0,
                 lease: MasterLease | None = None):
        self.node = node
        self.lease = lease
        self.ttl_ms = 0                        # the master's node ttl (from registration)
        self.creds = creds
        self.incarnation = incarnation or secrets.token_hex(16)
        self.address = address
        self.master = "|".join(masters)       # for logs
        self._addrs = masters
        self._cur = 0
        self.router = router
        self.shard = shard
        self.owns = owns
        self.rpc_timeout_s = 2.0
        self.interval_s = 0.5
        self.min_beat_interval_s = min_beat_interval_s
        self.coalesce_s = 0.005
        self.answer_spin_s: float | None = None   # the report link's poll (None: its default)
        self.full_stats_interval_s = full_stats_interval_s
        self._queue: list[Ticket] = []        # taken from the router, not yet acknowledged
        self._lock = threading.RLock()        # deliveries and registrations, one at a time
        self._retired: list[tuple[float, grpc.Channel]] = []   # (monotonic s, channel) to close
        self._copied: list = []               # repair results not yet reported
        self.inventory_sent = 0               # items of the last registration's inventory
        self.copier = _LazyCopier(node, creds)
        self._ready = node.events.subscribe()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"agent-{shard}", daemon=True)
        self._connect()

    def _connect(self) -> None:
        self.channel = rpc.channel(self._addrs[self._cur], self.creds)
        self.stub = pb_grpc.MasterStub(self.channel)
        # SyncInventory with the request serialized by the caller (kvstore.store.inventory).
        self._sync_inventory = self.channel.unary_unary(
            "/kvstore.v1.Master/SyncInventory", request_serializer=None,
            response_deserializer=pb.SyncInventoryResponse.FromString)
        self.stream = EventStream(self.stub)
        self.link: ReportLink | None = None       # set by a registration that names a port
        self.report_port = 0                      # ... the port the master last announced
        self._link_retry_at = 0.0                 # no new link before (monotonic s)
        self._link_backoff_s = 0.0

    def _report(self, req: pb.ReportEventsRequest, timeout_s: float) -> pb.ReportEventsResponse:
        """One report: on the master's report link (:mod:`kvstore.transfer.report_link`),
        else on the event stream, else unary (a master without either)."""
        self._use_port(self.report_port)
        if self.link is not None:
            try:
                answer = self.link.report(req, timeout_s)
            except KVStoreError as exc:
                # Reports go on the stream for a back-off that doubles while the
                # link keeps failing (a port that a firewall drops must not stall
                # writers at every report), then on a link to the port the master
                # last announced (a restarted master listens on another one).
                self._link_backoff_s = min(LINK_BACKOFF_MAX_S, max(1.0, 2 * self._link_backoff_s))
                self._link_retry_at = time.monotonic() + self._link_backoff_s
                log.info("master %s: report link: %s: %s (again in %.0f s at the earliest)",
                         self.master, type(exc).__name__, exc, self._link_backoff_s)
                self.link = None
                raise
            self._link_backoff_s = 0.0
            return answer
        if self.stream.supported:
            return self.stream.report(req, timeout_s)
        try:
            return self.stub.ReportEvents(req, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def _use_port(self, port: int, renew: bool = False) -> None:
        """Report on the master's report link at ``port`` (0: none) from now on;
        ``renew``: a new link even if the port is the same, and at once (a new
        registration); else not before the back-off of a failed link ends.
        Called under the agent's lock (reports, registrations)."""
        if self.link is not None and (renew or self.link.port != port):
            self.link.close()
            self.link = None
        if renew:
            self._link_retry_at = 0.0
        if port and self.link is None and time.monotonic() >= self._link_retry_at:
            self.link = ReportLink(self._addrs[self._cur].rsplit(":", 1)[0], port, self.creds,
                                   self.answer_spin_s)

    def _close_links(self) -> None:
        self.stream.close()
        if self.link is not None:
            self.link.close()

    def failover(self) -> None:
        """Move on to the shard's next master (after a failed RPC).

        Under the agent's lock, so no delivery or registration is midway on the old
        channel; the old channel is closed only after :data:`RETIRE_S`, because this
        agent's loop thread beats on the stub it read without the lock: grpcio
        crashes the process (SIGSEGV in ``_get_registered_call_handle``, seen in the
        multi-host chaos test) when a call is made on a channel another thread is
        closing."""
        with self._lock:
            self._close_links()
            if len(self._addrs) == 1:
                return
            now = time.monotonic()
            self._retired.append((now, self.channel))
            while self._retired and now - self._retired[0][0] > RETIRE_S:
                self._retired.pop(0)[1].close()
            self._cur = (self._cur + 1) % len(self._addrs)
            self._connect()

    def register(self, timeout_s: float = 10.0) -> None:
        """Register, then send everything of this shard the node holds now (its
        inventory) in chunks; returns once the master applied the last one.

        ``timeout_s`` bounds each call (the registration, each chunk), not the
        whole inventory, which takes as long as it takes the master to apply
        (about 10 us per object). A chunk that times out is sent again; a master
        that lost the registration (restarted, or a newer one replaced it) makes
        the node register again from the start.

        Raises:
            grpc.RpcError: no master of the shard answered within ``timeout_s``.
        """
        with self._lock:
            while not self._register_once(timeout_s):
                log.info("master %s lost the registration mid-inventory: registering again",
                         self.master)
            if self.inventory_sent:
                log.info("registered with %d object(s) in the inventory", self.inventory_sent)

    def _register_once(self, timeout_s: float) -> bool:
        """One registration and its inventory; False when the master lost it midway."""
        stats = self.node.full_stats(self.full_stats_interval_s)     # O(tiers), not objects
        req = pb.RegisterNodeRequest(
            address=wire.node_address_pb(self.address), tier=pb.DRAM,
            capacity_bytes=stats.capacity_bytes, max_object_bytes=self.node.max_object_bytes(),
            tiers=[wire.tier_stats_pb(t) for t in stats.tiers], incarnation=self.incarnation)
        deadline = time.monotonic() + timeout_s
        while True:
            single = len(self._addrs) == 1
            try:
                resp = self.stub.RegisterNode(
                    req, timeout=max(0.1, deadline - time.monotonic()) if single else 1.0,
                    wait_for_ready=single)
                break
            except grpc.RpcError as exc:
                if time.monotonic() > deadline:
                    raise
                if _id_taken(exc):
                    # Our previous process (killed) is still alive to the master
                    # until its registration expires; then this one is accepted.
                    log.info("master %s: %s; retrying", self.master, exc.details())
                    time.sleep(0.25)
                    continue
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.PERMISSION_DENIED,
                                  grpc.StatusCode.INVALID_ARGUMENT) or single:
                    raise
                self.failover()
                time.sleep(0.05)
        self.interval_s = resp.heartbeat_interval_ms / 1000.0
        self.ttl_ms = resp.node_ttl_ms
        sent = self._send_inventory(resp.sync_id, timeout_s)
        if sent is None:
            return False
        self.report_port = resp.report_port
        self._use_port(resp.report_port, renew=True)
        if self.lease is not None:
            self.lease.renew(self.shard, sent, self.ttl_ms)
        return True

    def _send_inventory(self, sync_id: int, timeout_s: float) -> float | None:
        """Every object of this shard the node holds, in chunks of at most
        INVENTORY_CHUNK items (:mod:`kvstore.store.inventory`: read a chunk at a time
        under the node's lock, serialized natively, the next one read while the master
        applies this one). Returns when the last chunk was sent (monotonic s: the
        master counts the node alive from its answer on), or None when the master
        lost the registration."""
        self.inventory_sent = 0
        rows = self.node.inventory_rows(INVENTORY_CHUNK, self.owns)
        sent, self.inventory_sent = send_inventory(
            self._sync_inventory, self.address.node_id, self.incarnation, sync_id, rows,
            INVENTORY_CHUNK, timeout_s)
        return sent

    def deliver(self, timeout_s: float | None = None) -> None:
        """Send this shard's pending events (one ReportEvents) and resolve their tickets.

        A STORED event the master refuses (its put was revoked, timed out or
        replaced) is dropped here and its writer fails with the reason.

        Args:
            timeout_s: give up after about this long (waiting for another
                delivery to this shard included); None: the agent's RPC timeout.

        Raises:
            KVStoreError: the master did not answer or refused the report (the
                events stay queued).
            grpc.RpcError: a registration it needed failed.
        """
        timeout_s = self.rpc_timeout_s if timeout_s is None else min(timeout_s, self.rpc_timeout_s)
        deadline = time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=timeout_s):
            return                    # another delivery to this shard is still in flight
        try:
            self._queue.extend(self.router.take_for(self.shard))
            if not self._queue:
                return
            batch = list(self._queue)
            req = pb.ReportEventsRequest(node_id=self.address.node_id,
                                         events=[wire.node_event_pb(t.event) for t in batch],
                                         incarnation=self.incarnation)
            resp = self._report(req, max(0.05, deadline - time.monotonic()))
            if not resp.known:
                log.warning("master %s does not know this node: registering again", self.master)
                self.register()
                resp = self._report(req, self.rpc_timeout_s)
            if not resp.known or len(resp.statuses) != len(batch):
                # Not applied: the events stay queued for the next delivery.
                log.warning("master %s did not apply %d event(s) (known=%s, %d statuses)",
                            self.master, len(batch), resp.known, len(resp.statuses))
                return
            del self._queue[:len(batch)]
            results = []
            for ticket, status in zip(batch, resp.statuses):
                error = None
                if status.code != pb.OK:
                    error = error_for_code(status.code, status.message, key=ticket.event.key)
                    if ticket.event.kind is EventKind.STORED:
                        self.node.drop(ticket.event.key, ticket.event.object_id)
                results.append((ticket, error))
            self.node.events.resolve(results)
        finally:
            self._lock.release()

    def beat(self) -> None:
        """One heartbeat: report stats and copy results, apply drop orders, run copy orders."""
        stats = self.node.full_stats(self.full_stats_interval_s)
        self._copied.extend(self.copier.take_results())
        sent = time.monotonic()
        resp = self.stub.Heartbeat(pb.HeartbeatRequest(
            node_id=self.address.node_id, used_bytes=stats.used_bytes,
            num_objects=stats.num_objects, tiers=[wire.tier_stats_pb(t) for t in stats.tiers],
            counters=stats.counters, copied=[wire.copy_result_pb(r) for r in self._copied],
            incarnation=self.incarnation),
            timeout=self.rpc_timeout_s)
        self._copied.clear()
        if not resp.known:
            log.warning("master %s does not know this node: registering again", self.master)
            self.register()
            return
        # The link follows at the next report (beats never wait for the agent's
        # lock, which a report holds for up to its timeout).
        self.report_port = resp.report_port
        for order in resp.copies:
            self.copier.submit(wire.copy_order(order))
        for d in map(wire.drop_order, resp.drops):
            self.node.drop(d.key, d.object_id)
        if self.lease is not None:
            self.lease.renew(self.shard, sent, self.ttl_ms)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and tell the master this node is gone (best effort), so a
        restart under the same id registers at once."""
        self._stop.set()
        self._ready.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.copier.stop()
        try:
            self.stub.Heartbeat(pb.HeartbeatRequest(node_id=self.address.node_id,
                                                    incarnation=self.incarnation, leaving=True),
                                timeout=1.0)
        except grpc.RpcError:
            pass                  # the master will expire it instead
        self._close_links()
        self.channel.close()
        for _at, channel in self._retired:
            channel.close()
        self._retired.clear()

    def _loop(self) -> None:
        # Deliver events as soon as they are appended (so the index stops
        # offering stale replicas), beat every interval.
        next_beat = 0.0
        outage = _Outage(self.master)
        while not self._stop.is_set():
            self._ready.wait(max(0.0, next_beat - time.monotonic()))
            if self._stop.is_set():
                return
            self._ready.clear()
            if time.monotonic() < next_beat:
                # Woken by new events: a writer waiting for its STORED event
                # delivers it (with the rest of its batch, one report); this
                # thread takes what no writer waits for, a moment later.
                self._stop.wait(self.coalesce_s)
            try:
                # The beat first: a delivery may wait (up to the RPC timeout) for a
                # writer's report to this shard, and a beat late by the node ttl
                # gets a busy node declared dead.
                if time.monotonic() >= next_beat:
                    self.beat()
                    next_beat = time.monotonic() + self.interval_s
                self.deliver()
                outage.ended()
            except (grpc.RpcError, KVStoreError) as exc:
                outage.failed(_why(exc))
                self.failover()
                next_beat = time.monotonic() + self.min_beat_interval_s
            except Exception:   # a bug: keep the node reporting, say so loudly
                log.exception("node agent round with %s failed", self.master)
                next_beat = time.monotonic() + self.interval_s
            self._stop.wait(self.min_beat_interval_s)


class _Outage:
    """The log of one master's unreachability: the first failure as a warning, then
    one line per OUTAGE_LOG_S with the count, and the recovery. (A node retries
    every ``min_beat_interval_s``: a line per attempt was about 50 a second.)"""

    def __init__(self, master: str):
        self.master = master
        self.failures = 0
        self.since = self.logged = 0.0

    def failed(self, code) -> None:
        now = time.monotonic()
        self.failures += 1
        if self.failures == 1:
            self.since = self.logged = now
            log.warning("master %s: %s; retrying", self.master, code)
        elif now - self.logged >= OUTAGE_LOG_S:
            self.logged = now
            log.warning("master %s: still %s after %.0f s (%d attempts)", self.master, code,
                        now - self.since, self.failures)

    def ended(self) -> None:
        if self.failures:
            log.warning("master %s: reachable again after %.1f s (%d failed attempts)",
                        self.master, time.monotonic() - self.since, self.failures)
            self.failures = 0


#: How often a node repeats that a master is still unreachable, in seconds.
OUTAGE_LOG_S = 10.0


class Agents:
    """The node's agents, one per master shard (each on its own thread).

    The node registers with every shard; each shard gets the inventory items
    and events of the keys in its slot range, and sends back drop orders and
    copy orders for its own keys. A shard that is down or hung delays no
    other shard's reports.
    """

    def __init__(self, node: StoreNode, address: NodeAddress, shard_map: ShardMap,
                 creds: ClientCredentials | None = None, lease: MasterLease | None = None):
        self.node = node
        ranges = shard_map.ranges
        sharded = len(ranges) > 1
        index_of = {r.shard_id: i for i, r in enumerate(ranges)}

        def shard_of(key: str) -> int:
            return index_of[shard_map.shard_for_key(key).shard_id]

        self.router = EventRouter(node.events, shard_of if sharded else None, len(ranges))
        if lease is not None:
            lease.shard_of = shard_of if sharded else None
            lease.reset(len(ranges))
        self.incarnation = secrets.token_hex(16)
        self.agents = [NodeAgent(node, address, r.addresses, self.router, i,
                                 owns=(lambda k, i=i: shard_of(k) == i) if sharded else None,
                                 creds=creds, incarnation=self.incarnation, lease=lease)
                       for i, r in enumerate(ranges)]

    def register(self, timeout_s: float = 10.0) -> None:
        """Register with every shard (each must answer within ``timeout_s``).

        From here on writers waiting for STORED events deliver through
        :meth:`deliver` (a write can arrive as soon as a shard knows the node).
        """
        self.node.events.set_delivery(self.deliver)
        for agent in self.agents:
            agent.register(timeout_s)

    def start(self) -> None:
        """Start each shard's loop (event deliveries and heartbeats)."""
        for agent in self.agents:
            agent.start()

    def deliver(self, tickets: list[Ticket], timeout_s: float) -> None:
        """Deliver the pending events of the shards owning ``tickets`` (the writers'
        waits: a down or hung shard delays no other shard's writes), within about
        ``timeout_s``; a failure is logged and the events stay queued."""
        shards = {self.router.shard_index(t.event.key) for t in tickets}
        deadline = time.monotonic() + timeout_s
        for i in sorted(shards):
            agent = self.agents[i]
            try:
                agent.deliver(max(0.0, deadline - time.monotonic()))
            except (grpc.RpcError, KVStoreError) as exc:
                log.debug("event delivery to %s failed: %s", agent.master, _why(exc))

    def stop(self) -> None:
        # A write still waiting now is not acknowledged (its master was not told).
        self.node.events.set_delivery(no_master_yet)
        for agent in self.agents:
            agent.stop()


def _why(exc: grpc.RpcError | KVStoreError) -> str:
    """A failed master call in a word, for the log (its status or class)."""
    return exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__


def _id_taken(exc: grpc.RpcError) -> bool:
    """A refusal because the node id is alive under another incarnation."""
    return isinstance(from_rpc_error(exc), IdTaken)


def no_master_yet(tickets: list[Ticket], timeout_s: float) -> None:
    """A node not (or no longer) linked to its masters: writes wait, then fail."""
    time.sleep(min(timeout_s, 0.05))


def make_agent(node: StoreNode, address: NodeAddress, seeds: tuple[str, ...],
               timeout_s: float = 30.0, creds: ClientCredentials | None = None,
               lease: MasterLease | None = None, answer_spin_s: float | None = None) -> Agents:
    """The node's link to the control plane, from the shard map its ``seeds`` serve.

    Asks the seeds (one shard's masters) for the shard map, waiting up to
    ``timeout_s`` for one to come up. ``answer_spin_s``: how long a writer polls
    for its master's answer on the report link (0: never; None: its default).

    Raises:
        Unavailable: no seed answered within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    for i in itertools.count():
        with rpc.channel(seeds[i % len(seeds)], creds) as ch:
            try:
                msg = pb_grpc.MasterStub(ch).GetShardMap(
                    pb.GetShardMapRequest(), timeout=timeout_s if len(seeds) == 1 else 1.0,
                    wait_for_ready=True)
                break
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAUTHENTICATED,
                                  grpc.StatusCode.PERMISSION_DENIED):
                    raise from_rpc_error(exc) from None     # a bad token: no use waiting
                if time.monotonic() > deadline:
                    raise Unavailable(f"no master answered at {'|'.join(seeds)} within "
                                      f"{timeout_s:.0f} s ({exc.code().name})") from None
    shard_map = wire.shard_map(msg)
    if len(shard_map.ranges) > 1:
        log.info("shard map v%d: %d master shards", shard_map.version, len(shard_map.ranges))
    agents = Agents(node, address, shard_map, creds, lease)
    for agent in agents.agents:
        agent.answer_spin_s = answer_spin_s
    return agents
