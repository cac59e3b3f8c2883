"""The harness of ``kvstore bench``: what every measured system shares, and the run.

- the names (:class:`System`, :class:`DataPath`, :class:`Op`), the rows
  (:class:`Row`) and what one timed loop returns (:class:`Timing`);
- timing: :func:`timed` (warm-up, then ``rounds`` rounds, the median one
  reported, the CPU of a :class:`~.cpu.CpuMeter`'s processes over all of
  them) and :func:`timed_interleaved` (several loops whose rounds take
  turns); :func:`with_cpu` turns that CPU into a row's µs per value;
- cold memory: :class:`Pool`, value slots rotating through a buffer of at
  least twice the last-level cache (:func:`llc_bytes`);
- :class:`BenchConfig`, one run's options, and the worker-process helper
  :func:`stop_workers`;
- :class:`Peer`, what a system module starts, and :func:`run_systems`, which
  starts each system, has each measure every size in turn, and stops them.

The harness imports no system module: the list of systems to run is passed
in (``kvstore.tools.bench.command`` holds it). The methodology is in the
package docstring.
"""

from __future__ import annotations

import abc
import logging
import math
import multiprocessing as mp
import os
import tempfile
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Callable, Sequence

import numpy as np

from kvstore.sizes import parse_size
from kvstore.tools.bench.cpu import CpuMeter, add_cpu, cpu_used

_log = logging.getLogger(__name__)

MiB = 1 << 20
GiB = 1 << 30


# ---- names, rows and timings ------------------------------------------------------------

class _Name(str, Enum):
    """A name that is its string: ``str()`` and f-strings give the value, as JSON does."""

    def __str__(self) -> str:
        return self.value


class System(_Name):
    """The measured systems, in table order: each size's rows follow this order."""

    MEMCPY = "memcpy"
    SOCKET = "socket"
    REDIS = "redis"
    MOONCAKE = "mooncake"
    KVSTORE = "kvstore"
    KVSTORE_RESP = "kvstore-resp"      # kvstore's RESP front (kvstore resp), Redis clients


class DataPath(_Name):
    """How a row's values travel (a row's ``path``)."""

    COLD = "cold"                # memcpy between cold pools
    REQRESP = "reqresp"          # one request, one value
    STREAM = "stream"            # values back to back on one connection
    SHM = "shm"                  # the node's shared-memory segment
    TCP = "tcp"                  # one key per call over TCP
    TCP_BATCH = "tcp-batch"      # batch_keys keys per call over TCP
    CONCURRENT = "concurrent"    # several client processes at once
    ASYNC_16 = "async-16"        # AsyncKVClient, 16 operations in flight on one connection
    ASYNC_64 = "async-64"        # ... 64 in flight
    ASYNC_16_SHM = "async-16-shm"  # AsyncKVClient, 16 in flight, through the node's segment
    TCP_TLS = "tcp+tls"                # tcp over mutual TLS, to a cluster with --auth
    TCP_BATCH_TLS = "tcp-batch+tls"    # tcp-batch likewise
    REDIS_BENCHMARK = "redis-benchmark"   # redis-benchmark -P 16 (50 connections), one key
    REDIS_BENCHMARK_KEYS = "redis-benchmark-r1000"   # ... -r 1000: 1000 distinct keys
    REDIS_PY = "redis-py"        # redis-py, the front's and its redis-server's rounds alternating


class Op(_Name):
    """What a row does to its values."""

    PUT = "put"
    GET = "get"
    EXISTS = "exists"
    LOOKUP = "lookup"


#: The names' strings, as the rows' dicts and ``--json`` hold them.
SYSTEMS = tuple(s.value for s in System)
PATHS = tuple(p.value for p in DataPath)
OPS = tuple(o.value for o in Op)
_TABLE_ORDER = {s: i for i, s in enumerate(System)}
#: Each TCP path's twin measured with TLS on (``--tls``), and back.
TLS_OF = {DataPath.TCP: DataPath.TCP_TLS, DataPath.TCP_BATCH: DataPath.TCP_BATCH_TLS}
PLAIN_OF = {tls: plain for plain, tls in TLS_OF.items()}


