"""``kvstore bench``: the data plane beside its limits and a peer, in one run.

One row per measurement (``--json`` prints them as a JSON array)::

    system    path        op         what is timed
    memcpy    cold        get        numpy copy between buffers larger than the LLC
    socket    reqresp     get, put   one small request, one value back (or in), per round trip
    socket    stream      get, put   values back to back on one connection (a second process)
    redis     tcp         get, put   redis-py GET / SET on a redis-server started here
    mooncake  tcp         get, put   Mooncake Store across processes over its TCP transport
                                     (when installed; see tools/bench/mooncake_peer.py)
    kvstore   shm         get, put   KVClient through the node's shared-memory segment
    kvstore   tcp         get, put   KVClient over TCP, one key per call
    kvstore   tcp-batch   get, put   batch_get_into / batch_put of 32 keys over TCP
    kvstore   concurrent  get, put   4 client processes at once (TCP unless --concurrent-shm)
    kvstore   tcp         exists     batch_exists of 1000 keys; ops/s counts keys, size is 0

Everything runs on this host against a cluster (master + one node) that the
benchmark starts and stops. Gets land in preallocated buffers (``get_into``).

Cold memory: every measurement rotates through source and destination pools
of at least twice the last-level cache, so no value is cached when it is
touched, as for a real KV cache: the memcpy limit, the socket peer and the
node's working set (one per size) all follow this rule.

Timing: a warm-up of ``warmup_s``, then a budget of ``duration_s`` in
``rounds`` rounds, of which the median is reported (concurrent rows: one
round, from the first client's start to the last one's end). The memcpy
limit's rounds take turns with the shm gets' rounds, so that ratio compares
the two under the same state of the machine. Puts also stop
at ``max_put_bytes`` so the node never fills; their keys are removed
afterwards. GB/s is 10^9 bytes per second.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import typer

from kvstore.tools.processes import terminate
from kvstore.sizes import format_size, parse_size
from kvstore.tools.bench.mooncake_peer import master_binary, start_mooncake
from kvstore.transfer.protocol import recv_exact_into, send_parts, tune_socket

SYSTEMS = ("memcpy", "socket", "redis", "mooncake", "kvstore")
PATHS = ("cold", "reqresp", "stream", "shm", "tcp", "tcp-batch", "concurrent")
OPS = ("put", "get", "exists")
_MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class Row:
    system: str        # one of SYSTEMS
    path: str          # one of PATHS
    op: str            # one of OPS
    size_bytes: int    # value size; 0 for exists
    gbps: float        # 10^9 bytes per second
    ops_per_s: float   # values (keys for exists) per second


@dataclass(frozen=True, slots=True)
class Target:
    """One of issue 4's targets: ``row / baseline >= ratio`` (or ``ops/s >= ratio``)."""

    name: str
    row: tuple[str, str, str]                    # (system, path, op)
    baseline: tuple[str, str, str] | None        # None: an absolute ops/s floor
    ratio: float
    sizes_bytes: tuple[int, ...]


TARGETS = (
    Target("shm get >= 0.6x cold memcpy", ("kvstore", "shm", "get"), ("memcpy", "cold", "get"),
           0.6, (_MiB, 4 * _MiB)),
    Target("tcp get >= 0.6x socket reqresp", ("kvstore", "tcp", "get"),
           ("socket", "reqresp", "get"), 0.6, (_MiB,)),
    Target("tcp-batch get >= 0.5x socket stream", ("kvstore", "tcp-batch", "get"),
           ("socket", "stream", "get"), 0.5, (64 * 1024,)),
    Target("tcp get >= 2x redis GET", ("kvstore", "tcp", "get"), ("redis", "tcp", "get"),
           2.0, (_MiB,)),
    Target("tcp get >= 1.5x mooncake get", ("kvstore", "tcp", "get"),
           ("mooncake", "tcp", "get"), 1.5, (_MiB,)),
    Target("batch_exists >= 200k keys/s", ("kvstore", "tcp", "exists"), None, 200_000, (0,)),
)

#: Ratio columns: kvstore (path) -> baseline (system, path); the memcpy row serves both ops.
_LIMIT_OF = {"shm": ("memcpy", "cold"), "tcp": ("socket", "reqresp"),
             "tcp-batch": ("socket", "stream")}


# ---- helpers ----------------------------------------------------------------------------

