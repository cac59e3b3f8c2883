"""Mooncake Store as a peer of ``kvstore bench`` (optional): rows ``mooncake tcp put / get``.

Measured when its CPU build is installed::

    apt-get install libibverbs1 librdmacm1 libnuma1 ibverbs-providers
    pip install mooncake-transfer-engine-non-cuda

Layout, all on loopback: ``mooncake_master`` on free ports; a *holder*
process that mounts a global segment and does nothing else; a *client*
process that mounts no segment, so every value it puts and gets crosses
processes through Mooncake's TCP transport. Both use ``P2PHANDSHAKE``
metadata (no etcd or HTTP metadata server).

The client works like kvstore's rows: values rotate through cold source and
destination pools (registered with ``register_buffer``); puts use
``put_from`` (zero copy from a registered buffer) on fresh keys; gets read a
working set of >= ``pool_bytes`` in rotation, both with ``get_into`` into the
registered pool and with ``get`` (a new ``bytes``), and the faster of the two
is reported: the peer gets its best single-key get.

CPU is metered for ``master`` (mooncake_master), ``holder`` (its TCP
transport's threads receive and send the values) and ``client`` (the
client process, where the timed loop runs).

Mooncake reports failures as negative return codes; any one fails the row.
"""

from __future__ import annotations

import importlib.util
import math
import multiprocessing as mp
import os
import shutil
import subprocess
import time

from kvstore.process import watch_parent
from kvstore.tools.bench.cpu import CpuMeter
from kvstore.tools.bench.harness import (BenchConfig, DataPath, MiB, Op, Peer, Pool, Row, System,
                                         stop_workers, timed, timed_row)
from kvstore.tools.cluster.processes import free_port, stop_with_launcher, terminate

HOST = "127.0.0.1"
#: Local buffer of each Mooncake client (staging for get / put of Python buffers).
LOCAL_BUFFER_BYTES = 64 * MiB
#: Puts per size are capped here (keys are removed after each size).
PUT_CAP_BYTES = 256 * MiB


def master_binary() -> str | None:
    """Path of ``mooncake_master`` from the installed wheel, or None."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, "mooncake_master")
        if os.access(path, os.X_OK):
            return path
    return shutil.which("mooncake_master")


def _quiet(log_path: str) -> None:
    """Send this process's stderr (Mooncake's glog lines) to ``log_path``; stop with the
    bench (Mooncake's threads kept a holder and its segment alive after the bench died)."""
    watch_parent(os.getppid())
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)