@dataclass(frozen=True, slots=True)
class Row:
    """One measurement: a system's path and op at one value size.

    The CPU fields name each process of the system (kvstore: ``node``,
    ``master``, ``client``; redis: ``redis-server``, ``client``; mooncake:
    ``master``, ``holder``, ``client``; socket: ``server``, ``client``;
    kvstore-resp: ``front``, ``node``, ``master``, ``client``; memcpy:
    ``client``); ``client`` is the process that runs the timed loop (this one,
    Mooncake's client process, or the concurrent client processes summed).
    Empty where a row was not metered (redis-benchmark's rows).
    """

    system: System
    path: DataPath
    op: Op
    size_bytes: int    # value size; 0 for exists and lookup
    gbps: float        # 10^9 bytes per second
    ops_per_s: float   # values (keys for exists) per second
    cpu_us_per_op: dict[str, float] = field(default_factory=dict)    # µs of CPU per value
                                                                     # (key for exists)
    cpu_us_per_gib: dict[str, float] = field(default_factory=dict)   # µs of CPU per GiB
                                                                     # moved; {} for exists
    cpu_resolution_us: float = 0.0     # the CPU readings' resolution, µs per value

    def to_dict(self) -> dict:
        """The row as ``--json`` prints it: these field names, plain str / int / float values
        (the ``cpu_*`` ones dicts of process name -> float)."""
        return {"system": self.system.value, "path": self.path.value, "op": self.op.value,
                "size_bytes": self.size_bytes, "gbps": self.gbps, "ops_per_s": self.ops_per_s,
                "cpu_us_per_op": dict(self.cpu_us_per_op),
                "cpu_us_per_gib": dict(self.cpu_us_per_gib),
                "cpu_resolution_us": self.cpu_resolution_us}


@dataclass(frozen=True, slots=True)
class Timing:
    """What one timed loop measured (sent between processes, so plain fields only)."""

    ops: int           # iterations in the reported round
    seconds: float     # that round's wall time
    total: int         # iterations of every round and the warm-up (puts: keys written)
    t0: float          # time.perf_counter() when the first round began
    timed_ops: int = 0                 # iterations of every timed round (not the warm-up)
    cpu_s: dict[str, float] = field(default_factory=dict)   # CPU seconds per metered
                                                            # process over those rounds
    cpu_tick_s: float = 0.0            # resolution of those readings (s)


def rate_row(system: System, path: DataPath, op: Op, size_bytes: int, ops: float,
             seconds: float) -> Row:
    """The row of ``ops`` values of ``size_bytes`` moved in ``seconds``."""
    return Row(system, path, op, size_bytes, ops * size_bytes / seconds / 1e9, ops / seconds)


def with_cpu(row: Row, cpu_s: dict[str, float], ops: int, tick_s: float) -> Row:
    """``row`` with the CPU of its processes: ``cpu_s`` (seconds each) spent on ``ops``
    values (keys for exists) of ``row.size_bytes``, read at ``tick_s`` resolution."""
    if not cpu_s or ops <= 0:
        return row
    per_op = {name: s * 1e6 / ops for name, s in cpu_s.items()}
    gib = ops * row.size_bytes / GiB
    per_gib = {name: s * 1e6 / gib for name, s in cpu_s.items()} if gib else {}
    return replace(row, cpu_us_per_op=per_op, cpu_us_per_gib=per_gib,
                   cpu_resolution_us=tick_s * 1e6 / ops)


def timed_row(system: System, path: DataPath, op: Op, size_bytes: int, t: Timing,
              values_per_iter: int = 1) -> Row:
    """The row of a :class:`Timing` whose iterations each moved ``values_per_iter`` values:
    the rate of its reported round, the CPU per value of all its timed rounds."""
    row = rate_row(system, path, op, size_bytes, t.ops * values_per_iter, t.seconds)
    return with_cpu(row, t.cpu_s, t.timed_ops * values_per_iter, t.cpu_tick_s)


# ---- timing -----------------------------------------------------------------------------

