"""gRPC servicer of a master shard: thin over :class:`ObjectIndex` and :class:`Membership`.

Every handler runs on the server's event loop; the index is only touched
there, so it needs no lock.
"""

from __future__ import annotations

import logging
import time

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore import wire
from kvstore.master.index import ObjectIndex

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


class MasterServicer(pb_grpc.MasterServicer):
    """Handlers of one master shard.

    Args:
        index: the shard's index (replaced by a fresh one from ``new_index``
            each time this process becomes leader again).
        election: the shard's leader election (None: always the leader).
        new_index: builds an empty index for a new term.
        warmup_ms: after winning, client RPCs answer UNAVAILABLE this long
            while store nodes re-register and rebuild the index from their
            inventories (node RPCs are served at once).
    """

    def __init__(self, index: ObjectIndex, election=None, new_index=None, warmup_ms: int = 1500):
        self.index = index
        self.membership = index.membership
        self.election = election
        self.new_index = new_index
        self.warmup_ms = warmup_ms
        self._term = 0
        self._term_start_ms = 0

    def leading(self) -> bool:
        """Whether this process serves the shard now; starts a new term's index when needed."""
        e = self.election
        if e is None:
            return True
        if not e.is_leader():
            return False
        if e.term != self._term:
            self._term = e.term
            self._term_start_ms = now_ms()
            if self.new_index is not None:
                self.index = self.new_index()
                self.membership = self.index.membership
            # Object ids of this term start above every id an earlier leader
            # could have handed out: the etcd revision of the win is larger
            # than at any earlier win.
            self.index._next_id = max(self.index._next_id, e.term_revision << 32)
            log.info("leading shard %d, term %d: index rebuilt from node inventories",
                     self.index.shard_id, e.term)
        return True

    async def _gate(self, context, client_rpc: bool = True) -> None:
        if not self.leading():
            hint = self.election.leader_hint if self.election else ""
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"not the leader of shard {self.index.shard_id}"
                                + (f" (leader: {hint})" if hint else ""))
        if client_rpc and self.election is not None and now_ms() - self._term_start_ms < self.warmup_ms:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "new shard leader: rebuilding the index from node inventories")

    async def RegisterNode(self, request, context):
        await self._gate(context, client_rpc=False)
        node_id = request.address.node_id
        _, known = self.membership.register(request, now_ms())
        # The node's inventory is the truth about it: a restart loses DRAM and
        # keeps the SSD; objects the index does not know are indexed again.
        lost, indexed = self.index.sync_node_inventory(node_id, request.inventory, now_ms())
        if lost or indexed:
            log.info("node %s registered%s with %d object(s): %d indexed from its inventory, "
                     "%d lost their last replica", node_id, " again" if known else "",
                     len(request.inventory), indexed, lost)
        return pb.RegisterNodeResponse(heartbeat_interval_ms=self.membership.heartbeat_interval_ms,
                                       node_ttl_ms=self.membership.node_ttl_ms)

    async def Heartbeat(self, request, context):
        await self._gate(context, client_rpc=False)
        info = self.membership.heartbeat(request, now_ms())
        if info is None:
            return pb.HeartbeatResponse(known=False)
        for r in request.removed:
            self.index.node_removed(request.node_id, r.key, r.object_id)
        for event in request.events:
            self.index.node_event(request.node_id, event)
        for result in request.copied:
            self.index.copy_done(result)
        return pb.HeartbeatResponse(known=True, drops=self.membership.take_drops(request.node_id),
                                    copies=self.membership.take_copies(request.node_id))

    async def GetShardMap(self, request, context):
        return wire.shard_map_pb(self.index.shard_map)

    async def PutStart(self, request, context):
        await self._gate(context)
        return self.index.put_start(request, now_ms())

    async def PutEnd(self, request, context):
        await self._gate(context)
        return self.index.put_end(request, now_ms())

    async def PutRevoke(self, request, context):
        await self._gate(context)
        return self.index.put_revoke(request)

    async def Lookup(self, request, context):
        await self._gate(context)
        return self.index.lookup(list(request.keys), now_ms())

    async def Exists(self, request, context):
        await self._gate(context)
        exists, statuses = self.index.exists_checked(list(request.keys))
        return pb.ExistsResponse(exists=exists, statuses=statuses)

    async def Remove(self, request, context):
        await self._gate(context)
        return self.index.remove(list(request.keys), request.reason or "remove")

    async def List(self, request, context):
        await self._gate(context)
        return self.index.list(request.prefix, request.start_after, request.limit)

    async def Stat(self, request, context):
        await self._gate(context, client_rpc=False)
        return self.index.stat()

    async def ReportFailure(self, request, context):
        await self._gate(context, client_rpc=False)
        now = now_ms()
        for node_id in request.node_ids:
            self.index.counters["transfer_failures_reported"] += 1
            if self.membership.report_failure(node_id, now):
                self.index.counters["quarantined"] += 1
        return pb.ReportFailureResponse()