def llc_bytes() -> int:
    """Size of the last-level cache (32 MiB when sysfs does not say)."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    for idx in os.listdir(base) if os.path.isdir(base) else []:
        try:
            with open(os.path.join(base, idx, "size")) as f:
                best = max(best, parse_size(f.read().strip().replace("K", "KiB")))
        except (OSError, ValueError):
            pass
    return best or 32 * _MiB


class _Pool:
    """``num_slots`` equal value slots (numpy uint8 views) in one buffer of >= ``pool_bytes``."""

    def __init__(self, size_bytes: int, pool_bytes: int, min_slots: int = 2, seed: int = 0):
        self.num_slots = max(min_slots, math.ceil(pool_bytes / max(size_bytes, 1)))
        self.buf = np.frombuffer(bytearray(np.random.default_rng(seed).bytes(
            self.num_slots * size_bytes)), dtype=np.uint8)
        self.slots = [self.buf[i * size_bytes:(i + 1) * size_bytes] for i in range(self.num_slots)]
        self.views = [memoryview(s) for s in self.slots]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.slots[i % self.num_slots]


@dataclass(frozen=True, slots=True)
class Timing:
    ops: int           # iterations in the reported round
    seconds: float     # that round's wall time
    total: int         # iterations of every round and the warm-up (puts: keys written)
    t0: float          # time.perf_counter() when the first round began


def _timed(step: Callable[[int], None], duration_s: float, warmup_s: float,
           max_iters: int | None = None, before_timed: Callable[[], object] | None = None,
           rounds: int = 1) -> Timing:
    """Call ``step(i)`` untimed for ``warmup_s`` (at least once), then timed for ``duration_s``.

    The timed budget is split into ``rounds`` equal rounds and the round with
    the median rate is reported: one stall of this small, shared host does not
    move the result. ``max_iters`` caps all iterations (the warm-up takes at
    most an eighth); ``before_timed`` runs between warm-up and rounds (the
    concurrent clients' barrier).
    """
    i = 0
    cap = max_iters if max_iters is not None else 1 << 62
    end = time.perf_counter() + warmup_s
    while i < max(1, cap // 8):
        step(i)
        i += 1
        if time.perf_counter() >= end:
            break
    if before_timed is not None:
        before_timed()
    t0 = time.perf_counter()
    done: list[tuple[int, float]] = []
    for _ in range(rounds):
        n, start = 0, time.perf_counter()
        end, now = start + duration_s / rounds, start
        while i < cap:
            step(i)
            i += 1
            n += 1
            now = time.perf_counter()
            if now >= end:
                break
        if n:
            done.append((n, max(now - start, 1e-9)))
    if not done:
        raise AssertionError("max_iters left no timed iteration")
    done.sort(key=lambda r: r[0] / r[1])
    n, secs = done[len(done) // 2]
    return Timing(n, secs, i, t0)


def _timed_interleaved(steps: list[Callable[[int], None]], duration_s: float, warmup_s: float,
                       rounds: int) -> list[Timing]:
    """:func:`_timed` for several steps at once, their rounds taking turns.

    Each step gets ``duration_s`` in ``rounds`` rounds and its median round is
    reported, as with ``_timed``; because the rounds alternate, a limit and
    the path normalised by it see the same state of the machine (its
    bandwidth drifts by a third over minutes on a shared VM).
    """
    base = [0] * len(steps)
    done: list[list[Timing]] = [[] for _ in steps]
    for r in range(rounds):
        for k, step in enumerate(steps):
            t = _timed(lambda j, k=k, step=step: step(base[k] + j), duration_s / rounds,
                       warmup_s if r == 0 else 0.0)
            base[k] += t.total
            done[k].append(t)
    out = []
    for k in range(len(steps)):
        ts = sorted(done[k], key=lambda t: t.ops / t.seconds)
        med = ts[len(ts) // 2]
        out.append(Timing(med.ops, med.seconds, base[k], done[k][0].t0))
    return out


def _row(system: str, path: str, op: str, size_bytes: int, ops: float, seconds: float) -> Row:
    return Row(system, path, op, size_bytes, ops * size_bytes / seconds / 1e9, ops / seconds)


def _timed_row(system: str, path: str, op: str, size_bytes: int, t: Timing,
               values_per_iter: int = 1) -> Row:
    return _row(system, path, op, size_bytes, t.ops * values_per_iter, t.seconds)


def _short_size(size_bytes: int) -> str:
    """``64KiB``, ``4MiB``, ``1000B``: exact, for table cells."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", _MiB), ("KiB", 1024)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale}{unit}"
    return f"{size_bytes}B"


