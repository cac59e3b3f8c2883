"""Master shard process: ``kvstore master`` / ``python -m kvstore.master.server``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import grpc

from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.master.index import ObjectIndex
from kvstore.master.membership import Membership
from kvstore.master.servicer import MasterServicer, now_ms
from kvstore.process import announce_ready, setup_logging
from kvstore.shardmap import ShardMap

log = logging.getLogger(__name__)

GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024)]


async def create_server(host: str = "127.0.0.1", port: int = 0, *,
                        node_ttl_ms: int = 3000, heartbeat_interval_ms: int = 500,
                        put_timeout_ms: int = 30_000) -> tuple[grpc.aio.Server, int, ObjectIndex]:
    """Build and start a single-shard master on ``host:port`` (0 = a free port).

    Returns:
        ``(server, port, index)``; stop with ``await server.stop(grace)``.
    """
    server = grpc.aio.server(options=GRPC_OPTIONS)
    bound = server.add_insecure_port(f"{host}:{port}")
    membership = Membership(node_ttl_ms=node_ttl_ms, heartbeat_interval_ms=heartbeat_interval_ms)
    index = ObjectIndex(membership, ShardMap.single(f"{host}:{bound}"), put_timeout_ms=put_timeout_ms)
    pb_grpc.add_MasterServicer_to_server(MasterServicer(index), server)
    await server.start()
    return server, bound, index


async def _maintenance(index: ObjectIndex, period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        now = now_ms()
        index.membership.expire(now)
        index.expire_puts(now)


async def serve(host: str, port: int, node_ttl_ms: int) -> None:
    server, bound, index = await create_server(host, port, node_ttl_ms=node_ttl_ms)
    task = asyncio.create_task(_maintenance(index, 0.2))
    announce_ready({"role": "master", "address": f"{host}:{bound}", "port": bound})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    task.cancel()
    await server.stop(1.0)
    log.info("master stopped")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvstore master", description="Run a master shard.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--node-ttl-ms", type=int, default=3000)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    asyncio.run(serve(args.host, args.port, args.node_ttl_ms))


if __name__ == "__main__":
    main()
