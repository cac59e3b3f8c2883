"""gRPC servicer of a master shard: protobuf in and out, thin over the pure classes.

Every handler converts its request to :mod:`kvstore.types` records
(:mod:`kvstore.wire`), calls :class:`~kvstore.master.index.ObjectIndex`,
:class:`~kvstore.master.membership.Membership` or
:class:`~kvstore.master.repair.RepairPlanner`, and converts the results
back; per-item errors become ``Status`` messages through
:func:`kvstore.errors.to_status` (the one code table).

Every handler runs on the server's event loop; the index is only touched
there, so it needs no lock.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable

import grpc

from kvstore import rpc, wire
from kvstore._native import InventoryChunk
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import (OK_STATUS, IndexIncomplete, KVStoreError, NotLeader,
                            PermissionDenied, Unavailable, to_status)
from kvstore.master.counters import MasterCounter as C
from kvstore.master.event_feed import DEFAULT_CAPACITY, EventFeed, check_prefixes
from kvstore.master.index import ObjectIndex
from kvstore.master.limits import MAX_INVENTORY_CHUNK
from kvstore.master.membership import NodeHeartbeat, NodeRegistration
from kvstore.master.repair import RepairPlanner
from kvstore.master.roster import Roster
from kvstore.master.stall import LoopWatch
from kvstore.master.term import Term
from kvstore.auth import Role, fingerprint
from kvstore.clock import SYSTEM_CLOCK, Clock
from kvstore.rpc import (MAX_KEYS_PER_CALL, ServerSecurity, bearer, caller_role, caller_scope,
                         check_replica_num)
from kvstore.master.scopes import hidden_positions, list_scoped, merge_hidden
from kvstore.tenants import tenant_of
from kvstore.types import NodeId, RemoveReason

log = logging.getLogger(__name__)


_NODE = frozenset({Role.NODE})
_CLIENT = frozenset({Role.CLIENT})

#: Which roles may call which method (admin may call all; Stat is admin's; a client's
#: List shows its tenants' keys only).
#: Remove with reason "evict" is admin's too (checked in the handler).
METHOD_ROLES: dict[str, frozenset[Role]] = {
    "RegisterNode": _NODE, "SyncInventory": _NODE, "Heartbeat": _NODE, "ReportEvents": _NODE,
    "StreamEvents": _NODE,
    "GetShardMap": _CLIENT | _NODE | frozenset({Role.METRICS}),
    "GrantPlacement": _CLIENT,
    "Lookup": _CLIENT, "Exists": _CLIENT,
    "Remove": _CLIENT, "ReportFailure": _CLIENT, "List": _CLIENT,
    "WatchEvents": frozenset({Role.METRICS}),      # routers, kvctl events (and admin)
    "TenantStats": _CLIENT | frozenset({Role.METRICS}),   # its own tenants' (admin: all)
}


def decode_sync_inventory(raw: bytes) -> InventoryChunk:
    """SyncInventory's request deserializer: the bytes decoded natively into columns
    (kvstore/native/inventory_wire.hpp), no protobuf object per item; the items past
    MAX_INVENTORY_CHUNK are counted, not kept (the handler refuses the chunk).

    Raises:
        ValueError: not a SyncInventoryRequest (the call answers INVALID_ARGUMENT).
    """
    return InventoryChunk.decode(raw, MAX_INVENTORY_CHUNK)


def add_to_server(servicer: "MasterServicer", server) -> None:
    """``add_MasterServicer_to_server``, but SyncInventory's request is decoded by
    :func:`decode_sync_inventory` (a node's inventory is millions of items)."""
    handlers: dict = {}

    class _Capture:       # the generated function's handlers, before they are added
        def add_generic_rpc_handlers(self, _):
            pass

        def add_registered_method_handlers(self, _, found):
            handlers.update(found)

    pb_grpc.add_MasterServicer_to_server(servicer, _Capture())
    handlers["SyncInventory"] = grpc.unary_unary_rpc_method_handler(
        servicer.SyncInventory, request_deserializer=decode_sync_inventory,
        response_serializer=pb.SyncInventoryResponse.SerializeToString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("kvstore.v1.Master", handlers),))
    server.add_registered_method_handlers("kvstore.v1.Master", handlers)


def _status(result) -> pb.Status:
    return to_status(result) if isinstance(result, KVStoreError) else OK_STATUS