def timed(step: Callable[[int], None], duration_s: float, warmup_s: float,
          max_iters: int | None = None, before_timed: Callable[[], object] | None = None,
          rounds: int = 1, cpu: CpuMeter | None = None) -> Timing:
    """Call ``step(i)`` untimed for ``warmup_s`` (at least once), then timed for ``duration_s``.

    The timed budget is split into ``rounds`` equal rounds and the round with
    the median rate is reported: one stall of this small, shared host does not
    move the result. ``max_iters`` caps all iterations (the warm-up takes at
    most an eighth); ``before_timed`` runs between warm-up and rounds (the
    concurrent clients' barrier). ``cpu`` is read as the rounds begin and as
    they end: the CPU its processes used over every timed round (CPU time is
    stable where a round's rate is not, so it takes them all).
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
    cpu_before = cpu.sample() if cpu is not None else {}
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
    cpu_s = cpu_used(cpu_before, cpu.sample()) if cpu is not None else {}
    if not done:
        raise AssertionError("max_iters left no timed iteration")
    timed_ops = sum(r[0] for r in done)
    done.sort(key=lambda r: r[0] / r[1])
    n, secs = done[len(done) // 2]
    return Timing(n, secs, i, t0, timed_ops, cpu_s, cpu.tick_s if cpu is not None else 0.0)


def timed_interleaved(steps: list[Callable[[int], None]], duration_s: float, warmup_s: float,
                      rounds: int, cpus: Sequence[CpuMeter | None] | None = None
                      ) -> list[Timing]:
    """:func:`timed` for several steps at once, their rounds taking turns.

    Each step gets ``duration_s`` in ``rounds`` rounds and its median round is
    reported, as with ``timed``; because the rounds alternate, a limit and
    the path normalised by it see the same state of the machine (its
    bandwidth drifts by a third over minutes on a shared VM). ``cpus[k]``
    meters step ``k`` over its own rounds only.
    """
    cpus = list(cpus) if cpus is not None else [None] * len(steps)
    base = [0] * len(steps)
    done: list[list[Timing]] = [[] for _ in steps]
    for r in range(rounds):
        for k, step in enumerate(steps):
            t = timed(lambda j, k=k, step=step: step(base[k] + j), duration_s / rounds,
                      warmup_s if r == 0 else 0.0, cpu=cpus[k])
            base[k] += t.total
            done[k].append(t)
    out = []
    for k in range(len(steps)):
        ts = sorted(done[k], key=lambda t: t.ops / t.seconds)
        med = ts[len(ts) // 2]
        out.append(Timing(med.ops, med.seconds, base[k], done[k][0].t0,
                          sum(t.timed_ops for t in done[k]),
                          add_cpu(*(t.cpu_s for t in done[k])),
                          max(t.cpu_tick_s for t in done[k])))
    return out


# ---- cold memory ------------------------------------------------------------------------

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
    return best or 32 * MiB


#: The default rotation pool is at most this big: a VM may report its host's whole
#: last-level cache (480 MiB here, of which 2 cores see a sliver), and a dozen pools
#: of twice that (each side, each worker, each size of the socket peer) ran a
#: 24 GiB machine out of memory. Cold memcpy measured 7.2 GB/s over 256 MiB
#: pools there, 11.7 over 64 MiB ones.
MAX_DEFAULT_POOL_BYTES = 256 * MiB


def default_pool_bytes() -> int:
    """Twice the last-level cache, at least 64 MiB, at most :data:`MAX_DEFAULT_POOL_BYTES`."""
    return max(64 * MiB, min(2 * llc_bytes(), MAX_DEFAULT_POOL_BYTES))


class Pool:
    """``num_slots`` equal value slots (numpy uint8 views) in one buffer of >= ``pool_bytes``."""

    def __init__(self, size_bytes: int, pool_bytes: int, min_slots: int = 2, seed: int = 0):
        self.num_slots = max(min_slots, math.ceil(pool_bytes / max(size_bytes, 1)))
        # One allocation: a bytes object copied into a bytearray held twice the pool.
        self.buf = np.random.default_rng(seed).integers(0, 256, self.num_slots * size_bytes,
                                                        dtype=np.uint8)
        self.slots = [self.buf[i * size_bytes:(i + 1) * size_bytes] for i in range(self.num_slots)]
        self.views = [memoryview(s) for s in self.slots]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.slots[i % self.num_slots]


# ---- one run's options ------------------------------------------------------------------

def verify_label(verify: bool | None) -> str:
    """How kvstore's gets check checksums, in words (a note and the table's caption)."""
    return "tcp only (client default)" if verify is None else ("on" if verify else "off")


@dataclass(frozen=True, slots=True)
class BenchConfig:
    """One run's options; ``progress`` and ``note`` report to the caller (the CLI prints)."""

    sizes_bytes: tuple[int, ...]
    duration_s: float = 1.0            # timed budget per measurement
    warmup_s: float = 0.2              # untimed warm-up before it
    verify: bool | None = None         # kvstore gets check checksums; None: client default (TCP)
    batch_keys: int = 32               # keys per tcp-batch call
    clients: int = 4                   # concurrent client processes
    concurrent_shm: bool = False       # concurrent clients use shm instead of TCP
    exists_keys: int = 1000            # keys per batch_exists call
    pool_bytes: int = 0                # rotation pool per side; 0: default_pool_bytes()
    max_put_bytes: int = 512 * MiB     # cap per put measurement (node memory)
    node_dram: str = "3GiB"
    use_redis: bool = True
    use_resp: bool = False             # the RESP front beside a redis-server (--resp)
    use_mooncake: bool = True
    tls: bool = False                  # also measure kvstore over mutual TLS (the +tls rows)
    metrics: bool = False              # kvstore's processes serve --metrics-port, scraped
                                       # every METRICS_SCRAPE_S (the cost of metrics)
    rounds: int = 3                    # the timed budget's rounds; the median one is reported
    progress: Callable[[str], None] = lambda label: None
    note: Callable[[str], None] = lambda text: None

    def timed(self, step: Callable[[int], None], max_iters: int | None = None,
              cpu: CpuMeter | None = None) -> Timing:
        """:func:`timed` with this run's budget, warm-up and rounds; ``cpu`` metered."""
        return timed(step, self.duration_s, self.warmup_s, max_iters, rounds=self.rounds,
                     cpu=cpu)

    def timed_together(self, steps: list[Callable[[int], None]],
                       cpus: Sequence[CpuMeter | None] | None = None) -> list[Timing]:
        """Each step's :class:`Timing` with this run's budget: :meth:`timed` for one
        step, :func:`timed_interleaved` (rounds taking turns) for several;
        ``cpus[k]`` meters step ``k``."""
        cpus = list(cpus) if cpus is not None else [None] * len(steps)
        if len(steps) == 1:
            return [self.timed(steps[0], cpu=cpus[0])]
        return timed_interleaved(steps, self.duration_s, self.warmup_s, self.rounds, cpus)


