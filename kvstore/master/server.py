"""Master shard process: ``kvstore master`` / ``python -m kvstore.master.server``.

    kvstore master                                     one shard owning every slot
    kvstore master --shard-id 1 --shard-map a,b        shard 1 of a static map (slots split evenly)
    kvstore master --shard-id 0 --shard-map "a|a2,b|b2" --port P --etcd URL
                                                       leader or standby of shard 0 (etcd lease)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os

import grpc

from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.master.index import ObjectIndex
from kvstore.master.membership import Membership
from kvstore.master.servicer import MasterServicer, now_ms
from kvstore.process import announce_ready, setup_logging, wait_for_stop_signal
from kvstore.shardmap import ShardMap, ShardRange

log = logging.getLogger(__name__)

GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                # gRPC sets SO_REUSEPORT by default: a second server on a busy port
                # would start "fine" and split the clients between two processes.
                ("grpc.so_reuseport", 0)]


async def create_server(host: str = "127.0.0.1", port: int = 0, *,
                        node_ttl_ms: int = 3000, heartbeat_interval_ms: int = 500,
                        put_timeout_ms: int = 30_000, shard_map: ShardMap | None = None,
                        shard_id: int = 0, election=None) -> tuple[grpc.aio.Server, int, ObjectIndex]:
    """Build and start a master shard on ``host:port`` (0 = a free port).

    Without ``shard_map`` it is the only shard (every slot); with one, it
    owns the slots of range ``shard_id`` and answers WRONG_SHARD for the rest.

    Returns:
        ``(server, port, index)``; stop with ``await server.stop(grace)``.
    """
    server = grpc.aio.server(options=GRPC_OPTIONS)
    bound = server.add_insecure_port(f"{host}:{port}")
    membership = Membership(node_ttl_ms=node_ttl_ms, heartbeat_interval_ms=heartbeat_interval_ms)
    if shard_map is None:
        shard_map = ShardMap.single(f"{host}:{bound}")
    index = ObjectIndex(membership, shard_map, shard_id=shard_id, put_timeout_ms=put_timeout_ms)

    def new_index() -> ObjectIndex:
        return ObjectIndex(Membership(node_ttl_ms=node_ttl_ms,
                                      heartbeat_interval_ms=heartbeat_interval_ms),
                           shard_map, shard_id=shard_id, put_timeout_ms=put_timeout_ms)
    servicer = MasterServicer(index, election=election, new_index=new_index)
    pb_grpc.add_MasterServicer_to_server(servicer, server)
    server.servicer = servicer      # for the maintenance loop and tests
    await server.start()
    return server, bound, index


async def _maintenance(servicer: MasterServicer, period_s: float) -> None:
    while True:
        await asyncio.sleep(period_s)
        if not servicer.leading():
            continue
        index = servicer.index
        now = now_ms()
        index.membership.expire(now)
        index.expire_puts(now)
        if now - servicer._term_start_ms > servicer.warmup_ms:
            index.plan_repairs(now)


def parse_shard_map(spec: str) -> ShardMap:
    """``"addr0,addr1,..."`` (slots split evenly) or the path of a JSON file:
    ``{"version": 1, "masters": ["addr0", ...]}`` or ``{"version": 1, "ranges":
    [{"first_slot": 0, "last_slot": 8191, "address": "...", "shard_id": 0}, ...]}``."""
    if os.path.isfile(spec):
        with open(spec) as f:
            doc = json.load(f)
        version = int(doc.get("version", 1))
        if "masters" in doc:
            return ShardMap.even(list(doc["masters"]), version)
        return ShardMap(version, tuple(ShardRange(int(r["first_slot"]), int(r["last_slot"]),
                                                  r["address"], int(r["shard_id"]))
                                       for r in doc["ranges"]))
    return ShardMap.even([a.strip() for a in spec.split(",") if a.strip()])


async def serve(host: str, port: int, node_ttl_ms: int, shard_map: ShardMap | None = None,
                shard_id: int = 0, etcd: str = "", cluster: str = "default",
                lease_ttl_s: int = 3) -> None:
    if shard_map is not None:
        mine = next((r for r in shard_map.ranges if r.shard_id == shard_id), None)
        if mine is None:
            raise SystemExit(f"kvstore master: shard {shard_id} is not in the shard map")
        if not port:
            addrs = mine.address.split("|")
            if len(addrs) > 1:
                raise SystemExit("kvstore master: the shard has several addresses; pick one "
                                 "with --port")
            port = int(addrs[0].rsplit(":", 1)[1])
    election = None
    if etcd:
        from kvstore.master.election import Election
        election = Election(etcd, cluster, shard_id, f"{host}:{port}", ttl_s=lease_ttl_s)
    server, bound, index = await create_server(host, port, node_ttl_ms=node_ttl_ms,
                                               shard_map=shard_map, shard_id=shard_id,
                                               election=election)
    if election is not None:
        election.address = f"{host}:{bound}"
        election.start()
    task = asyncio.create_task(_maintenance(server.servicer, 0.2))
    announce_ready({"role": "master", "address": f"{host}:{bound}", "port": bound,
                    "shard_id": shard_id})
    await wait_for_stop_signal()
    task.cancel()
    if election is not None:
        election.stop()
    await server.stop(1.0)
    log.info("master stopped")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvstore master", description="Run a master shard.")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--node-ttl-ms", type=int, default=3000)
    p.add_argument("--shard-id", type=int, default=0, help="this master's shard in --shard-map")
    p.add_argument("--shard-map", default="",
                   help='static shard map: "addr0,addr1,..." (slots split evenly) or a JSON '
                        "file; the port defaults to this shard's address in it")
    p.add_argument("--etcd", default="",
                   help="etcd URL (http://host:port): elect this shard's leader through a lease; "
                        "list the shard's masters as addr|addr in --shard-map")
    p.add_argument("--cluster-name", default="default", help="etcd key name space")
    p.add_argument("--lease-ttl-s", type=int, default=3, help="leader lease ttl")
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    shard_map = parse_shard_map(args.shard_map) if args.shard_map else None
    asyncio.run(serve(args.host, args.port, args.node_ttl_ms, shard_map, args.shard_id,
                      args.etcd, args.cluster_name, args.lease_ttl_s))


if __name__ == "__main__":
    main()