def _store(master: str, segment_bytes: int):
    from mooncake.store import MooncakeDistributedStore

    st = MooncakeDistributedStore()
    rc = st.setup(HOST, "P2PHANDSHAKE", segment_bytes, LOCAL_BUFFER_BYTES, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return st


def _holder_main(log_path: str, master: str, segment_bytes: int, pipe) -> None:
    """Process A: holds the segment every value lives in, until told to stop."""
    _quiet(log_path)
    try:
        st = _store(master, segment_bytes)
    except Exception as exc:  # reported to the parent, which skips Mooncake with a note
        pipe.send(("error", repr(exc)))
        return
    pipe.send("ready")
    pipe.recv()
    st.close()


def _client_main(log_path: str, master: str, pipe) -> None:
    """Process B: runs ``(size, cfg fields, server pids)`` commands, answers (put Timing,
    get Timing), each metering the CPU of ``master``, ``holder`` (their pids) and this
    process (``client``)."""
    _quiet(log_path)
    try:
        st = _store(master, 0)
    except Exception as exc:
        pipe.send(("error", repr(exc)))
        return
    pipe.send("ready")
    while (cmd := pipe.recv()) is not None:
        size, pool_bytes, duration_s, warmup_s, rounds, servers = cmd
        cpu = CpuMeter({**servers, "client": os.getpid()})
        try:
            src = Pool(size, pool_bytes, seed=1)
            dst = Pool(size, pool_bytes, seed=2)
            for pool in (src, dst):
                if st.register_buffer(pool.buf.ctypes.data, pool.buf.nbytes) != 0:
                    raise RuntimeError("register_buffer failed")
            ptr = lambda pool, i: pool.buf.ctypes.data + (i % pool.num_slots) * size  # noqa: E731

            def ok(rc: int, what: str) -> None:
                if rc < 0:
                    raise RuntimeError(f"mooncake {what} returned {rc}")

            prefix = f"bench/{os.getpid()}/{size}/"
            put_t = timed(lambda i: ok(st.put_from(f"{prefix}put/{i}", ptr(src, i), size),
                                       "put_from"),
                          duration_s, warmup_s, max(8, PUT_CAP_BYTES // size), rounds=rounds,
                          cpu=cpu)
            for i in range(put_t.total):
                st.remove(f"{prefix}put/{i}", True)
            keys = [f"{prefix}ws/{j}" for j in range(max(2, math.ceil(pool_bytes / size)))]
            for j, k in enumerate(keys):
                ok(st.put_from(k, ptr(src, j), size), "put_from")
            n = len(keys)

            def get_into(i: int) -> None:
                if st.get_into(keys[i % n], ptr(dst, i), size) != size:
                    raise RuntimeError("mooncake get_into returned a wrong size")

            def get(i: int) -> None:
                if len(st.get(keys[i % n])) != size:
                    raise RuntimeError("mooncake get returned a wrong size")
            gets = [timed(f, duration_s, warmup_s, rounds=rounds, cpu=cpu)
                    for f in (get_into, get)]
            best = max(gets, key=lambda t: t.ops / t.seconds)
            for k in keys:
                st.remove(k, True)
            for pool in (src, dst):
                st.unregister_buffer(pool.buf.ctypes.data)
            pipe.send((put_t, best))
        except Exception as exc:
            pipe.send(("error", repr(exc)))
    st.close()


class MooncakePeer(Peer):
    """mooncake_master + holder + client, started here; :meth:`stop` ends all three.

    Raises:
        RuntimeError: a part did not start (the caller skips Mooncake with a note).
    """

    def __init__(self, exe: str, cfg: BenchConfig, log_dir: str):
        self.cfg = cfg
        self.procs: list = []
        rpc_port, metrics_port = free_port(), free_port()
        self.master = f"{HOST}:{rpc_port}"
        os.makedirs(log_dir, exist_ok=True)     # --log-dir need not exist yet
        self._log = open(os.path.join(log_dir, "mooncake_master.log"), "wb")
        self.master_proc = subprocess.Popen(
            [exe, f"--rpc_port={rpc_port}", f"--rpc_address={HOST}",
             f"--metrics_port={metrics_port}", f"--metrics_host={HOST}",
             "--enable_metric_reporting=false"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=stop_with_launcher)
        try:
            self._wait_port(rpc_port)
            # Every size's working set and capped puts fit, so the master never evicts (90 %).
            segment = 2 * (len(cfg.sizes_bytes) * 2 * cfg.pool_bytes + PUT_CAP_BYTES)
            ctx = mp.get_context("spawn")
            self.holder_pipe = self._spawn(ctx, _holder_main,
                                           os.path.join(log_dir, "mooncake_holder.log"),
                                           self.master, segment)
            self.servers = {"master": self.master_proc.pid, "holder": self.procs[0][0].pid}
            self.client_pipe = self._spawn(ctx, _client_main,
                                           os.path.join(log_dir, "mooncake_client.log"),
                                           self.master)
        except BaseException:
            self.stop()
            raise

    def _wait_port(self, port: int) -> None:
        import socket

        deadline = time.monotonic() + 20
        while True:
            if self.master_proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.master_proc.returncode}")
            try:
                with socket.create_connection((HOST, port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mooncake_master is not listening on port {port}")
                time.sleep(0.1)

    def _spawn(self, ctx, target, *args):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=target, args=(*args, theirs), daemon=True)
        p.start()
        self.procs.append((p, ours))   # only started processes: stop() joins them
        if not ours.poll(60):
            raise RuntimeError(f"{target.__name__} did not start")
        answer = ours.recv()
        if answer != "ready":
            raise RuntimeError(f"{target.__name__}: {answer[1]}")
        return ours

    def bench(self, size_bytes: int) -> list[Row]:
        cfg, size = self.cfg, size_bytes
        cfg.progress(f"mooncake put/get {size} B")
        self.client_pipe.send((size, cfg.pool_bytes, cfg.duration_s, cfg.warmup_s, cfg.rounds,
                               self.servers))
        if not self.client_pipe.poll(4 * (cfg.duration_s + cfg.warmup_s) + 120):
            raise RuntimeError("the mooncake client stopped answering")
        answer = self.client_pipe.recv()
        if isinstance(answer[0], str):
            raise RuntimeError(f"mooncake: {answer[1]}")
        put_t, get_t = answer
        return [timed_row(System.MOONCAKE, DataPath.TCP, Op.PUT, size, put_t),
                timed_row(System.MOONCAKE, DataPath.TCP, Op.GET, size, get_t)]

    def stop(self) -> None:
        stop_workers(self.procs, timeout_s=10)
        terminate(self.master_proc, timeout_s=10)
        self._log.close()


def start(cfg: BenchConfig, log_dir: str) -> MooncakePeer | None:
    """The Mooncake peer, or None (with a note) when it is off, not installed or will not start."""
    if not cfg.use_mooncake:
        return None
    exe = master_binary()
    if exe is None:
        cfg.note("mooncake: skipped (not installed: pip install mooncake-transfer-engine-non-cuda;"
                 " it needs Debian's libibverbs1 librdmacm1 libnuma1 ibverbs-providers)")
        return None
    try:
        peer = MooncakePeer(exe, cfg, log_dir)
    except RuntimeError as exc:
        cfg.note(f"mooncake: skipped ({exc})")
        return None
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("mooncake-transfer-engine-non-cuda")
    except PackageNotFoundError:
        v = "unknown version"
    cfg.note(f"mooncake: Mooncake Store {v}, TCP transport, P2PHANDSHAKE; get = the faster of "
             "get_into and get")
    return peer