def stop_workers(workers: list[tuple[mp.Process, object]], timeout_s: float = 5.0) -> None:
    """Tell each worker process to stop (None down its pipe), wait, then terminate it."""
    for _p, pipe in workers:
        try:
            pipe.send(None)
        except OSError:
            pass
    for p, _pipe in workers:
        p.join(timeout_s)
        if p.is_alive():
            p.terminate()
            p.join()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- raw socket peer (second process) ---------------------------------------------------

#: socket limit request: op (1 = send me values, 2 = take my values), count, size_bytes.
_SOCK_REQ = struct.Struct("<BxxxIQ")
_SOCK_GET, _SOCK_PUT = 1, 2


def _socket_server(pipe, pool_bytes: int) -> None:
    """Serve raw values on loopback: no framing beyond the request, rotating cold slots."""
    srv = socket.create_server(("127.0.0.1", 0))
    pipe.send(srv.getsockname()[1])
    pools: dict[int, _Pool] = {}
    hdr = bytearray(_SOCK_REQ.size)
    ack = b"\0" * 8
    while True:
        conn, _ = srv.accept()
        tune_socket(conn)
        j = 0
        try:
            while True:
                recv_exact_into(conn, memoryview(hdr))
                op, count, size = _SOCK_REQ.unpack(hdr)
                pool = pools.get(size) or pools.setdefault(size, _Pool(size, pool_bytes))
                for _ in range(count):
                    view = pool.views[j % pool.num_slots]
                    j += 1
                    if op == _SOCK_GET:
                        conn.sendall(view)
                    else:
                        recv_exact_into(conn, view)
                if op == _SOCK_PUT:
                    conn.sendall(ack)
        except Exception:  # the client hung up (Unavailable) or went away mid-value
            conn.close()


def _bench_socket(port: int, size: int, cfg: "BenchConfig") -> list[Row]:
    src = _Pool(size, cfg.pool_bytes, seed=1)
    dst = _Pool(size, cfg.pool_bytes, seed=2)
    per_stream = max(cfg.batch_keys, (16 * _MiB) // size)
    ack = memoryview(bytearray(8))
    rows = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        tune_socket(sock)

        def get(count: int) -> Callable[[int], None]:
            req = _SOCK_REQ.pack(_SOCK_GET, count, size)

            def step(i: int) -> None:
                sock.sendall(req)
                for k in range(count):
                    recv_exact_into(sock, dst.views[(i * count + k) % dst.num_slots])
            return step

        def put(count: int) -> Callable[[int], None]:
            req = _SOCK_REQ.pack(_SOCK_PUT, count, size)

            def step(i: int) -> None:
                base = i * count
                send_parts(sock, req, src.views[base % src.num_slots])
                for k in range(1, count):
                    sock.sendall(src.views[(base + k) % src.num_slots])
                recv_exact_into(sock, ack)
            return step

        for path, count in (("reqresp", 1), ("stream", per_stream)):
            for op, make in (("get", get), ("put", put)):
                cfg.progress(f"socket {path} {op} {format_size(size)}")
                t = cfg.timed(make(count))
                rows.append(_timed_row("socket", path, op, size, t, count))
    return rows


# ---- redis peer -------------------------------------------------------------------------

class _Redis:
    """A redis-server on a free loopback port (no persistence), stopped by :meth:`stop`."""

    def __init__(self, exe: str):
        import redis

        self.port = _free_port()
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
            start_new_session=True)
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

    def bench(self, size: int, cfg: "BenchConfig") -> list[Row]:
        src = _Pool(size, cfg.pool_bytes, seed=1)
        keys = [f"bench:{size}:{j}" for j in range(src.num_slots)]
        r = self.client
        rows = []
        cfg.progress(f"redis SET {format_size(size)}")
        t = cfg.timed(lambda i: r.set(keys[i % len(keys)], src.views[i % len(keys)]))
        rows.append(_timed_row("redis", "tcp", "put", size, t))
        cfg.progress(f"redis GET {format_size(size)}")
        for j in range(t.total, len(keys)):   # the SET budget may not have reached every key
            r.set(keys[j], src.views[j])

        def get(i: int) -> None:
            if len(r.get(keys[i % len(keys)])) != size:
                raise RuntimeError("redis returned a value of the wrong size")
        _settle_allocator(size)
        rows.append(_timed_row("redis", "tcp", "get", size, cfg.timed(get)))
        r.flushall()
        return rows

    def stop(self) -> None:
        self.client.close()
        terminate(self.proc)


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
    block = bytearray(min(16 * _MiB, 8 * size))   # <= glibc's 32 MiB cap on the threshold
    del block


