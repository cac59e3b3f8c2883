"""Monotonic time on the master (issue 32): a real master shard (in-process gRPC
server, port chosen at run time) on an injected clock whose wall clock jumps an
hour either way while monotonic time runs on. No node dies of a forward step, no
grant expires early, and a backward step keeps no dead node alive; replies show
instants as unix ms on the wall clock."""

from __future__ import annotations

import asyncio

import grpc

from kvstore import rpc
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.clock import ManualClock
from kvstore.errors import IndexIncomplete, from_rpc_error
from kvstore.master.server import create_server, maintain

TTL_MS = 2000
HOUR_MS = 3_600_000


async def _scenario() -> None:
    clock = ManualClock()
    server, port, index = await create_server(node_ttl_ms=TTL_MS, heartbeat_interval_ms=500,
                                              put_timeout_ms=1000, clock=clock)
    servicer = server.servicer
    try:
        async with rpc.aio_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.MasterStub(ch)
            addr = pb.NodeAddress(node_id="n0", host="127.0.0.1", data_port=1, host_id="h")
            reg = await stub.RegisterNode(pb.RegisterNodeRequest(
                address=addr, capacity_bytes=1 << 20, max_object_bytes=1 << 20,
                incarnation="i1"))
            await stub.SyncInventory(pb.SyncInventoryRequest(
                node_id="n0", incarnation="i1", sync_id=reg.sync_id, last=True))

            async def beat() -> None:
                await stub.Heartbeat(pb.HeartbeatRequest(node_id="n0", incarnation="i1"))

            async def node_alive() -> bool:
                await maintain(servicer)
                (node,) = (await stub.Stat(pb.StatRequest())).nodes
                return node.alive

            async def grant() -> pb.GrantPlacementResponse:
                return await stub.GrantPlacement(pb.GrantPlacementRequest(replica_num=1,
                                                                          num_ids=1))
            await maintain(servicer)
            for _ in range(10):                  # the warm-up ends on monotonic time
                try:
                    g = await grant()
                    break
                except grpc.aio.AioRpcError as exc:
                    assert isinstance(from_rpc_error(exc), IndexIncomplete), exc
                clock.advance(TTL_MS // 2)
                await beat()
                await maintain(servicer)
            await beat()

            # NTP steps the wall clock an hour forward: the node beat just now, the
            # grant was given just now; neither is an hour old.
            clock.step_wall(HOUR_MS)
            clock.advance(TTL_MS // 2)
            assert await node_alive()
            assert index.grants.find(g.first_object_id, clock.monotonic_ms()) is not None
            await beat()
            beat_wall = clock.wall_ms()
            (node,) = (await stub.Stat(pb.StatRequest())).nodes
            assert node.last_heartbeat_ms == beat_wall       # shown as unix ms, stepped

            # ... and two hours back: a node that stopped beating still dies one ttl
            # after its last heartbeat (not an hour or two later), and the grant ends.
            clock.step_wall(-2 * HOUR_MS)
            clock.advance(TTL_MS - 1)
            assert await node_alive()
            clock.advance(2)
            assert not await node_alive()
            clock.advance(2000 + 1000)           # the grant's validity and put timeout
            await maintain(servicer)
            assert index.grants.find(g.first_object_id, clock.monotonic_ms()) is None
    finally:
        server.report_port.close()
        await server.stop(None)


def test_wall_clock_steps_kill_no_node_expire_no_grant_and_keep_no_dead_node():
    asyncio.run(_scenario())
