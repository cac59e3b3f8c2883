"""The raw-socket limit: loopback TCP to a second process, no protocol beyond one request.

Rows (``socket``)::

    reqresp   get, put   one small request, one value back (or in), per round trip
    stream    get, put   values back to back on one connection: a request for
                         max(batch_keys, 16 MiB / size) values, then the values

The server (:func:`serve`, a spawned process) and this process both rotate
through cold pools of ``pool_bytes`` per size, so no value is in a cache when
it is sent or received; puts end with an 8-byte acknowledgement. CPU is
metered for the server process (``server``) and this one (``client``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
from typing import Callable

from kvstore.process import watch_parent
from kvstore.sizes import format_size
from kvstore.tools.bench.cpu import CpuMeter
from kvstore.tools.bench.harness import (BenchConfig, DataPath, MiB, Op, Peer, Pool, Row, System,
                                         timed_row)
from kvstore.transfer.protocol import recv_exact_into, send_parts, tune_socket

#: socket limit request: op (1 = send me values, 2 = take my values), count, size_bytes.
_SOCK_REQ = struct.Struct("<BxxxIQ")
_SOCK_GET, _SOCK_PUT = 1, 2


def serve(pipe, pool_bytes: int) -> None:
    """Serve raw values on loopback: no framing beyond the request, rotating cold slots."""
    watch_parent(os.getppid())              # a bench killed mid-run: do not wait in accept
    srv = socket.create_server(("127.0.0.1", 0))
    pipe.send(srv.getsockname()[1])
    pools: dict[int, Pool] = {}
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
                pool = pools.get(size) or pools.setdefault(size, Pool(size, pool_bytes))
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


class SocketPeer(Peer):
    """The :func:`serve` process, started here; its port is awaited by the first :meth:`bench`."""

    def __init__(self, cfg: BenchConfig):
        self.cfg = cfg
        ctx = mp.get_context("spawn")
        self._pipe, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(theirs, cfg.pool_bytes), daemon=True)
        self.proc.start()
        self._port: int | None = None

    def port(self) -> int:
        """The server's port, once it listens (it starts while the other systems do)."""
        if self._port is None:
            if not self._pipe.poll(60):
                raise RuntimeError("socket peer process did not start")
            self._port = self._pipe.recv()
        return self._port

    def bench(self, size_bytes: int) -> list[Row]:
        cfg, size = self.cfg, size_bytes
        port = self.port()
        src = Pool(size, cfg.pool_bytes, seed=1)
        dst = Pool(size, cfg.pool_bytes, seed=2)
        per_stream = max(cfg.batch_keys, (16 * MiB) // size)
        ack = memoryview(bytearray(8))
        cpu = CpuMeter({"server": self.proc.pid, "client": os.getpid()})
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

            for path, count in ((DataPath.REQRESP, 1), (DataPath.STREAM, per_stream)):
                for op, make in ((Op.GET, get), (Op.PUT, put)):
                    cfg.progress(f"socket {path} {op} {format_size(size)}")
                    t = cfg.timed(make(count), cpu=cpu)
                    rows.append(timed_row(System.SOCKET, path, op, size, t, count))
        return rows

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.join()


def start(cfg: BenchConfig, log_dir: str) -> SocketPeer:
    """The socket peer (always measured: it is a limit)."""
    return SocketPeer(cfg)