def _start_redis(cfg: "BenchConfig") -> _Redis | None:
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
        peer = _Redis(exe)
    except RuntimeError as exc:
        cfg.note(f"redis: skipped ({exc})")
        return None
    cfg.note(f"redis: redis-py {redis.__version__}, "
             f"{'hiredis' if HIREDIS_AVAILABLE else 'pure-Python'} parser")
    return peer


# ---- kvstore ----------------------------------------------------------------------------

def _check(results: list, what: str) -> None:
    bad = [r for r in results if isinstance(r, Exception)]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} of {len(results)} failed, first: {bad[0]!r}")


def _client_worker(master: str, prefer_shm: bool, verify: bool | None, pool_bytes: int,
                   barrier, pipe) -> None:
    """A concurrent client process: runs get or put loops on command, in step with the others.

    Commands are ``(op, size, key_prefix, num_keys, worker_index, duration_s, warmup_s,
    max_iters)``; the answer is a :class:`Timing` (``t0`` from ``time.perf_counter``, one
    clock for every process on Linux) or ``("error", text)``. None stops the worker.
    """
    from kvstore.client import KVClient

    with KVClient(master, prefer_shm=prefer_shm, verify_checksum=verify) as kv:
        pipe.send("ready")
        while (cmd := pipe.recv()) is not None:
            op, size, prefix, num_keys, w, duration_s, warmup_s, max_iters = cmd
            try:
                pool = _Pool(size, pool_bytes, seed=10 + w)
                if op == "get":
                    keys = [f"{prefix}{(j + w * 7) % num_keys}" for j in range(num_keys)]
                    for j in range(0, num_keys, 1000):   # warm metadata, as the single rows do
                        kv.lookup(keys[j:j + 1000])
                    step = lambda i: kv.get_into(keys[i % num_keys], pool[i])  # noqa: E731
                else:
                    step = lambda i: kv.put(f"{prefix}w{w}/{i}", pool[i])  # noqa: E731
                pipe.send(_timed(step, duration_s, warmup_s, max_iters,
                                 before_timed=lambda: barrier.wait(timeout=60)))
            except Exception as exc:  # reported to the parent, which fails the run
                barrier.abort()
                pipe.send(("error", repr(exc)))


