"""kvstore's RESP front (``kvstore resp``) beside a redis-server, both driven by Redis tools.

Rows (``--resp``): for each size, ``redis-benchmark -t set,get -d SIZE -P 16``
(50 connections) against a redis-server and against the front (path
``redis-benchmark``, sizes up to 1 MiB: at 4 MiB 800 values in flight are
3.2 GB), the same with ``-r 1000`` (path ``redis-benchmark-r1000``): without
``-r`` every command names one key, and the front reads a key repeated in a
pipelined run of GETs once, so the ``-r`` rows show the cost of distinct
reads; and redis-py SET / GET against the front and the redis-server (path
``redis-py``: the ``redis`` peer's measurement, with the two servers' rounds
taking turns, so ``vs redis`` compares one state of the machine).
The front runs over its own master and store node, started here like the
``kvstore`` peer's; the redis-server is started the same way as the
``redis`` peer's (free loopback port, no persistence). The redis-py rows
meter CPU (the front, its node and master, this process); the
redis-benchmark rows do not (one run holds both SET and GET). Needs redis-server,
redis-benchmark and redis-py; else skipped with a note.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess

from kvstore.sizes import format_size
from kvstore.tools.bench.cpu import CpuMeter
from kvstore.tools.bench.harness import (BenchConfig, DataPath, MiB, Op, Peer, Row, System,
                                         rate_row)
from kvstore.tools.bench.redis_peer import RedisPeer, redis_py_rows

#: redis-benchmark requests per measurement at 64 KiB (fewer for larger values).
_REQUESTS_64K = 20_000
_MAX_BENCHMARK_BYTES = MiB
#: Keys of the ``-r`` runs (at 1 MiB, 1 GiB of values in the node).
_DISTINCT_KEYS = 1000


class RespPeer(Peer):
    """A store (master and node), a RESP front over it, and a redis-server."""

    def __init__(self, cfg: BenchConfig, log_dir: str, redis_server: str, benchmark: str):
        import redis

        from kvstore.tools.cluster.launcher import start_store_cluster
        from kvstore.tools.cluster.processes import service_args

        self.cfg, self.benchmark = cfg, benchmark
        self.store = start_store_cluster(1, 1, dram=cfg.node_dram, log_dir=f"{log_dir}/resp",
                                         eviction_policy="none")
        self.redis = None
        try:
            front = self.store.procs.start("resp-front",
                                           service_args("resp", "--master", self.store.master))
            self.port = front.info["port"]
            (node,) = self.store.nodes.values()
            self.cpu = CpuMeter({"front": front.proc.pid, "node": node.proc.pid,
                                 "master": self.store.shards[0][0].proc.pid,
                                 "client": os.getpid()})
            self.client = redis.Redis(port=self.port)
            self.redis = RedisPeer(redis_server, cfg)
        except BaseException:
            self.stop()
            raise

    def bench(self, size_bytes: int) -> list[Row]:
        rows = []
        if size_bytes <= _MAX_BENCHMARK_BYTES:
            for path in (DataPath.REDIS_BENCHMARK, DataPath.REDIS_BENCHMARK_KEYS):
                for system, port in ((System.REDIS, self.redis.port),
                                     (System.KVSTORE_RESP, self.port)):
                    rows += self._redis_benchmark(system, port, size_bytes, path)
        return rows + redis_py_rows([(System.REDIS, self.redis.client, self.redis.cpu()),
                                     (System.KVSTORE_RESP, self.client, self.cpu)],
                                    DataPath.REDIS_PY, self.cfg, size_bytes)

    def _redis_benchmark(self, system: System, port: int, size: int, path: DataPath
                         ) -> list[Row]:
        """SET then GET rows of one redis-benchmark run (its own keys; FLUSHALL first)."""
        import redis

        keys = ["-r", str(_DISTINCT_KEYS)] if path is DataPath.REDIS_BENCHMARK_KEYS else []
        self.cfg.progress(f"redis-benchmark {' '.join(keys)} {system} {format_size(size)}")
        with redis.Redis(port=port) as r:
            r.flushall()                  # its key held another size's value (immutable here)
        n = max(1000, min(_REQUESTS_64K, _REQUESTS_64K * 64 * 1024 // size))
        out = subprocess.run([self.benchmark, "-p", str(port), "-t", "set,get", "-n", str(n),
                              "-d", str(size), "-P", "16", "--csv", *keys],
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"redis-benchmark against {system} failed: {out.stderr[-300:]}")
        rates = {line[0]: float(line[1]) for line in csv.reader(io.StringIO(out.stdout))
                 if len(line) > 1 and line[0] in ("SET", "GET")}
        if set(rates) != {"SET", "GET"}:
            raise RuntimeError(f"redis-benchmark against {system}: no rates in its output")
        return [rate_row(system, path, op, size, rates[name], 1.0)
                for name, op in (("SET", Op.PUT), ("GET", Op.GET))]

    def stop(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()
        if self.redis is not None:
            self.redis.stop()
        self.store.stop()


def start(cfg: BenchConfig, log_dir: str) -> RespPeer | None:
    """The RESP peer with ``--resp``, or None (with a note) when a tool is missing."""
    if not cfg.use_resp:
        return None
    server, benchmark = shutil.which("redis-server"), shutil.which("redis-benchmark")
    try:
        import redis  # noqa: F401
    except ImportError:
        cfg.note("kvstore-resp: skipped (no redis module: pip install -e '.[bench]')")
        return None
    if server is None or benchmark is None:
        cfg.note("kvstore-resp: skipped (needs redis-server and redis-benchmark: "
                 "apt-get install redis-server redis-tools)")
        return None
    return RespPeer(cfg, log_dir, server, benchmark)