# ---- worker processes -------------------------------------------------------------------

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


# ---- the run ----------------------------------------------------------------------------

class Peer(abc.ABC):
    """A started system: measures each size on request, stops when the run ends."""

    @abc.abstractmethod
    def bench(self, size_bytes: int) -> list[Row]:
        """This system's rows at ``size_bytes``, in table order."""

    def bench_once(self) -> list[Row]:
        """Rows measured once per run, after every size (none by default)."""
        return []

    @abc.abstractmethod
    def stop(self) -> None:
        """End what the system started (processes, clients, servers)."""


#: A system module's entry point: ``start(cfg, log_dir)`` -> its :class:`Peer`, or None
#: when it is off or cannot run here (it has told ``cfg.note`` why).
StartSystem = Callable[[BenchConfig, str], "Peer | None"]


def _table_order(row: Row) -> int:
    return _TABLE_ORDER[row.system]


def run_systems(systems: Sequence[StartSystem], sizes: str | list[int], *,
                log_dir: str | None = None, **options) -> list[dict]:
    """Start ``systems`` in order, measure every size with each in turn, stop them.

    Each size's rows are in :class:`System` order (the limits, the peers,
    then kvstore), each system's rows in its own order; the rows measured
    once per run (:meth:`Peer.bench_once`) come last.

    Args:
        systems: the systems' start functions, in the order they start and measure.
        sizes: value sizes, ``"64KiB,1MiB"`` or a list of byte counts.
        log_dir: cluster logs (default: a temporary directory, removed afterwards).
        **options: any :class:`BenchConfig` field.

    Returns:
        The rows as dicts (see :class:`Row`).
    """
    sizes_bytes = [parse_size(s) for s in sizes.split(",")] if isinstance(sizes, str) else sizes
    cfg = BenchConfig(sizes_bytes=tuple(sizes_bytes), **options)
    if not cfg.pool_bytes:
        cfg = replace(cfg, pool_bytes=default_pool_bytes())
    cfg.note(f"kvstore gets verify checksums: {verify_label(cfg.verify)}")
    rows: list[Row] = []
    peers: list[Peer] = []
    tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="kvstore-bench-")
    try:
        for start in systems:
            peer = start(cfg, log_dir or tmp.name)
            _log.debug("%s: %s", start.__module__, "started" if peer else "skipped")
            if peer is not None:
                peers.append(peer)
        for size in cfg.sizes_bytes:
            rows += sorted((r for p in peers for r in p.bench(size)), key=_table_order)
        for peer in peers:
            rows += peer.bench_once()
    finally:
        for peer in reversed(peers):
            peer.stop()
        if tmp is not None:
            tmp.cleanup()
    return [r.to_dict() for r in rows]
