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
from kvstore.master.index import ObjectIndex

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


class MasterServicer(pb_grpc.MasterServicer):
    def __init__(self, index: ObjectIndex):
        self.index = index
        self.membership = index.membership

    async def RegisterNode(self, request, context):
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
        info = self.membership.heartbeat(request, now_ms())
        if info is None:
            return pb.HeartbeatResponse(known=False)
        for r in request.removed:
            self.index.node_removed(request.node_id, r.key, r.object_id)
        for event in request.events:
            self.index.node_event(request.node_id, event)
        return pb.HeartbeatResponse(known=True, drops=self.membership.take_drops(request.node_id))

    async def GetShardMap(self, request, context):
        return self.index.shard_map.to_proto()

    async def PutStart(self, request, context):
        return self.index.put_start(request, now_ms())

    async def PutEnd(self, request, context):
        return self.index.put_end(request, now_ms())

    async def PutRevoke(self, request, context):
        return self.index.put_revoke(request)

    async def Lookup(self, request, context):
        return self.index.lookup(list(request.keys), now_ms())

    async def Exists(self, request, context):
        return pb.ExistsResponse(exists=self.index.exists(request.keys))

    async def Remove(self, request, context):
        return self.index.remove(list(request.keys), request.reason or "remove")

    async def List(self, request, context):
        return self.index.list(request.prefix, request.start_after, request.limit)

    async def Stat(self, request, context):
        return self.index.stat()