class MasterServicer(pb_grpc.MasterServicer):
    """Handlers of one master shard.

    Args:
        index: the shard's index (replaced by a fresh one from ``new_index``
            each time this process becomes leader again).
        election: the shard's leader election (None: always the leader).
        new_index: builds an empty index for a new term.
        roster: where the shard's nodes are kept (:mod:`kvstore.master.roster`);
            the warm-up of each term waits for them. None: no roster.
        security: the server's tokens, for the checks a method's table cannot
            express (an eviction is admin's).
        event_log: events each term's log keeps for replay (:mod:`kvstore.master.event_feed`).

    The warm-up (:mod:`kvstore.master.warmup`): after starting and after each
    win, client RPCs answer UNAVAILABLE (:class:`~kvstore.errors.IndexIncomplete`,
    saying what is missing) until every node of the roster re-registered and
    its inventory is applied, or its ttl passed without it; node RPCs are
    served at once. So no key a live node holds is reported NotFound, and no
    existing key is taken for a new one, across a master restart.
    """

    def __init__(self, index: ObjectIndex, election=None,
                 new_index: Callable[[], ObjectIndex] | None = None,
                 roster: Roster | None = None, security: ServerSecurity | None = None,
                 clock: Clock = SYSTEM_CLOCK, event_log: int = DEFAULT_CAPACITY):
        self.index = index
        self.event_log = event_log
        self.clock = clock           # monotonic for every deadline; wall only in replies
        self.security = security
        self.report_port = 0         # the socket port (kvstore.master.report_port); 0: none
        self.repairs = RepairPlanner(index)
        self.election = election
        self.new_index = new_index
        self.roster = roster or Roster()
        self._term = 0
        self.past_counters: Counter[C] = Counter()   # of earlier terms' indexes (metrics)
        self.leader_changes = 0        # this process won or lost its shard's lead
        self.metrics_address = ""      # its /metrics, for kvctl top (set by serve)
        self._was_leading = election is None
        self.loop_watch = LoopWatch()  # run by serve()
        self.stopping = False          # end_watches() was called: watch streams end
        self._new_term()

    @property
    def membership(self):
        return self.index.membership

    def _new_term(self) -> None:
        """A term starts (the process, or a win): a fresh warm-up (kvstore.master.term)."""
        self.term = Term(self.index, self.roster, self.clock.monotonic_ms())
        # A new log per term (its epoch grows: the etcd revision of the win, else the
        # start's unix ms), fed by the term's index.
        e = self.election
        epoch = e.term_revision if e is not None and e.term_revision else self.clock.wall_ms()
        self.feed = EventFeed(epoch, self.event_log,
                              None if self.clock is SYSTEM_CLOCK else self.clock.wall_ms)
        self.index.on_event = self.feed.record

    def leading(self) -> bool:
        """Whether this process serves the shard now; starts a new term's index when needed."""
        e = self.election
        if e is None:
            return True
        if not e.is_leader():
            if self._was_leading:
                self._was_leading = False
                self.leader_changes += 1
            return False
        if not self._was_leading:
            self._was_leading = True
            self.leader_changes += 1
        if e.term != self._term:
            self._term = e.term
            if self.new_index is not None:
                self.past_counters.update(self.index.counters)
                self.index = self.new_index()
                self.repairs = RepairPlanner(self.index)
            self._new_term()
            # Object ids of this term start above every id an earlier leader
            # could have handed out: the etcd revision of the win is larger
            # than at any earlier win.
            self.index.start_term(e.term_revision << 32)
            log.info("leading shard %d, term %d: index rebuilt from node inventories",
                     self.index.shard_id, e.term)
        return True

    def warming_up(self) -> bool:
        """The index is not whole yet (see the class docstring)."""
        return self.term.warming_up(self.clock.monotonic_ms())

    async def _gate(self, context, client_rpc: bool = True) -> None:
        if not self.leading():
            await rpc.abort(context, self.not_leader())
        if client_rpc and self.warming_up():
            now = self.clock.monotonic_ms()
            await rpc.abort(context, IndexIncomplete(
                f"index incomplete: shard {self.index.shard_id}'s master "
                f"(re)started {now - self.term.start_ms} ms ago; {self.term.describe(now)}"))

    def not_leader(self) -> NotLeader:
        """This standby's refusal, naming the leader when the election knows it."""
        hint = self.election.leader_hint if self.election else ""
        return NotLeader(f"not the leader of shard {self.index.shard_id}"
                         + (f" (leader is {hint})" if hint else ""), leader=hint)

    def _meta_pb(self, meta) -> pb.ObjectMeta:
        """An entry's metadata for a reply: its instants (monotonic in the index) as
        unix ms, read on the wall clock now (another process compares them with its
        own wall clock: a monotonic value never leaves this process)."""
        msg = wire.object_meta_pb(meta)
        msg.created_ms = self.clock.wall_of(msg.created_ms)
        msg.last_access_ms = self.clock.wall_of(msg.last_access_ms)
        return msg

    def _owner(self, context) -> str:
        """The fingerprint of the caller's token ("" without --auth)."""
        if self.security is None or self.security.tokens is None:
            return ""
        return fingerprint(bearer(context.invocation_metadata()))

    async def _bounded(self, context, n: int) -> None:
        """Refuse a call of more than MAX_KEYS_PER_CALL keys (INVALID_ARGUMENT)."""
        if n > MAX_KEYS_PER_CALL:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{n} keys in one call; at most {MAX_KEYS_PER_CALL} "
                                f"(the SDK splits larger batches)")

    async def _refuse(self, context, err: KVStoreError):
        log.warning("refused: %s", err.message)
        await rpc.abort(context, err)

    # ---- node RPCs ----
    async def RegisterNode(self, request, context):
        await self._gate(context, client_rpc=False)
        if not request.incarnation or not request.address.node_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "RegisterNode needs address.node_id and an incarnation")
        reg = NodeRegistration(address=wire.node_address(request.address),
                               capacity_bytes=request.capacity_bytes,
                               max_object_bytes=request.max_object_bytes,
                               tiers=tuple(wire.tier_stats(t) for t in request.tiers),
                               incarnation=request.incarnation, owner=self._owner(context))
        try:
            sync_id = await self.term.registrations.register(reg, self.clock.monotonic_ms())
        except KVStoreError as err:
            await self._refuse(context, err)
        return pb.RegisterNodeResponse(heartbeat_interval_ms=self.membership.heartbeat_interval_ms,
                                       node_ttl_ms=self.membership.node_ttl_ms,
                                       report_port=self.report_port, sync_id=sync_id)

    async def SyncInventory(self, request, context):
        await self._gate(context, client_rpc=False)
        node_id = NodeId(request.node_id)
        info = self.membership.nodes.get(node_id)
        if info is None:
            return pb.SyncInventoryResponse(known=False)
        try:
            self.membership.check_identity(info, request.incarnation, self._owner(context))
            # Bad input first: nothing of a chunk that is refused is applied.
            # Natively decoded (add_to_server): the chunk itself; a message otherwise.
            items = request if isinstance(request, InventoryChunk) else request.items
            applied = await self.term.registrations.sync_chunk(
                node_id, request.sync_id, request.seq, items, request.last, self.clock.monotonic_ms,
                wire.inventory_item)
        except KVStoreError as err:
            await self._refuse(context, err)
        if applied is None:
            return pb.SyncInventoryResponse(known=False)
        return pb.SyncInventoryResponse(known=True, items_applied=applied)

    async def Heartbeat(self, request, context):
        await self._gate(context, client_rpc=False)
        node_id = NodeId(request.node_id)
        beat = NodeHeartbeat(node_id=node_id, used_bytes=request.used_bytes,
                             num_objects=request.num_objects,
                             tiers=tuple(wire.tier_stats(t) for t in request.tiers),
                             counters=dict(request.counters) if request.counters else None,
                             incarnation=request.incarnation, owner=self._owner(context),
                             leaving=request.leaving)
        try:
            if self.membership.heartbeat(beat, self.clock.monotonic_ms()) is None:
                self.term.warmup.heard(node_id, self.clock.monotonic_ms())     # alive: its registration comes
                return pb.HeartbeatResponse(known=False)
            if request.leaving:
                return pb.HeartbeatResponse(known=True)
        except KVStoreError as err:
            await self._refuse(context, err)
        for result in request.copied:
            self.repairs.done(wire.copy_result(result))
        return pb.HeartbeatResponse(
            known=True, drops=[wire.drop_order_pb(d) for d in self.membership.take_drops(node_id)],
            copies=[wire.copy_order_pb(c) for c in self.membership.take_copies(node_id)],
            report_port=self.report_port)

    async def ReportEvents(self, request, context):
        await self._gate(context, client_rpc=False)
        return await self._report(request, context)

    async def StreamEvents(self, request_iterator, context):
        async for request in request_iterator:
            await self._gate(context, client_rpc=False)      # leadership may end mid-stream
            yield await self._report(request, context)

    async def _report(self, request, context) -> pb.ReportEventsResponse:
        try:
            return self.apply_report(request, self._owner(context))
        except KVStoreError as err:
            await self._refuse(context, err)

    def apply_report(self, request: pb.ReportEventsRequest, owner: str) -> pb.ReportEventsResponse:
        """Apply a node's events (ReportEvents, StreamEvents and the report link of
        :mod:`kvstore.master.report_port`); ``owner``: its token's fingerprint.

        Raises:
            PermissionDenied: the node id is registered by another process or token.
            InvalidArgument: an event that cannot be read (none is applied).
        """
        node_id = NodeId(request.node_id)
        if not self.membership.is_known(node_id):
            return pb.ReportEventsResponse(known=False)
        self.membership.check_identity(self.membership.nodes[node_id], request.incarnation, owner)
        events = [wire.node_event(e) for e in request.events]   # all or none: bad input first
        now = self.clock.monotonic_ms()
        self.membership.touch(node_id, now)
        return pb.ReportEventsResponse(known=True, statuses=[
            _status(self.index.node_event(node_id, e, now)) for e in events])

    async def GetShardMap(self, request, context):
        return wire.shard_map_pb(self.index.shard_map)

    # ---- client RPCs ----
    async def GrantPlacement(self, request, context):
        await self._gate(context)
        try:
            check_replica_num(request.replica_num, unset_ok=True)
            if request.key and not caller_scope(context, self.security).allows(request.key):
                # Refused whether the key exists or not: nothing is confirmed.
                raise PermissionDenied(f"this token may not write tenant "
                                       f"{tenant_of(request.key)!r}'s keys", key=request.key)
            grant, nodes = self.index.grant(request.replica_num or 1, request.num_ids or 1,
                                            self.clock.monotonic_ms(), request.key)
        except KVStoreError as err:
            await self._refuse(context, err)
        own = next(r for r in self.index.shard_map.ranges if r.shard_id == self.index.shard_id)
        return pb.GrantPlacementResponse(
            first_object_id=grant.first_object_id, num_ids=grant.num_ids,
            valid_ms=self.index.grants.valid_ms, first_slot=own.first_slot,
            last_slot=own.last_slot, call_port=self.report_port,
            nodes=[pb.PlacementNode(address=wire.node_address_pb(n.address),
                                    free_bytes=n.free_bytes, max_object_bytes=n.max_object_bytes)
                   for n in nodes])

    async def Lookup(self, request, context):
        await self._bounded(context, len(request.keys))      # bad input first
        await self._gate(context)
        keys = list(request.keys)
        hidden = hidden_positions(caller_scope(context, self.security), keys)
        if hidden:      # other tenants' keys: answered as keys that never existed
            results = merge_hidden(keys, hidden, lambda ks: self.index.lookup(
                ks, self.clock.monotonic_ms()), self.index.hidden)
        else:
            results = self.index.lookup(keys, self.clock.monotonic_ms())
        return pb.LookupResponse(call_port=self.report_port, results=[
            pb.LookupResult(status=to_status(r)) if isinstance(r, KVStoreError) else
            pb.LookupResult(status=OK_STATUS, meta=self._meta_pb(r))
            for r in results])

    async def Exists(self, request, context):
        await self._bounded(context, len(request.keys))      # bad input first
        await self._gate(context)
        keys = list(request.keys)
        exists, errors = self.index.exists_checked(keys)    # every key: the same work
        for i in hidden_positions(caller_scope(context, self.security), keys):
            exists[i] = False           # another tenant's key: as one that never existed
        return pb.ExistsResponse(exists=exists, statuses=[_status(e) for e in errors],
                                 call_port=self.report_port)

    async def Remove(self, request, context):
        try:
            reason = RemoveReason(request.reason or RemoveReason.REMOVE.value)
        except ValueError:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unknown remove reason {request.reason!r}; known: "
                                f"{[r.value for r in RemoveReason]}")
        if reason is RemoveReason.EVICT and caller_role(context, self.security) is not Role.ADMIN:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "only an admin may evict")
        await self._bounded(context, len(request.keys))
        await self._gate(context)
        keys = list(request.keys)
        hidden = hidden_positions(caller_scope(context, self.security), keys)
        results = (merge_hidden(keys, hidden, lambda ks: self.index.remove(ks, reason),
                                self.index.hidden) if hidden
                   else self.index.remove(keys, reason))
        return pb.RemoveResponse(statuses=[_status(r) for r in results], removed=[
            pb.ObjectMeta() if isinstance(r, KVStoreError) else self._meta_pb(r)
            for r in results])

    async def List(self, request, context):
        await self._gate(context)
        scope = caller_scope(context, self.security)
        page, cursor = (self.index.list(request.prefix, request.start_after, request.limit)
                        if scope.everything else
                        list_scoped(self.index.list, scope, request.prefix, request.start_after,
                                    request.limit))
        return pb.ListResponse(objects=[self._meta_pb(m) for m in page], next_cursor=cursor)

    async def Stat(self, request, context):
        await self._gate(context, client_rpc=False)
        reply = wire.shard_status_pb(self.index.stat())
        for node in reply.nodes:        # the index's instants are monotonic: shown as unix ms
            node.last_heartbeat_ms = self.clock.wall_of(node.last_heartbeat_ms)
        reply.metrics_address = self.metrics_address
        reply.loop_stall_max_ms = self.loop_watch.max_ms
        reply.loop_stalls = self.loop_watch.stalls
        if self.warming_up():
            warmup = self.term.warmup
            reply.warmup_left_ms = (warmup.left_ms(self.clock.monotonic_ms()) if self.term.roster_loaded
                                    else self.membership.node_ttl_ms)
            reply.warmup_nodes.extend(pb.WarmupNode(node_id=n.node_id, state=int(n.state),
                                                    items_applied=n.items_applied)
                                      for n in warmup.missing())
        return reply

    async def TenantStats(self, request, context):
        await self._gate(context, client_rpc=False)
        return pb.TenantStatsResponse(tenants=[
            wire.tenant_status_pb(t)
            for t in self.index.tenants.figures(self.index, caller_scope(context, self.security))])

    async def WatchEvents(self, request, context):
        """The shard's event log from a sequence, then live (kvstore.master.event_feed):
        a header (no events: the log's epoch and bounds), then batches; ends with
        EventsLost (the sequence is gone), or NotLeader / Unavailable when the term ends."""
        try:
            prefixes = check_prefixes(request.key_prefixes)
        except KVStoreError as err:
            await rpc.abort(context, err)
        await self._gate(context, client_rpc=False)
        if self.stopping:
            await rpc.abort(context, Unavailable("the master is stopping"))
        feed = self.feed
        seq = feed.start(request.from_seq, request.epoch, request.oldest)   # or EventsLost
        yield self._events_pb(feed, (), seq)
        async for batch in feed.follow(seq, prefixes):
            scope = caller_scope(context, self.security)     # a reload counts at once
            if not self.leading():
                await rpc.abort(context, self.not_leader())
            if self.stopping:
                await rpc.abort(context, Unavailable("the master is stopping"))
            if self.feed is not feed:
                await rpc.abort(context, Unavailable(
                    f"the event log of epoch {feed.epoch} ended with its term; the shard's "
                    f"log is now of epoch {self.feed.epoch}"))
            events = batch.events if scope.everything else \
                [e for e in batch.events if scope.allows(e.key)]
            yield self._events_pb(feed, events, batch.next_seq)

    def end_watches(self) -> None:
        """End every WatchEvents stream now (UNAVAILABLE: watchers go to the next
        leader) rather than after the drain's grace: a stopping master calls it."""
        self.stopping = True
        self.feed.stop()

    def _events_pb(self, feed: EventFeed, events, next_seq: int) -> pb.WatchEventsResponse:
        return pb.WatchEventsResponse(
            shard_id=self.index.shard_id, epoch=feed.epoch, next_seq=next_seq,
            first_seq=feed.first_seq,
            events=[pb.StoreEvent(seq=e.seq, kind=int(e.kind), key=e.key, object_id=e.object_id,
                                  size_bytes=e.size_bytes, time_ms=e.time_ms, node_id=e.node_id)
                    for e in events])

    async def ReportFailure(self, request, context):
        await self._gate(context, client_rpc=False)
        now = self.clock.monotonic_ms()
        for node_id in request.node_ids:
            self.index.counters[C.TRANSFER_FAILURES_REPORTED] += 1
            if self.membership.report_failure(NodeId(node_id), now):
                self.index.counters[C.QUARANTINED] += 1
        return pb.ReportFailureResponse()
