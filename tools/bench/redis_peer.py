"""Redis as a peer of ``kvstore bench``: redis-py GET / SET against a redis-server started here.

Rows (``redis``, path ``tcp``): ``put`` (SET of a key per pool slot, in
rotation) and ``get`` (GET of those keys, each checked for its size). The
server runs on a free loopback port without persistence; values come from a
cold pool of ``pool_bytes``. CPU is metered for ``redis-server`` and this
process (``client``: redis-py). Measured when ``redis-server`` and redis-py
(``pip install -e '.[bench]'``) are installed, else skipped with a note.

The module is ``redis_peer``, not ``redis``, so that ``import redis`` is the
client library.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

from kvstore.sizes import format_size
from kvstore.tools.bench.cpu import CpuMeter
from kvstore.tools.bench.harness import (BenchConfig, DataPath, MiB, Op, Peer, Pool, Row, System,
                                         timed_row)
from kvstore.tools.cluster.processes import free_port, stop_with_launcher, terminate


class RedisPeer(Peer):
    """A redis-server on a free loopback port (no persistence), stopped by :meth:`stop`."""

    def __init__(self, exe: str, cfg: BenchConfig):
        import redis

        self.cfg = cfg
        self.port = free_port()
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=stop_with_launcher)
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)

    def cpu(self) -> CpuMeter:
        """The server's and this process's CPU (``redis-server``, ``client``)."""
        return CpuMeter({"redis-server": self.proc.pid, "client": os.getpid()})

    def bench(self, size_bytes: int) -> list[Row]:
        return redis_py_rows([(System.REDIS, self.client, self.cpu())], DataPath.TCP, self.cfg,
                             size_bytes)

    def stop(self) -> None:
        self.client.close()
        terminate(self.proc)


def redis_py_rows(clients: list[tuple[System, object, CpuMeter]], path: DataPath,
                  cfg: BenchConfig, size: int) -> list[Row]:
    """``put`` (SET of a key per pool slot, in rotation) and ``get`` (GET of those keys,
    each checked for its size) rows through each ``(system, redis-py client, its
    processes' CPU meter)``, then
    FLUSHALL. With several clients their rounds take turns
    (:meth:`~kvstore.tools.bench.harness.BenchConfig.timed_together`), so each
    ratio between them compares one state of the machine: one after the other,
    the redis-py GET 1 MiB rate of one server swung 0.4-2.4x of the other's
    between runs of the same build here, interleaved 0.58-0.90x."""
    src = Pool(size, cfg.pool_bytes, seed=1)
    keys = [f"bench:{size}:{j}" for j in range(src.num_slots)]
    names = ", ".join(str(system) for system, _, _ in clients)
    cpus = [cpu for _, _, cpu in clients]
    cfg.progress(f"{names} SET {format_size(size)}")
    puts = cfg.timed_together([lambda i, r=r: r.set(keys[i % len(keys)], src.views[i % len(keys)])
                               for _, r, _ in clients], cpus)
    cfg.progress(f"{names} GET {format_size(size)}")
    for (_, r, _), t in zip(clients, puts):
        for j in range(t.total, len(keys)):   # the SET budget may not have reached every key
            r.set(keys[j], src.views[j])

    def get(r, system: System, i: int) -> None:
        if len(r.get(keys[i % len(keys)])) != size:
            raise RuntimeError(f"{system} returned a value of the wrong size")
    _settle_allocator(size)
    gets = cfg.timed_together([lambda i, r=r, s=system: get(r, s, i)
                               for system, r, _ in clients], cpus)
    rows = []
    for (system, r, _), t_put, t_get in zip(clients, puts, gets):
        rows += [timed_row(system, path, Op.PUT, size, t_put),
                 timed_row(system, path, Op.GET, size, t_get)]
        r.flushall()
    return rows


def _settle_allocator(size: int) -> None:
    """Put glibc malloc in the state a long-running process reaches, before Redis GETs.

    redis-py builds every value in growing buffers and returns a new ``bytes``.
    Until a large block has been freed, glibc serves such blocks with fresh
    mmaps (a page fault per 4 KiB, every call), and 1 MiB GETs run 2-5x slower
    than once its dynamic mmap threshold has risen (measured here: 0.4-0.9 vs
    2.2 GB/s). Which state the benchmark's process happened to be in made the
    Redis row swing between runs; freeing one large block first measures the
    peer in its steady, faster state every time.
    """
    block = bytearray(min(16 * MiB, 8 * size))   # <= glibc's 32 MiB cap on the threshold
    del block


def start(cfg: BenchConfig, log_dir: str) -> RedisPeer | None:
    """The Redis peer, or None (with a note) when it is off, not installed or will not start."""
    exe = shutil.which("redis-server")
    if not cfg.use_redis:
        return None
    if exe is None:
        cfg.note("redis: skipped (no redis-server binary; apt-get install redis-server)")
        return None
    try:
        import redis
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        cfg.note("redis: skipped (no redis module: pip install -e '.[bench]')")
        return None
    try:
        peer = RedisPeer(exe, cfg)
    except RuntimeError as exc:
        cfg.note(f"redis: skipped ({exc})")
        return None
    cfg.note(f"redis: redis-py {redis.__version__}, "
             f"{'hiredis' if HIREDIS_AVAILABLE else 'pure-Python'} parser")
    return peer
