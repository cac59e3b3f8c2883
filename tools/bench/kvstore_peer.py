"""kvstore itself: a master and one node started here, measured on every client path.

Rows (``kvstore``)::

    shm         get, put   KVClient through the node's shared-memory segment (puts under
                           1 MiB as PUT frames on its Unix socket, as the SDK sends them)
    tcp         get, put   KVClient over TCP, one key per call
    tcp-batch   get, put   batch_get_into / batch_put of ``batch_keys`` keys over TCP
    concurrent  get, put   ``clients`` client processes at once (TCP unless concurrent_shm)
    async-16    get, put   AsyncKVClient, 16 operations in flight, TCP: 16 coroutines, each
                           starting its next operation as its last one returns
    async-64    get, put   ... 64 in flight
    async-16-shm get, put  AsyncKVClient, 16 in flight, values through the node's segment
                           (puts of 1 MiB and more; smaller ones go over TCP)
    tcp         exists     batch_exists of ``exists_keys`` keys, once per run; ops/s
                           counts keys, size is 0
    tcp         lookup     one key per Lookup (``KVClient.lookup``), keys put before the
                           round, as an engine's first read of another's block; size 0

Puts write a fresh key per value (at most ``max_put_bytes`` per row) and
remove them afterwards, waiting until the node has freed them. Gets read a
working set of >= ``pool_bytes`` of values, written once per size, in
rotation, into preallocated buffers (``get_into``), after one batched lookup
has warmed each client's metadata cache. The cold-memcpy limit
(:mod:`~kvstore.tools.bench.memcpy`) is timed here, its rounds taking turns
with the shm gets'.

CPU is metered for the ``node``, the ``master`` and the ``client`` (this
process; the concurrent rows: the client processes summed).

Given a :class:`Secured`, the same peer starts a cluster with ``--auth`` and
TLS and measures only its TCP paths, labelled ``tcp+tls`` and
``tcp-batch+tls`` (:mod:`~kvstore.tools.bench.kvstore_tls_peer`).
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
import uuid
from dataclasses import dataclass, field

from kvstore.sizes import format_size
from kvstore.tools.bench import memcpy
from kvstore.tools.bench.cpu import CpuMeter, add_cpu, cpu_used, this_process
from kvstore.tools.bench.harness import (TLS_OF, BenchConfig, DataPath, Op, Peer, Pool, Row,
                                         System, rate_row, stop_workers, timed, timed_row,
                                         with_cpu)

#: An asyncio row's timed step moves at most this much (its operations back to back).
_ASYNC_STEP_BYTES = 32 * 1024 * 1024
#: The single-client paths, in table order.
_PATHS = (DataPath.SHM, DataPath.TCP, DataPath.TCP_BATCH)


@dataclass(frozen=True, slots=True)
class Secured:
    """A cluster with authentication and TLS: how it starts and how clients reach it."""

    server_args: tuple[str, ...]       # every master's and node's options (--auth, --tls-*)
    env: dict[str, str]                # every process's environment (the nodes' KVSTORE_TOKEN)
    client: dict = field(default_factory=dict)   # the measured KVClient's token=, tls=
    admin: dict = field(default_factory=dict)    # ... the housekeeping one's (stats are admin's)


def _check(results: list, what: str) -> None:
    bad = [r for r in results if isinstance(r, Exception)]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} of {len(results)} failed, first: {bad[0]!r}")


def _client_worker(master: str, prefer_shm: bool, verify: bool | None, pool_bytes: int,
                   barrier, pipe) -> None:
    """A concurrent client process: runs get or put loops on command, in step with the others.

    Commands are ``(op, size, key_prefix, num_keys, worker_index, duration_s, warmup_s,
    max_iters)``; the answer is a :class:`Timing` (``t0`` from ``time.perf_counter``, one
    clock for every process on Linux; ``cpu_s``: this process's, as ``client``) or
    ``("error", text)``. None stops the worker. ``barrier`` holds the workers and the
    parent, which reads the node's CPU as the timed loops begin.
    """
    from kvstore.client import KVClient

    with KVClient(master, prefer_shm=prefer_shm, verify_checksum=verify) as kv:
        pipe.send("ready")
        while (cmd := pipe.recv()) is not None:
            op, size, prefix, num_keys, w, duration_s, warmup_s, max_iters = cmd
            pool = step = None            # the last command's pool goes before the next one
            try:
                pool = Pool(size, pool_bytes, seed=10 + w)
                if op == Op.GET:
                    keys = [f"{prefix}{(j + w * 7) % num_keys}" for j in range(num_keys)]
                    for j in range(0, num_keys, 1000):   # warm metadata, as the single rows do
                        kv.lookup(keys[j:j + 1000])
                    step = lambda i: kv.get_into(keys[i % num_keys], pool[i])  # noqa: E731
                else:
                    step = lambda i: kv.put(f"{prefix}w{w}/{i}", pool[i])  # noqa: E731
                pipe.send(timed(step, duration_s, warmup_s, max_iters,
                                before_timed=lambda: barrier.wait(timeout=60),
                                cpu=this_process()))
            except Exception as exc:  # reported to the parent, which fails the run
                barrier.abort()
                pipe.send(("error", repr(exc)))


#: With ``--metrics``: every kvstore process's /metrics is read this often (s), as a
#: Prometheus server scraping at a short interval would.
METRICS_SCRAPE_S = 5.0


class _Scraper:
    """Reads ``addresses``' /metrics every :data:`METRICS_SCRAPE_S` on a thread."""

    def __init__(self, addresses: list[str]):
        import threading

        self.addresses = addresses
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-scraper", daemon=True)

    def start(self) -> "_Scraper":
        self._thread.start()
        return self

    def _run(self) -> None:
        from kvstore.tools.cli.top import Scraper

        scraper = Scraper()
        while not self._stop.wait(METRICS_SCRAPE_S):
            for a in self.addresses:
                try:
                    scraper.text(a)
                    self.scrapes += 1
                except OSError:      # the cluster is stopping
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class KvstorePeer(Peer):
    """A master and one node (the launcher's), clients on both paths and the concurrent workers.

    With ``secured`` the cluster serves TLS and checks tokens, its logs go to
    ``log_dir/tls``, and only the TCP paths are measured (no shm, concurrent
    or exists rows), as their ``+tls`` twins.
    """

    def __init__(self, cfg: BenchConfig, log_dir: str, secured: Secured | None = None):
        from kvstore.client import KVClient
        from kvstore.tools.cluster.launcher import start_store_cluster
        from kvstore.tools.cluster.processes import ProcessGroup

        self.cfg = cfg
        self.run_id = uuid.uuid4().hex[:8]
        self.secured = secured is not None
        self.paths = tuple(TLS_OF) if self.secured else _PATHS
        self.procs = ProcessGroup(log_dir=os.path.join(log_dir, "tls") if self.secured
                                  else log_dir)
        self.workers: list[tuple[mp.Process, object]] = []
        self.kv_shm = self.kv_tcp = self.kv_admin = None
        self.shm_name = ""
        self.barrier = None
        sec = secured or Secured((), {})
        observed = ("--metrics-port", "0") if cfg.metrics else ()
        self.scraper: _Scraper | None = None
        try:
            store = start_store_cluster(1, 1, dram=cfg.node_dram, eviction_policy="default",
                                        node_prefix="bench", procs=self.procs,
                                        master_args=(*sec.server_args, *observed),
                                        node_args=(*sec.server_args, *observed), env=sec.env)
            if cfg.metrics and not self.secured:
                self.scraper = _Scraper([c.info["metrics_address"] for c in
                                         (store.shards[0][0], store.nodes["bench0"])]).start()
            master = self.store_master = store.master
            servers = {"node": store.nodes["bench0"].proc.pid,
                       "master": store.shards[0][0].proc.pid}
            self.cpu = CpuMeter({**servers, "client": os.getpid()})
            self.server_cpu = CpuMeter(servers)     # the concurrent rows' clients meter themselves
            self.kv_tcp = KVClient(master, prefer_shm=False, verify_checksum=cfg.verify,
                                   **sec.client)
            self.kv_admin = (KVClient(master, prefer_shm=False, **sec.admin) if self.secured
                             else self.kv_tcp)
            if not self.secured:
                self._start_plain(master, store.nodes["bench0"].info.get("shm_name", ""))
            # A node answers READY before its segment prefault ends (seconds of one
            # core): rows measured meanwhile would share the CPU with it.
            self.procs.wait_idle()
        except BaseException:
            self.stop()
            raise

    def _start_plain(self, master: str, shm_name: str) -> None:
        """The plain cluster's shm client and concurrent client processes."""
        from kvstore.client import KVClient

        cfg = self.cfg
        self.shm_name = shm_name
        ctx = mp.get_context("spawn")
        # The workers and this process: it reads the node's CPU as their timed loops begin.
        barrier = self.barrier = ctx.Barrier(cfg.clients + 1)
        for _ in range(cfg.clients):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=_client_worker, daemon=True,
                            args=(master, cfg.concurrent_shm, cfg.verify, cfg.pool_bytes,
                                  barrier, theirs))
            p.start()
            self.workers.append((p, ours))
        self.kv_shm = KVClient(master, prefer_shm=True, verify_checksum=cfg.verify)
        # Its mapping of the node's segment is prefaulted on a thread of this
        # process (1.3 s of a core for 3 GiB): not during the first rows.
        self.kv_shm.warm_up()
        for _, pipe in self.workers:
            if not pipe.poll(120) or pipe.recv() != "ready":
                raise RuntimeError("a concurrent client process did not start")

    def _label(self, path: DataPath) -> DataPath:
        """A measured path as its rows name it: its ``+tls`` twin on a secured cluster."""
        return TLS_OF[path] if self.secured else path

    def _remove(self, keys: list[str]) -> None:
        """Remove ``keys``, then wait until the node has applied it: drops reach it
        with its next heartbeat and free memory on that thread, which must not
        overlap the next measurement."""
        (before,) = self.kv_admin.node_stats().values()
        removed = 0
        for k in range(0, len(keys), 1000):
            removed += sum(r is None for r in self.kv_tcp.batch_remove(keys[k:k + 1000]))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            (st,) = self.kv_admin.node_stats().values()
            if st["num_objects"] <= before["num_objects"] - removed and not st["num_doomed"]:
                return
            time.sleep(0.05)

    def _put_rows(self, size: int, prefix: str, src: Pool, max_iters: int) -> list[Row]:
        """Puts on each measured path (shm, tcp, tcp-batch; secured: the TCP two), a fresh
        key per value, removed afterwards."""
        cfg, batch, rows = self.cfg, self.cfg.batch_keys, []
        for path in self.paths:
            cfg.progress(f"kvstore {self._label(path)} put {format_size(size)}")
            p = f"{prefix}put-{path}/"
            if path == DataPath.TCP_BATCH:
                def step(i: int) -> None:
                    b = range(i * batch, (i + 1) * batch)
                    _check(self.kv_tcp.batch_put([f"{p}{j}" for j in b], [src[j] for j in b]),
                           "batch_put")
                t = cfg.timed(step, max(2, max_iters // batch), cpu=self.cpu)
                written = t.total * batch
            else:
                kv = self.kv_shm if path == DataPath.SHM else self.kv_tcp
                t = cfg.timed(lambda i: kv.put(f"{p}{i}", src[i]), max_iters, cpu=self.cpu)
                written = t.total
            rows.append(timed_row(System.KVSTORE, self._label(path), Op.PUT, size, t,
                                  batch if path == DataPath.TCP_BATCH else 1))
            self._remove([f"{p}{j}" for j in range(written)])
        return rows

    def _get_rows(self, size: int, keys: list[str], src: Pool, dst: Pool) -> list[Row]:
        """The memcpy limit, then shm, tcp and tcp-batch gets of the working set
        ``keys``, in rotation (secured: the tcp and tcp-batch gets only).

        Each client's metadata cache is warmed first (one batched lookup), as in
        a client's steady state: the rows measure the data path, not the first
        master lookup of each key. The memcpy limit (``src`` -> ``dst``) is
        measured in rounds taking turns with the shm gets, its ratio's path.
        """
        cfg, batch, rows = self.cfg, self.cfg.batch_keys, []
        n = len(keys)
        for kv in [kv for kv in (self.kv_shm, self.kv_tcp) if kv is not None]:
            for j in range(0, n, 1000):
                kv.lookup(keys[j:j + 1000])
        for path in self.paths:
            cfg.progress(f"kvstore {self._label(path)} get {format_size(size)}")
            if path == DataPath.SHM:
                t_copy, t = cfg.timed_together(
                    [memcpy.copy_step(src, dst),
                     lambda i: self.kv_shm.get_into(keys[i % n], dst[i])],
                    [this_process(), self.cpu])
                rows.insert(0, memcpy.limit_row(size, t_copy))
            elif path == DataPath.TCP_BATCH:
                def step(i: int) -> None:
                    b = range(i * batch, (i + 1) * batch)
                    _check(self.kv_tcp.batch_get_into([keys[j % n] for j in b],
                                                      [dst[j] for j in b]), "batch_get_into")
                t = cfg.timed(step, cpu=self.cpu)
            else:
                kv = self.kv_shm if path == DataPath.SHM else self.kv_tcp
                t = cfg.timed(lambda i: kv.get_into(keys[i % n], dst[i]), cpu=self.cpu)
            rows.append(timed_row(System.KVSTORE, self._label(path), Op.GET, size, t,
                                  batch if path == DataPath.TCP_BATCH else 1))
            if path == DataPath.SHM and not self._shm_mapped():
                cfg.note("kvstore shm rows went over TCP: the node's segment is not mapped here")
        return rows

    def _shm_mapped(self) -> bool:
        """True when this process maps the node's segment (unknown counts as mapped)."""
        try:
            with open("/proc/self/maps") as f:
                return not self.shm_name or f"/dev/shm/{self.shm_name}" in f.read()
        except OSError:
            return True

    def _concurrent_row(self, op: Op, size: int, prefix: str, num_keys: int,
                        max_iters: int) -> Row:
        """All workers at once; throughput over the span from the first start to the last end.

        CPU: each worker's own over its timed loop (``client``, summed), the node's
        and the master's from the barrier that starts the loops to the last answer.
        """
        import threading

        cfg = self.cfg
        cfg.progress(f"kvstore {cfg.clients} clients {op} {format_size(size)}")
        for w, (_, pipe) in enumerate(self.workers):
            pipe.send((op, size, prefix, num_keys, w, cfg.duration_s, cfg.warmup_s,
                       max(4, max_iters // cfg.clients)))
        try:
            self.barrier.wait(timeout=cfg.warmup_s + 120)
            servers_before = self.server_cpu.sample()
        except threading.BrokenBarrierError:   # a worker failed: its answer says why
            servers_before = {}
        answers = []
        for _, pipe in self.workers:
            if not pipe.poll(cfg.duration_s + cfg.warmup_s + 120):
                raise RuntimeError("a concurrent client process stopped answering")
            answers.append(pipe.recv())
        servers = cpu_used(servers_before, self.server_cpu.sample())
        errors = [a[1] for a in answers if isinstance(a, tuple)]
        if errors:
            raise RuntimeError(f"concurrent {op} failed: {errors[0]}")
        if op == Op.PUT:
            self._remove([f"{prefix}w{w}/{j}" for w, a in enumerate(answers)
                          for j in range(a.total)])
        span = max(a.t0 + a.seconds for a in answers) - min(a.t0 for a in answers)
        ops = sum(a.ops for a in answers)
        row = rate_row(System.KVSTORE, DataPath.CONCURRENT, op, size, ops, span)
        return with_cpu(row, add_cpu(servers, *(a.cpu_s for a in answers)),
                        sum(a.timed_ops for a in answers),
                        max(self.server_cpu.tick_s, *(a.cpu_tick_s for a in answers)))

    def bench(self, size_bytes: int) -> list[Row]:
        cfg, batch, size = self.cfg, self.cfg.batch_keys, size_bytes
        prefix = f"bench/{self.run_id}/{size}/"
        src = Pool(size, cfg.pool_bytes, min_slots=batch, seed=1)
        dst = Pool(size, cfg.pool_bytes, min_slots=batch, seed=2)
        max_iters = max(8, cfg.max_put_bytes // size)
        rows = self._put_rows(size, prefix, src, max_iters)
        # The get working set: >= pool_bytes of values, written once, read in rotation.
        keys = [f"{prefix}ws/{j}" for j in range(max(batch, math.ceil(cfg.pool_bytes / size)))]
        for k in range(0, len(keys), batch):
            chunk = keys[k:k + batch]
            _check(self.kv_tcp.batch_put(chunk, [src[k + j] for j in range(len(chunk))]),
                   "batch_put")
        rows += self._get_rows(size, keys, src, dst)
        if not self.secured:
            rows += self._async_rows(size, prefix, keys, src, max_iters)
        if self.workers:
            rows.append(self._concurrent_row(Op.PUT, size, f"{prefix}conc/", len(keys),
                                             max_iters))
            rows.append(self._concurrent_row(Op.GET, size, f"{prefix}ws/", len(keys), max_iters))
        self._remove(keys)
        return rows

    def _async_rows(self, size: int, prefix: str, keys: list[str], src: Pool,
                    max_iters: int) -> list[Row]:
        """AsyncKVClient with 16 and 64 operations in flight: puts of fresh keys, then
        gets of the working set into preallocated buffers (``get_into``, as the sync
        rows), on an event loop of their own (a thread here).

        ``depth`` coroutines each run ``per_worker`` operations back to back per
        timed step, so ``depth`` stay in flight until the step's last ones end (a
        wave of ``depth`` gathered at once averaged half as many: the link idled
        while the client took in the answers). A step moves at most
        :data:`_ASYNC_STEP_BYTES`."""
        import asyncio
        import threading

        from kvstore.client.aio import AsyncKVClient

        cfg, rows = self.cfg, []
        dst = Pool(size, cfg.pool_bytes, min_slots=64, seed=3)   # a slot per get in flight
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="bench-asyncio", daemon=True)
        thread.start()

        def run(coro):
            return asyncio.run_coroutine_threadsafe(coro, loop).result()

        async def window(op, first: int, depth: int, per_worker: int):
            # op(j, w): the j-th operation of the row, by worker w (its own buffer)
            async def worker(w: int) -> None:
                for r in range(per_worker):
                    await op(first + r * depth + w, w)
            return await asyncio.gather(*[worker(w) for w in range(depth)],
                                        return_exceptions=True)

        tcp = AsyncKVClient(self.store_master, prefer_shm=False)
        shm = AsyncKVClient(self.store_master, prefer_shm=True)
        try:
            n = len(keys)
            for kv in (tcp, shm):
                run(kv.start())
                for j in range(0, n, 1000):      # warm its metadata cache, as the sync rows do
                    run(kv.lookup_cached(keys[j:j + 1000]))
            run(shm.warm_up())
            for path, depth, kv in ((DataPath.ASYNC_16, 16, tcp), (DataPath.ASYNC_64, 64, tcp),
                                    (DataPath.ASYNC_16_SHM, 16, shm)):
                p = f"{prefix}put-{path}/"
                per = max(1, min(8, _ASYNC_STEP_BYTES // (depth * size)))
                # Puts: at most max_iters keys in all, in two steps at least.
                per_put = max(1, min(per, max_iters // (2 * depth)))
                cfg.progress(f"kvstore {path} put {format_size(size)}")

                async def put_one(j: int, _w: int, kv=kv) -> None:
                    await kv.put(f"{p}{j}", src[j])

                def put_step(i: int) -> None:
                    _check(run(window(put_one, i * depth * per_put, depth, per_put)),
                           "async put")
                t = cfg.timed(put_step, max(2, max_iters // (depth * per_put)), cpu=self.cpu)
                rows.append(timed_row(System.KVSTORE, path, Op.PUT, size, t, depth * per_put))
                self._remove([f"{p}{j}" for j in range(t.total * depth * per_put)])
                cfg.progress(f"kvstore {path} get {format_size(size)}")

                async def get_one(j: int, w: int, kv=kv) -> None:
                    await kv.get_into(keys[j % n], dst[w])

                def get_step(i: int) -> None:
                    _check(run(window(get_one, i * depth * per, depth, per)), "async get_into")
                rows.append(timed_row(System.KVSTORE, path, Op.GET, size,
                                      cfg.timed(get_step, cpu=self.cpu), depth * per))
        finally:
            for kv in (tcp, shm):
                run(kv.close())
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
        return rows

    def bench_once(self) -> list[Row]:
        """The ``exists`` row, batch_exists of ``exists_keys`` keys just put, and the
        ``lookup`` row, a Lookup per key of them (plain cluster)."""
        cfg = self.cfg
        if self.secured:
            return []
        cfg.progress(f"kvstore batch_exists x{cfg.exists_keys}")
        keys = [f"bench/{self.run_id}/exists/{j}" for j in range(cfg.exists_keys)]
        _check(self.kv_tcp.batch_put(keys, [b"x" * 16] * len(keys)), "batch_put")

        def step(_i: int) -> None:
            if not all(self.kv_tcp.batch_exists(keys)):
                raise RuntimeError("batch_exists missed keys that were just put")
        t = cfg.timed(step, cpu=self.cpu)
        keys_per_s = t.ops * len(keys) / t.seconds
        row = Row(System.KVSTORE, DataPath.TCP, Op.EXISTS, 0, 0.0, keys_per_s)
        rows = [with_cpu(row, t.cpu_s, t.timed_ops * len(keys), t.cpu_tick_s)]
        cfg.progress(f"kvstore lookup x{cfg.exists_keys}")

        def lookups(_i: int) -> None:
            for key in keys:
                if isinstance(self.kv_tcp.lookup([key])[0], Exception):
                    raise RuntimeError(f"Lookup missed {key}, just put")
        t = cfg.timed(lookups, cpu=self.cpu)
        self._remove(keys)
        row = Row(System.KVSTORE, DataPath.TCP, Op.LOOKUP, 0, 0.0, t.ops * len(keys) / t.seconds)
        return rows + [with_cpu(row, t.cpu_s, t.timed_ops * len(keys), t.cpu_tick_s)]

    def stop(self) -> None:
        if self.scraper is not None:
            self.scraper.stop()
        stop_workers(self.workers)
        admin = self.kv_admin if self.kv_admin is not self.kv_tcp else None
        for kv in (self.kv_shm, self.kv_tcp, admin):
            if kv is not None:
                kv.close()
        self.procs.stop()


def start(cfg: BenchConfig, log_dir: str) -> KvstorePeer:
    """The kvstore cluster and its clients (always measured)."""
    return KvstorePeer(cfg, log_dir)
