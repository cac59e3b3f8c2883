"""The services' command lines: ``kvstore NAME [options]`` and what launchers spawn.

    python -m kvstore.tools.cli.services master    [options]   a master shard
    python -m kvstore.tools.cli.services node      [options]   a store node
    python -m kvstore.tools.cli.services prefill   [options]   a prefill engine
    python -m kvstore.tools.cli.services decode    [options]   a decode engine
    python -m kvstore.tools.cli.services conductor [options]   the conductor (+ HTTP front)
    python -m kvstore.tools.cli.services http      [options]   the HTTP front alone
    python -m kvstore.tools.cli.services resp      [options]   the Redis protocol front

Each parses its options into its component's config dataclass
(:class:`~kvstore.master.server.MasterConfig`, ...), sets up logging and
runs the component's ``serve``; the components never read a command line.
Heavy modules (torch for the engines) are imported only by the service that
needs them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Callable

from kvstore.process import exit_with_launcher, setup_logging
from kvstore.errors import InvalidArgument
from kvstore.master.limits import MASTER_BYTES_PER_OBJECT
from kvstore.store.limits import NODE_BYTES_PER_OBJECT
from kvstore.master.event_feed import DEFAULT_CAPACITY as EVENT_LOG_DEFAULT
from kvstore.rpc import MAX_REPLICAS, check_replica_num
from kvstore.sizes import parse_size
from kvstore.tools.cli.service_options import (check_common, checked, client_creds, port_number,
                                               require, secured, service_parser)


def _check_shard(cfg) -> None:
    """What a master's ``serve`` refuses about ``--shard-id`` and ``--port``, for
    ``--check-config`` (it would otherwise say "configuration ok" to both).

    Raises:
        ValueError: the shard map does not name the shard, or names several
            masters for it and no ``--port`` says which one this process is.
    """
    if cfg.shard_map is None:
        return
    mine = [r for r in cfg.shard_map.ranges if r.shard_id == cfg.shard_id]
    if not mine:
        raise ValueError(f"shard {cfg.shard_id} is not in the shard map")
    if not cfg.port and len(mine[0].addresses) > 1:
        raise ValueError("the shard has several addresses; pick one with --port")


def master_main(argv: list[str]) -> None:
    from kvstore.master.server import MasterConfig, serve
    from kvstore.shardmap import ShardMap

    p = service_parser("master", "Run a master shard.", client=False)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=port_number, default=0, help="0 picks a free port")
    p.add_argument("--report-port", type=port_number, default=0,
                   help="the socket port (store nodes' STORED reports; clients' Lookup, Exists "
                        "and grants); 0 picks a free one, announced to nodes and clients")
    p.add_argument("--node-ttl-ms", type=int, default=3000,
                   help="a node without a heartbeat this long is dead (no reads or puts go there)")
    p.add_argument("--node-forget-ms", type=int, default=600_000,
                   help="a node without a heartbeat this long is removed, with its replicas "
                        "(an object on no other node is forgotten; the node re-announces "
                        "what it kept if it returns)")
    p.add_argument("--shard-id", type=int, default=0, help="this master's shard in --shard-map")
    p.add_argument("--shard-map", default="",
                   help='static shard map: "addr0,addr1,..." (slots split evenly) or a JSON '
                        "file; the port defaults to this shard's address in it")
    p.add_argument("--etcd", default="",
                   help="etcd URL (http://host:port): elect this shard's leader through a lease; "
                        "list the shard's masters as addr|addr in --shard-map")
    p.add_argument("--cluster-name", default="default", help="etcd key name space")
    p.add_argument("--lease-ttl-s", type=int, default=3, help="leader lease ttl")
    p.add_argument("--max-objects", type=int, default=0,
                   help="objects indexed at most; a new key beyond is NO_SPACE (0: half the "
                        f"memory at about {MASTER_BYTES_PER_OBJECT} B each; see docs/operations.md, "
                        "Scale and limits)")
    p.add_argument("--state-dir", default="",
                   help="keep the shard's roster of nodes here (with --etcd: in etcd): a "
                        "restart serves once they are back, a fresh cluster at once")
    p.add_argument("--event-log", type=int, default=EVENT_LOG_DEFAULT,
                   help="events (key stored / evicted / removed) the shard keeps for "
                        "WatchEvents and `kvctl events` to replay; about 300 B each with "
                        "32-character keys")
    a = p.parse_args(argv)
    setup_logging(a.log_level)
    require(a.event_log >= 1, f"--event-log must be >= 1, got {a.event_log}")
    require(not a.etcd or a.etcd.startswith(("http://", "https://")),
             f"--etcd {a.etcd!r}: give a URL, http://HOST:PORT")
    require(a.max_objects >= 0, f"--max-objects must be >= 0, got {a.max_objects}")
    require(a.node_ttl_ms >= 100, f"--node-ttl-ms must be >= 100, got {a.node_ttl_ms}")
    require(a.node_forget_ms >= a.node_ttl_ms,
             f"--node-forget-ms {a.node_forget_ms} must be >= --node-ttl-ms {a.node_ttl_ms}")
    require(a.lease_ttl_s >= 1, f"--lease-ttl-s must be >= 1, got {a.lease_ttl_s}")
    require(a.shard_id >= 0 and (a.shard_map or a.shard_id == 0),
             f"--shard-id {a.shard_id}: a shard of --shard-map (0 without one)")
    cfg = MasterConfig(
        host=a.host, port=a.port, report_port=a.report_port,
        node_ttl_ms=a.node_ttl_ms, node_forget_ms=a.node_forget_ms,
        shard_id=a.shard_id,
        shard_map=ShardMap.parse(a.shard_map) if a.shard_map else None, etcd=a.etcd,
        cluster_name=a.cluster_name, lease_ttl_s=a.lease_ttl_s, state_dir=a.state_dir,
        max_objects=a.max_objects, event_log=a.event_log,
        **secured(a))
    if a.check_config:
        _check_shard(cfg)
    if not checked("master", a, cfg):
        asyncio.run(serve(cfg))


def node_main(argv: list[str]) -> None:
    from kvstore.store.server import NodeConfig, run_node

    d = NodeConfig(masters=())
    p = service_parser("node", "Run a store node.")
    p.add_argument("--master", required=True,
                   help="master address host:port, or a shard's masters as a|b (any shard: "
                        "the node learns the shard map from it and registers with every shard)")
    p.add_argument("--host", default=d.host, help="bind address (default loopback)")
    p.add_argument("--port", type=port_number, default=d.port, help="data port; 0 picks a free port")
    p.add_argument("--node-id", default="",
                   help="stable node id (default: the one recorded on --ssd-path, else random)")
    p.add_argument("--dram", default="256MiB", help="DRAM tier capacity, e.g. 512MiB, 4GiB")
    p.add_argument("--no-prefault", dest="prefault", action="store_false",
                   help="take the DRAM tier's pages at their first write instead of at start "
                        "(a put into a fresh page pays its page fault)")
    p.add_argument("--gpu", default="", help="GPU tier capacity (needs CUDA); default none")
    p.add_argument("--gpu-device", default=d.gpu_device, help="torch device of the GPU tier")
    p.add_argument("--ssd", default="", help="SSD tier capacity, e.g. 256MiB; default none")
    p.add_argument("--ssd-path", default="", help="directory of the SSD tier's lmdb environment")
    p.add_argument("--ssd-map-size", default="", help="lmdb map size (default 3 x --ssd + 64MiB)")
    p.add_argument("--ssd-quarantine", action="store_true",
                   help="a corrupt --ssd-path is moved to PATH.quarantine-<time> and its intact "
                        "objects copied into a fresh PATH (else the node refuses to start)")
    p.add_argument("--eviction-policy", default=d.eviction_policy,
                   help="lru, lfu, default or none")
    p.add_argument("--high-watermark", type=float, default=d.high_watermark,
                   help="DRAM/GPU: evict when use passes this fraction of capacity")
    p.add_argument("--low-watermark", type=float, default=d.low_watermark,
                   help="... down to this fraction")
    p.add_argument("--ssd-high-watermark", type=float, default=d.ssd_high_watermark,
                   help="SSD: evict when use passes this fraction of capacity")
    p.add_argument("--ssd-low-watermark", type=float, default=d.ssd_low_watermark,
                   help="... down to this fraction")
    p.add_argument("--rdma-device", default="",
                   help="serve one-sided RDMA on this device (e.g. mlx5_0, rxe0; needs pyverbs)")
    p.add_argument("--rdma-port", type=int, default=d.rdma_port, help="port of --rdma-device")
    p.add_argument("--write-timeout-s", type=float, default=d.write_timeout_s,
                   help="a writer that sends no byte of its value (or leaves a shared-memory "
                        "reservation uncommitted) this long loses its connection and the space")
    p.add_argument("--send-timeout-s", type=float, default=None,
                   help="a reader taking no byte of its replies (or whose host is gone: TCP "
                        "keepalive) this long loses its connection (default --write-timeout-s)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="data connections open at once; more are refused with UNAVAILABLE "
                        "(default: the fd limit less 128)")
    p.add_argument("--rdma-gid-index", type=int, default=None,
                   help="GID index (default: the port's first non-zero GID)")
    p.add_argument("--max-objects", type=int, default=0,
                   help="objects held at most (every tier): one more evicts the coldest where "
                        "a policy evicts, else is NO_SPACE (0: half the memory beside --dram at "
                        f"about {NODE_BYTES_PER_OBJECT} B each; see docs/operations.md, Scale and limits)")
    p.add_argument("--busy-poll-us", type=int, default=None,
                   help="busy-poll this long for a client's next request after answering, and "
                        "for the master's answer to a write (default 200 and 250; 0: never: "
                        "the least CPU, each request then pays a wake-up; see "
                        "docs/data-plane.md, Busy-polling)")
    a = p.parse_args(argv)
    setup_logging(a.log_level)
    _check_node(a)
    cfg = NodeConfig(
        masters=tuple(a.master.split("|")), host=a.host, port=a.port, node_id=a.node_id,
        dram_bytes=parse_size(a.dram), prefault=a.prefault,
        gpu_bytes=parse_size(a.gpu) if a.gpu else 0,
        gpu_device=a.gpu_device, ssd_bytes=parse_size(a.ssd) if a.ssd else 0,
        ssd_path=a.ssd_path,
        ssd_map_size_bytes=parse_size(a.ssd_map_size) if a.ssd_map_size else None,
        ssd_quarantine=a.ssd_quarantine,
        eviction_policy=a.eviction_policy, high_watermark=a.high_watermark,
        low_watermark=a.low_watermark, ssd_high_watermark=a.ssd_high_watermark,
        ssd_low_watermark=a.ssd_low_watermark, rdma_device=a.rdma_device,
        rdma_port=a.rdma_port, rdma_gid_index=a.rdma_gid_index,
        write_timeout_s=a.write_timeout_s, send_timeout_s=a.send_timeout_s,
        max_connections=a.max_connections, max_objects=a.max_objects, creds=client_creds(a),
        busy_poll_us=a.busy_poll_us, **secured(a))
    if not checked("node", a, cfg):
        run_node(cfg)


def check_dram(dram: str, nodes: int = 1) -> None:
    """A node's --dram (``kvstore up``'s for all its ``nodes`` at once): a size above
    0 B that the free shared memory holds.

    Raises:
        ValueError: one line (exit 2).
    """
    try:
        size = parse_size(dram)
    except ValueError as exc:
        raise ValueError(f"--dram: {exc}") from None
    require(size > 0, "--dram must be larger than 0 B")
    from kvstore.store.tiers.dram import shm_free_bytes
    room = shm_free_bytes()
    for_nodes = f" for {nodes} nodes" if nodes > 1 else ""
    require(room is None or size * nodes <= room,
             f"--dram {dram}{for_nodes}: shared memory has {room} B free (the DRAM tier "
             f"lives there)")


def _check_node(a: argparse.Namespace) -> None:
    from kvstore.store.eviction import make_policy

    try:
        make_policy(a.eviction_policy)
    except (KeyError, ValueError):
        raise ValueError(f"--eviction-policy {a.eviction_policy!r}: not a policy "
                         f"(default, lru, lfu, none)") from None
    check_dram(a.dram)
    for lo, hi, name in ((a.low_watermark, a.high_watermark, ""),
                         (a.ssd_low_watermark, a.ssd_high_watermark, "ssd-")):
        require(0 < lo <= hi <= 1, f"--{name}low-watermark {lo} and --{name}high-watermark "
                                    f"{hi}: need 0 < low <= high <= 1")
    require(bool(a.ssd) == bool(a.ssd_path), "--ssd SIZE and --ssd-path DIR go together")
    require(a.write_timeout_s > 0, "--write-timeout-s must be > 0")
    require(a.send_timeout_s is None or a.send_timeout_s > 0, "--send-timeout-s must be > 0")
    require(a.max_connections is None or a.max_connections >= 1, "--max-connections must be >= 1")
    require(a.max_objects >= 0, f"--max-objects must be >= 0, got {a.max_objects}")
    require(a.busy_poll_us is None or 0 <= a.busy_poll_us <= 1_000_000,
            f"--busy-poll-us must be within 0 to 1000000, got {a.busy_poll_us}")


def _engine_parser(name: str, description: str) -> argparse.ArgumentParser:
    p = service_parser(name, description)
    p.add_argument("--master", required=True, help="kvstore master address host:port")
    p.add_argument("--model", default="tiny", help="'tiny' (seeded random) or a HF style folder")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block / page")
    p.add_argument("--kv-pages", type=int, default=4096, help="pages in the engine's KV cache")
    p.add_argument("--instance-id", default="", help="name in logs and metrics")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=0)
    return p


def _engine_config(a: argparse.Namespace, save_mode: str = ""):
    from kvstore.engines.server_common import EngineConfig

    require(a.threads >= 1, f"--threads must be >= 1, got {a.threads}")
    require(a.model == "tiny" or os.path.isdir(a.model),
             f"--model {a.model!r}: neither 'tiny' nor a model folder")
    require(a.block_tokens >= 1 and a.kv_pages >= 1, "--block-tokens and --kv-pages must be >= 1")
    return EngineConfig(master=a.master, model=a.model, block_tokens=a.block_tokens,
                        kv_pages=a.kv_pages, instance_id=a.instance_id, threads=a.threads,
                        host=a.host, port=a.port, save_mode=save_mode, creds=client_creds(a),
                        **secured(a))


def prefill_main(argv: list[str]) -> None:
    from kvstore.engines.kv_saver import DEFAULT_SAVE_MODE, SAVE_MODE_ENV, SAVE_MODES
    from kvstore.engines.prefill_server import serve

    p = _engine_parser("prefill", "Run a prefill engine.")
    p.add_argument("--save-mode", choices=sorted(SAVE_MODES),
                   default=os.environ.get(SAVE_MODE_ENV, DEFAULT_SAVE_MODE),
                   help="how new KV blocks reach the store: 'sync' puts them all after "
                        "prefill; 'streamed' puts them from a background thread as they are "
                        "computed, overlapping compute; 'layerwise' saves each layer as it is "
                        "computed (default: $%s or %s)" % (SAVE_MODE_ENV, DEFAULT_SAVE_MODE))
    a = p.parse_args(argv)
    setup_logging(a.log_level)
    cfg = _engine_config(a, a.save_mode)
    if not checked("prefill", a, cfg):
        asyncio.run(serve(cfg))


def decode_main(argv: list[str]) -> None:
    from kvstore.engines.decode_server import serve

    a = _engine_parser("decode", "Run a decode engine.").parse_args(argv)
    setup_logging(a.log_level)
    cfg = _engine_config(a)
    if not checked("decode", a, cfg):
        asyncio.run(serve(cfg))


_TOKENIZER_HELP = ("the HTTP front's tokenizer: a folder with tokenizer.json (and its chat "
                   "template); 'byte' for UTF-8 bytes; default: the --model folder's own, or "
                   "bytes for tiny")


def conductor_main(argv: list[str]) -> None:
    from kvstore.conductor.rejection import REJECTION_POLICIES
    from kvstore.conductor.service import ConductorConfig, Deadlines, serve

    d = Deadlines()
    p = service_parser("conductor", "Run the conductor.")
    p.add_argument("--master", required=True)
    p.add_argument("--prefill", action="append", required=True,
                   help="prefill engine as [ID=]host:port (repeatable)")
    p.add_argument("--decode", action="append", required=True,
                   help="decode engine as [ID=]host:port (repeatable)")
    p.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face style folder")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--no-cache", action="store_true", help="never read the prefix cache")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=0)
    p.add_argument("--http-port", type=port_number, default=None,
                   help="also serve the OpenAI-style HTTP front on this port (0: any free port)")
    p.add_argument("--http-host", default="127.0.0.1", help="HTTP front bind address")
    p.add_argument("--served-model-name", default="",
                   help="model name the HTTP front answers to (default: --model)")
    p.add_argument("--tokenizer", default="", help=_TOKENIZER_HELP)
    p.add_argument("--prefill-timeout-s", type=float, default=d.prefill_s)
    p.add_argument("--decode-timeout-s", type=float, default=d.decode_idle_s,
                   help="longest wait for the next decode token")
    p.add_argument("--probe-timeout-s", type=float, default=d.probe_s)
    p.add_argument("--probe-interval-s", type=float, default=d.probe_interval_s)
    p.add_argument("--cost-model", default="auto",
                   help="time estimates (FAST'25 Algorithm 1): a bundled cost model name or a "
                        "JSON file; auto (default): tiny-cpu for --model tiny, else none; "
                        "none: queued tokens, no timing")
    p.add_argument("--ttft-slo-ms", type=float, default=float("inf"),
                   help="refuse a request at arrival when its estimated TTFT is above this "
                        "(early rejection; needs a cost model to be in ms)")
    p.add_argument("--tbt-slo-ms", type=float, default=float("inf"),
                   help="choose the decode instance of least predicted TBT within this (FAST'25 "
                        "Algorithm 1), and refuse the request after its prefill when none is "
                        "(needs a cost model)")
    p.add_argument("--rejection", default="auto", choices=["auto", *sorted(REJECTION_POLICIES)],
                   help="early rejection at arrival (none, early, predictive); auto (default): "
                        "early when an SLO is set, else none")
    p.add_argument("--decision-log", default="",
                   help="write each scheduling decision and the state it was made from to this "
                        "file, one JSON object per line (kvstore.tools.sim.parity replays it)")
    a = p.parse_args(argv)
    setup_logging(a.log_level)
    cfg = ConductorConfig(
        master=a.master, prefill=tuple(a.prefill), decode=tuple(a.decode), model=a.model,
        tokenizer=a.tokenizer,
        block_tokens=a.block_tokens, use_cache=not a.no_cache, host=a.host, port=a.port,
        http_port=a.http_port, http_host=a.http_host, served_model_name=a.served_model_name,
        deadlines=Deadlines(prefill_s=a.prefill_timeout_s, decode_idle_s=a.decode_timeout_s,
                            probe_s=a.probe_timeout_s, probe_interval_s=a.probe_interval_s),
        cost_model=a.cost_model, ttft_slo_ms=a.ttft_slo_ms, tbt_slo_ms=a.tbt_slo_ms,
        rejection=a.rejection, decision_log=a.decision_log, creds=client_creds(a), **secured(a))
    if not checked("conductor", a, cfg):
        asyncio.run(serve(cfg))


def http_main(argv: list[str]) -> None:
    from kvstore.conductor.http import FrontConfig, serve_front

    p = service_parser("http", "OpenAI-compatible HTTP front of a conductor.", observed=False)
    p.add_argument("--conductor", required=True, help="conductor gRPC address host:port")
    p.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face style folder")
    p.add_argument("--served-model-name", default="", help="model id clients use (default: --model)")
    p.add_argument("--tokenizer", default="", help=_TOKENIZER_HELP)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=0)
    a = p.parse_args(argv)
    setup_logging(a.log_level)
    fields = secured(a)
    for unused in ("advertise_host", "metrics", "drain_s"):
        fields.pop(unused)
    cfg = FrontConfig(conductor=a.conductor, model=a.model, tokenizer=a.tokenizer,
                      served_model_name=a.served_model_name, host=a.host, port=a.port,
                      creds=client_creds(a), **fields)
    if not checked("http", a, cfg):
        asyncio.run(serve_front(cfg))


def resp_main(argv: list[str]) -> None:
    from kvstore.auth import TokenFile
    from kvstore.binding import check_binding
    from kvstore.client import KVClient
    from kvstore.client.integrations.resp.protocol import MAX_BULK_BYTES, MIN_BULK_BYTES, Limits
    from kvstore.client.integrations.resp.server import (DEFAULT_MAX_CLIENTS, MAX_CLIENTS,
                                                         FrontConfig, serve)

    p = service_parser("resp", "Redis protocol (RESP2/RESP3) front of the store: redis-cli, "
                        "redis-py, redis-benchmark and LMCache's redis:// connector.",
                observed=False, one_line=True)
    p.add_argument("--master", required=True, help="master address host:port (or a|b)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    p.add_argument("--port", type=port_number, default=0, help="0 picks a free port")
    p.add_argument("--max-clients", type=int, default=DEFAULT_MAX_CLIENTS,
                   help=f"connections open at once, 1 to {MAX_CLIENTS} (default "
                        f"{DEFAULT_MAX_CLIENTS}); more are answered an error and closed")
    bulk_range = f"{MIN_BULK_BYTES >> 10}KiB to {MAX_BULK_BYTES >> 20}MiB"
    p.add_argument("--max-bulk", default=f"{MAX_BULK_BYTES >> 20}MiB",
                   help=f"longest value or argument a client may send, {bulk_range} "
                        "(default 512MiB: Redis' proto-max-bulk-len and largest string)")
    p.add_argument("--replica-num", type=int, default=1,
                   help=f"replicas per SET, 1 to {MAX_REPLICAS}")
    a = p.parse_args(argv)
    setup_logging(a.log_level)
    check_common(a)
    require(1 <= a.max_clients <= MAX_CLIENTS,
             f"--max-clients must be 1 to {MAX_CLIENTS}, got {a.max_clients}")
    try:
        check_replica_num(a.replica_num, what="--replica-num")
    except InvalidArgument as exc:
        raise ValueError(exc.message) from None
    require(not (a.tls_cert or a.tls_key or a.tls_ca),
             "the RESP front serves plaintext only (TLS: put a TLS proxy in front)")
    try:
        max_bulk = parse_size(a.max_bulk)
    except ValueError as exc:
        raise ValueError(f"--max-bulk: {exc}") from None
    require(MIN_BULK_BYTES <= max_bulk <= MAX_BULK_BYTES,
             f"--max-bulk must be {bulk_range} (Redis' largest string), got {a.max_bulk}")
    if a.auth:
        TokenFile(a.auth)                  # a bad file: one line, exit 2
    check_binding("resp", a.host, bool(a.auth), insecure=a.insecure)   # warns with --insecure
    cfg = FrontConfig(master=a.master, host=a.host, port=a.port, auth=a.auth,
                      max_clients=a.max_clients,
                      limits=Limits(max_bulk_bytes=max_bulk))
    if a.check_config:
        print("kvstore resp: configuration ok")
        return
    creds = client_creds(a)
    with KVClient(a.master, replica_num=a.replica_num, token=creds.token,
                  tls=creds.tls) as kv:
        serve(cfg, kv)


#: Service name -> its entry point, which takes the service's own arguments.
SERVICES: dict[str, Callable[[list[str]], None]] = {
    "master": master_main,
    "node": node_main,
    "prefill": prefill_main,
    "decode": decode_main,
    "conductor": conductor_main,
    "http": http_main,
    "resp": resp_main,
}


def run(name: str, argv: list[str]) -> int:
    """Run service ``name`` with its arguments; returns the exit status.

    Bad input (a size that is not one, a busy port, an unreachable master)
    ends in one line on stderr and status 2 (1 for a failed RPC), not a
    traceback.
    """
    import grpc

    from kvstore.errors import KVStoreError

    try:
        SERVICES[name](argv)
    except grpc.RpcError as exc:     # e.g. the master cannot be reached
        print(f"kvstore {name}: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (ValueError, KeyError, OSError, KVStoreError) as exc:   # bad input, busy port...
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"kvstore {name}: error: {msg}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> None:
    """``python -m kvstore.tools.cli.services NAME [options]``."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SERVICES:
        sys.exit(f"usage: python -m kvstore.tools.cli.services {{{','.join(SERVICES)}}} [options]")
    exit_with_launcher()
    sys.exit(run(argv[0], argv[1:]))

if __name__ == "__main__":
    main()