class _Kvstore:
    """A master and one node (the launcher's), clients on both paths and the concurrent workers."""

    def __init__(self, cfg: "BenchConfig", log_dir: str):
        from kvstore.client import KVClient
        from kvstore.tools.launcher import start_store_cluster
        from kvstore.tools.processes import ProcessGroup

        self.cfg = cfg
        self.run_id = uuid.uuid4().hex[:8]
        self.procs = ProcessGroup(log_dir=log_dir)
        self.workers: list[tuple[mp.Process, object]] = []
        self.kv_shm = self.kv_tcp = None
        try:
            store = start_store_cluster(1, 1, dram=cfg.node_dram, eviction_policy="default",
                                        node_prefix="bench", procs=self.procs)
            master = store.master
            self.shm_name = store.nodes["bench0"].info.get("shm_name", "")
            ctx = mp.get_context("spawn")
            barrier = ctx.Barrier(cfg.clients)
            for _ in range(cfg.clients):
                ours, theirs = ctx.Pipe()
                p = ctx.Process(target=_client_worker, daemon=True,
                                args=(master, cfg.concurrent_shm, cfg.verify, cfg.pool_bytes,
                                      barrier, theirs))
                p.start()
                self.workers.append((p, ours))
            self.kv_shm = KVClient(master, prefer_shm=True, verify_checksum=cfg.verify)
            self.kv_tcp = KVClient(master, prefer_shm=False, verify_checksum=cfg.verify)
            for _, pipe in self.workers:
                if not pipe.poll(120) or pipe.recv() != "ready":
                    raise RuntimeError("a concurrent client process did not start")
        except BaseException:
            self.stop()
            raise

    def _remove(self, keys: list[str]) -> None:
        """Remove ``keys``, then wait until the node has applied it: drops reach it
        with its next heartbeat and free memory on that thread, which must not
        overlap the next measurement."""
        (before,) = self.kv_tcp.node_stats().values()
        removed = 0
        for k in range(0, len(keys), 1000):
            removed += sum(r is None for r in self.kv_tcp.batch_remove(keys[k:k + 1000]))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            (st,) = self.kv_tcp.node_stats().values()
            if st["num_objects"] <= before["num_objects"] - removed and not st["num_doomed"]:
                return
            time.sleep(0.05)

    def _put_rows(self, size: int, prefix: str, src: _Pool, max_iters: int) -> list[Row]:
        """shm, tcp and tcp-batch puts, a fresh key per value, removed afterwards."""
        cfg, batch, rows = self.cfg, self.cfg.batch_keys, []
        for path in ("shm", "tcp", "tcp-batch"):
            cfg.progress(f"kvstore {path} put {format_size(size)}")
            p = f"{prefix}put-{path}/"
            if path == "tcp-batch":
                def step(i: int) -> None:
                    b = range(i * batch, (i + 1) * batch)
                    _check(self.kv_tcp.batch_put([f"{p}{j}" for j in b], [src[j] for j in b]),
                           "batch_put")
                t = cfg.timed(step, max(2, max_iters // batch))
                written = t.total * batch
            else:
                kv = self.kv_shm if path == "shm" else self.kv_tcp
                t = cfg.timed(lambda i: kv.put(f"{p}{i}", src[i]), max_iters)
                written = t.total
            rows.append(_timed_row("kvstore", path, "put", size, t,
                                   batch if path == "tcp-batch" else 1))
            self._remove([f"{p}{j}" for j in range(written)])
        return rows

    def _get_rows(self, size: int, keys: list[str], src: _Pool, dst: _Pool) -> list[Row]:
        """The memcpy limit, then shm, tcp and tcp-batch gets of the working set
        ``keys``, in rotation.

        Each client's metadata cache is warmed first (one batched lookup), as in
        a client's steady state: the rows measure the data path, not the first
        master lookup of each key. The memcpy limit (``src`` -> ``dst``) is
        measured in rounds taking turns with the shm gets, its ratio's path.
        """
        cfg, batch, rows = self.cfg, self.cfg.batch_keys, []
        n = len(keys)
        for kv in (self.kv_shm, self.kv_tcp):
            for j in range(0, n, 1000):
                kv.lookup(keys[j:j + 1000])
        for path in ("shm", "tcp", "tcp-batch"):
            cfg.progress(f"kvstore {path} get {format_size(size)}")
            if path == "shm":
                t_copy, t = _timed_interleaved(
                    [lambda i: np.copyto(dst[i], src[i + 1]),
                     lambda i: self.kv_shm.get_into(keys[i % n], dst[i])],
                    cfg.duration_s, cfg.warmup_s, cfg.rounds)
                rows.insert(0, _timed_row("memcpy", "cold", "get", size, t_copy))
            elif path == "tcp-batch":
                def step(i: int) -> None:
                    b = range(i * batch, (i + 1) * batch)
                    _check(self.kv_tcp.batch_get_into([keys[j % n] for j in b],
                                                      [dst[j] for j in b]), "batch_get_into")
                t = cfg.timed(step)
            else:
                kv = self.kv_shm if path == "shm" else self.kv_tcp
                t = cfg.timed(lambda i: kv.get_into(keys[i % n], dst[i]))
            rows.append(_timed_row("kvstore", path, "get", size, t,
                                   batch if path == "tcp-batch" else 1))
            if path == "shm" and not self._shm_mapped():
                cfg.note("kvstore shm rows went over TCP: the node's segment is not mapped here")
        return rows

    def _shm_mapped(self) -> bool:
        """True when this process maps the node's segment (unknown counts as mapped)."""
        try:
            with open("/proc/self/maps") as f:
                return not self.shm_name or f"/dev/shm/{self.shm_name}" in f.read()
        except OSError:
            return True

    def _concurrent_row(self, op: str, size: int, prefix: str, num_keys: int,
                        max_iters: int) -> Row:
        """All workers at once; throughput over the span from the first start to the last end."""
        cfg = self.cfg
        cfg.progress(f"kvstore {cfg.clients} clients {op} {format_size(size)}")
        for w, (_, pipe) in enumerate(self.workers):
            pipe.send((op, size, prefix, num_keys, w, cfg.duration_s, cfg.warmup_s,
                       max(4, max_iters // cfg.clients)))
        answers = []
        for _, pipe in self.workers:
            if not pipe.poll(cfg.duration_s + cfg.warmup_s + 120):
                raise RuntimeError("a concurrent client process stopped answering")
            answers.append(pipe.recv())
        errors = [a[1] for a in answers if isinstance(a, tuple)]
        if errors:
            raise RuntimeError(f"concurrent {op} failed: {errors[0]}")
        if op == "put":
            self._remove([f"{prefix}w{w}/{j}" for w, a in enumerate(answers)
                          for j in range(a.total)])
        span = max(a.t0 + a.seconds for a in answers) - min(a.t0 for a in answers)
        return _row("kvstore", "concurrent", op, size, sum(a.ops for a in answers), span)

    def bench(self, size: int) -> list[Row]:
        cfg, batch = self.cfg, self.cfg.batch_keys
        prefix = f"bench/{self.run_id}/{size}/"
        src = _Pool(size, cfg.pool_bytes, min_slots=batch, seed=1)
        dst = _Pool(size, cfg.pool_bytes, min_slots=batch, seed=2)
        max_iters = max(8, cfg.max_put_bytes // size)
        rows = self._put_rows(size, prefix, src, max_iters)
        # The get working set: >= pool_bytes of values, written once, read in rotation.
        keys = [f"{prefix}ws/{j}" for j in range(max(batch, math.ceil(cfg.pool_bytes / size)))]
        for k in range(0, len(keys), batch):
            chunk = keys[k:k + batch]
            _check(self.kv_tcp.batch_put(chunk, [src[k + j] for j in range(len(chunk))]),
                   "batch_put")
        rows += self._get_rows(size, keys, src, dst)
        rows.append(self._concurrent_row("put", size, f"{prefix}conc/", len(keys), max_iters))
        rows.append(self._concurrent_row("get", size, f"{prefix}ws/", len(keys), max_iters))
        self._remove(keys)
        return rows

    def bench_exists(self) -> Row:
        cfg = self.cfg
        cfg.progress(f"kvstore batch_exists x{cfg.exists_keys}")
        keys = [f"bench/{self.run_id}/exists/{j}" for j in range(cfg.exists_keys)]
        _check(self.kv_tcp.batch_put(keys, [b"x" * 16] * len(keys)), "batch_put")

        def step(_i: int) -> None:
            if not all(self.kv_tcp.batch_exists(keys)):
                raise RuntimeError("batch_exists missed keys that were just put")
        t = cfg.timed(step)
        self._remove(keys)
        return Row("kvstore", "tcp", "exists", 0, 0.0, t.ops * len(keys) / t.seconds)

    def stop(self) -> None:
        stop_workers(self.workers)
        for kv in (self.kv_shm, self.kv_tcp):
            if kv is not None:
                kv.close()
        self.procs.stop()


# ---- the run ----------------------------------------------------------------------------

@dataclass(slots=True)
class BenchConfig:
    sizes_bytes: list[int]
    duration_s: float = 1.0            # timed budget per measurement
    warmup_s: float = 0.2              # untimed warm-up before it
    verify: bool | None = None         # kvstore get checksum checks: None = client default (TCP only)
    batch_keys: int = 32               # keys per tcp-batch call
    clients: int = 4                   # concurrent client processes
    concurrent_shm: bool = False       # concurrent clients use shm instead of TCP
    exists_keys: int = 1000            # keys per batch_exists call
    pool_bytes: int = 0                # rotation pool per side; 0 = 2x LLC, >= 64 MiB
    max_put_bytes: int = 512 * _MiB    # cap per put measurement (node memory)
    node_dram: str = "3GiB"
    use_redis: bool = True
    use_mooncake: bool = True
    rounds: int = 3                    # the timed budget's rounds; the median one is reported
    progress: Callable[[str], None] = lambda label: None
    note: Callable[[str], None] = lambda text: None

    def timed(self, step: Callable[[int], None], max_iters: int | None = None) -> Timing:
        """:func:`_timed` with this run's budget, warm-up and rounds."""
        return _timed(step, self.duration_s, self.warmup_s, max_iters, rounds=self.rounds)


def run_bench(sizes: str | list[int] = "64KiB,1MiB,4MiB", *, log_dir: str | None = None,
              **options) -> list[dict]:
    """Run every measurement once; rows as dicts (see :class:`Row`), in table order.

    Args:
        sizes: value sizes, ``"64KiB,1MiB"`` or a list of byte counts.
        log_dir: cluster logs (default: a temporary directory, removed afterwards).
        **options: any :class:`BenchConfig` field.
    """
    sizes_bytes = [parse_size(s) for s in sizes.split(",")] if isinstance(sizes, str) else sizes
    cfg = BenchConfig(sizes_bytes=sizes_bytes, **options)
    if not cfg.pool_bytes:
        cfg.pool_bytes = max(64 * _MiB, 2 * llc_bytes())
    cfg.note(f"kvstore gets verify checksums: {_verify_label(cfg.verify)}")
    rows: list[Row] = []
    redis_peer = mooncake_peer = kvs = None
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    sock_proc = ctx.Process(target=_socket_server, args=(theirs, cfg.pool_bytes), daemon=True)
    sock_proc.start()
    tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="kvstore-bench-")
    try:
        redis_peer = _start_redis(cfg)
        mooncake_peer = start_mooncake(cfg, log_dir or tmp.name)
        if not ours.poll(60):
            raise RuntimeError("socket peer process did not start")
        port = ours.recv()
        kvs = _Kvstore(cfg, log_dir or tmp.name)
        for size in cfg.sizes_bytes:
            limits = _bench_socket(port, size, cfg)
            peers = redis_peer.bench(size, cfg) if redis_peer is not None else []
            if mooncake_peer is not None:
                peers += mooncake_peer.bench(size)
            ours = kvs.bench(size)
            memcpy = [r for r in ours if r.system == "memcpy"]
            rows += memcpy + limits + peers + [r for r in ours if r.system != "memcpy"]
        rows.append(kvs.bench_exists())
    finally:
        if kvs is not None:
            kvs.stop()
        if redis_peer is not None:
            redis_peer.stop()
        if mooncake_peer is not None:
            mooncake_peer.stop()
        sock_proc.terminate()
        sock_proc.join()
        if tmp is not None:
            tmp.cleanup()
    return [asdict(r) for r in rows]


def num_steps(num_sizes: int, use_redis: bool, use_mooncake: bool = False) -> int:
    """Progress labels a run reports (for a progress bar's total)."""
    return num_sizes * (4 + 2 * use_redis + use_mooncake + 8) + 1


def _find(rows: list[dict], system: str, path: str, op: str | None, size: int) -> dict | None:
    for r in rows:
        if (r["system"], r["path"], r["size_bytes"]) == (system, path, size) and (
                op is None or r["op"] == op):
            return r
    return None


def _ratio(row: dict | None, base: dict | None) -> float | None:
    if row is None or base is None or not base["ops_per_s"]:
        return None
    return row["ops_per_s"] / base["ops_per_s"]


def check_targets(rows: list[dict]) -> list[tuple[str, int, float | None, bool | None]]:
    """Issue 4's targets at the sizes ``rows`` measured: (name, size_bytes, measured, passed).

    ``measured`` is the ratio to the baseline, or ops/s for an absolute
    target; both are None when a row is missing (a peer that was skipped).
    """
    measured = {r["size_bytes"] for r in rows}
    out = []
    for t in TARGETS:
        for size in t.sizes_bytes:
            if size not in measured:
                continue
            row = _find(rows, *t.row, size)
            if t.baseline is None:
                value = row["ops_per_s"] if row else None
            else:
                value = _ratio(row, _find(rows, *t.baseline, size))
            out.append((t.name, size, value, None if value is None else value >= t.ratio))
    return out


def _verify_label(verify: bool | None) -> str:
    return "tcp only (client default)" if verify is None else ("on" if verify else "off")


def render(rows: list[dict], verify: bool | None):
    """The results as rich tables: measurements, then the targets."""
    from rich.console import Group
    from rich.table import Table

    # Fits 80 columns: no rules, two-line ratio headers, the limits named in the caption.
    table = Table(title="kvstore bench (GB/s = 10^9 B/s)", box=None, pad_edge=False,
                  caption="vs limit: shm / cold memcpy, tcp / socket reqresp,\n"
                          "tcp-batch / socket stream.\n"
                          f"gets verify checksums: {_verify_label(verify)}",
                  caption_justify="left")
    for name in ("system", "path", "op", "size"):
        table.add_column(name, no_wrap=True)
    for name in ("GB/s", "ops/s", "vs\nlimit", "vs\nredis", "vs\nmooncake"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        limit = redis = mooncake = ""
        if r["system"] == "kvstore" and r["path"] in _LIMIT_OF:
            sys_, path = _LIMIT_OF[r["path"]]
            base = _find(rows, sys_, path, None if sys_ == "memcpy" else r["op"], r["size_bytes"])
            x = _ratio(r, base)
            limit = f"{x:.2f}x" if x is not None else ""
        if r["system"] == "kvstore" and r["path"] == "tcp":
            x = _ratio(r, _find(rows, "redis", "tcp", r["op"], r["size_bytes"]))
            redis = f"{x:.2f}x" if x is not None else ""
            x = _ratio(r, _find(rows, "mooncake", "tcp", r["op"], r["size_bytes"]))
            mooncake = f"{x:.2f}x" if x is not None else ""
        table.add_row(r["system"], r["path"], r["op"],
                      _short_size(r["size_bytes"]) if r["size_bytes"] else "-",
                      f"{r['gbps']:.3f}" if r["size_bytes"] else "-", f"{r['ops_per_s']:,.0f}",
                      limit, redis, mooncake)
    targets = Table(title="issue 4 targets", box=None, pad_edge=False)
    for name in ("target", "size", "measured", "result"):
        targets.add_column(name)
    for name, size, value, ok in check_targets(rows):
        if value is None:
            targets.add_row(name, _short_size(size) if size else "-", "-", "not measured")
            continue
        targets.add_row(name, _short_size(size) if size else "-",
                        f"{value:,.0f} keys/s" if not size else f"{value:.2f}x",
                        "[green]pass[/]" if ok else "[red]miss[/]")
    return Group(table, targets)


def bench_command(
    sizes: str = typer.Option("64KiB,1MiB,4MiB", help="value sizes, comma-separated"),
    json_out: bool = typer.Option(False, "--json", help="print the rows as JSON on stdout"),
    duration_s: float = typer.Option(1.0, "--duration-s", help="timed budget per measurement"),
    warmup_s: float = typer.Option(0.2, "--warmup-s", help="untimed warm-up per measurement"),
    rounds: int = typer.Option(3, help="rounds per budget; the median round is reported"),
    verify: Optional[bool] = typer.Option(None, "--verify/--no-verify",
                                help="check every get (default: TCP gets only)"),
    clients: int = typer.Option(4, help="client processes in the concurrent rows"),
    concurrent_shm: bool = typer.Option(False, "--concurrent-shm",
                                        help="concurrent clients use shared memory, not TCP"),
    batch_keys: int = typer.Option(32, help="keys per batched call (tcp-batch rows)"),
    exists_keys: int = typer.Option(1000, help="keys per batch_exists call"),
    node_dram: str = typer.Option("3GiB", help="DRAM of the benchmark's store node"),
    redis: bool = typer.Option(True, "--redis/--no-redis", help="measure Redis when installed"),
    mooncake: bool = typer.Option(True, "--mooncake/--no-mooncake",
                                  help="measure Mooncake Store when installed"),
    log_dir: Optional[str] = typer.Option(None, help="cluster logs (default: a temp dir)"),
) -> None:
    """Measure kvstore's data plane beside memcpy, a raw socket, Redis and Mooncake Store."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvstore.tools.processes import ChildFailed

    out, err = Console(), Console(stderr=True)
    try:
        size_list = [parse_size(s) for s in sizes.split(",")]
    except ValueError as exc:
        err.print(f"[red]{exc}[/]")
        raise typer.Exit(2)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                        console=err, transient=True)
    task = progress.add_task("starting", total=num_steps(len(size_list), redis,
                                                         mooncake and master_binary() is not None))

    def step(label: str) -> None:
        progress.update(task, description=label, advance=1)

    try:
        with progress:
            rows = run_bench(size_list, log_dir=log_dir, duration_s=duration_s,
                             warmup_s=warmup_s, rounds=rounds, verify=verify, clients=clients,
                             concurrent_shm=concurrent_shm, batch_keys=batch_keys,
                             exists_keys=exists_keys, node_dram=node_dram, use_redis=redis,
                             use_mooncake=mooncake,
                             progress=step, note=lambda t: err.print(f"note: {t}"))
    except (ChildFailed, RuntimeError) as exc:
        err.print(f"[red]benchmark failed:[/] {exc}")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted; cluster stopped[/]")
        raise typer.Exit(130)
    if json_out:
        sys.stdout.write(json.dumps(rows) + "\n")
    else:
        out.print(render(rows, verify))


if __name__ == "__main__":
    typer.run(bench_command)
