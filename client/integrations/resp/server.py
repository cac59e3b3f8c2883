"""``kvstore resp``: the RESP listener, a worker thread per connection, one SDK client.

    kvstore resp --master ADDR [--host H] [--port N] [--auth FILE] [--token-file FILE]

The front is a client of the store (:class:`~kvstore.client.KVClient`: same-
host nodes over shared memory, others over TCP) and keeps no state of its
own beyond its connections, so as many fronts as wanted can stand behind a
load balancer. Each connection has a worker thread (kept for the next
connection when it ends, with its SDK data connections) that reads a
command, runs it and encodes the reply; replies are sent when no further command is already
received (pipelining of any depth costs one send per burst) or when 256 KiB
are waiting. A client that reads no replies blocks its own thread in send,
which stops reading it: the memory a connection holds stays bounded by one
command and the replies of one burst, and a burst of pipelined GETs or SETs
is cut at about 16 MiB of values (GETs by the size of the connection's last
values), so that is about what a connection holds.

Thread safety: the SDK client is shared by the connection threads (it is
thread-safe, its data connections are per thread). The open-connection
count (``--max-clients``) and the idle-worker count change under the
front's lock; the other :class:`FrontStats` counters are updated without
one (INFO's statistics; a lost increment is harmless).
"""

from __future__ import annotations

import errno
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

from kvstore.auth import Role, TokenFile
from kvstore.client.integrations.resp import data, verbs  # noqa: F401  (fill the command table)
from kvstore.client.integrations.resp.protocol import (CommandReader, Limits, ProtocolError,
                                                       RespError, encode)
from kvstore.client.integrations.resp.data import RUNS, ReplyBuffers
from kvstore.client.integrations.resp.table import Session, dispatch

log = logging.getLogger(__name__)

_FLUSH_BYTES = 256 * 1024
#: Pipelined GETs (or SETs) read as one batch: at most as many as a connection's reply
#: buffers can hold (ReplyBuffers.MAX_POOLED), and SET values of at most 16 MiB together.
_MAX_RUN = 32
_MAX_RUN_BYTES = 16 << 20
_IOV_MAX = 512                  # buffers per sendmsg (Linux allows 1024)
_ACCEPT_BACKOFF_S = (0.01, 1.0)  # first and longest wait after a failed accept
VERSION = "0.1.0"
#: ``--max-clients``: its default, and the most it may be (a worker thread and its
#: descriptors per connection).
DEFAULT_MAX_CLIENTS = 1000
MAX_CLIENTS = 65536


@dataclass(frozen=True, slots=True)
class FrontConfig:
    """What a RESP front serves, and its bounds."""

    master: str                         # a shard's masters, "host:port" or "a|b"
    host: str = "127.0.0.1"
    port: int = 0                       # 0: a free port
    auth: str = ""                      # --auth token file; "": every connection is admin
    max_clients: int = DEFAULT_MAX_CLIENTS   # more connections are answered -ERR and closed
    limits: Limits = field(default_factory=Limits)


@dataclass(slots=True)
class FrontStats:
    """Counters INFO reports."""

    connections: int = 0
    accepted: int = 0
    rejected: int = 0
    commands: int = 0
    hits: int = 0
    misses: int = 0
    sets: int = 0


class RespFront:
    """A RESP server over one SDK client.

    Args:
        cfg: the front's configuration.
        kv: the SDK client (a :class:`~kvstore.client.KVClient` or anything with its methods).

    Raises:
        OSError: the address cannot be bound.
        AuthFileError: a bad ``--auth`` file.
    """

    def __init__(self, cfg: FrontConfig, kv):
        self.cfg = cfg
        self.kv = kv
        self.master = cfg.master
        self.limits = cfg.limits
        self.max_clients = cfg.max_clients
        self.tokens = TokenFile(cfg.auth) if cfg.auth else None
        self.stats = FrontStats()
        self.version = VERSION
        self.started_s = time.monotonic()
        self._ids = iter(range(1, 1 << 62))
        self._stop = threading.Event()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()    # connections for the workers
        self._lock = threading.Lock()
        self._idle = 0                    # workers waiting on the queue
        self._policy = ""
        self._sock = socket.create_server((cfg.host, cfg.port), backlog=512)
        self.host, self.port = self._sock.getsockname()[:2]

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def eviction_policy(self) -> str:
        """The store nodes' eviction policy (their STATS), as INFO's maxmemory_policy;
        asked once, and again while a node cannot be reached."""
        if not self._policy:
            try:
                policies = {s.get("eviction_policy", "") for s in self.kv.node_stats().values()}
            except Exception:             # an unreachable node: asked again next time
                return "unknown"
            self._policy = ",".join(sorted(p for p in policies if p)) or "node-policy"
        return self._policy

    # ---- serving ----
    def serve_forever(self) -> None:
        """Accept connections until :meth:`stop`; each goes to a worker thread."""
        self._sock.settimeout(0.5)
        backoff_s = _ACCEPT_BACKOFF_S[0]
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except socket.timeout:
                continue
            except OSError as exc:
                if self._stop.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                    break
                # Out of fds (EMFILE, ENFILE: --max-clients above what the fd limit
                # allows) or memory: the client waits in the listen queue; back off,
                # say so once, and accept again when connections have closed.
                if backoff_s == _ACCEPT_BACKOFF_S[0]:
                    log.error("RESP front cannot accept connections: %s; retrying (raise "
                              "the fd limit, ulimit -n, or lower --max-clients)", exc)
                time.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, _ACCEPT_BACKOFF_S[1])
                continue
            if backoff_s != _ACCEPT_BACKOFF_S[0]:
                log.info("RESP front accepts connections again")
                backoff_s = _ACCEPT_BACKOFF_S[0]
            self.stats.accepted += 1
            if self.stats.connections >= self.max_clients:
                self.stats.rejected += 1
                _refuse(conn)
                continue
            with self._lock:
                self.stats.connections += 1
            self._hand_over(conn, peer)
        self._sock.close()

    def _hand_over(self, conn: socket.socket, peer) -> None:
        """Give a connection to an idle worker thread, or to a new one. Workers live on
        after their connection ends: their SDK data connections (shared memory, an
        authenticated socket per node) are opened once, not per Redis connection."""
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._worker, daemon=True,
                                 name=f"resp-worker-{self.stats.accepted}").start()
        self._queue.put((conn, peer))

    def _worker(self) -> None:
        while True:
            conn, peer = self._queue.get()
            try:
                self._connection(conn, peer)
            except Exception:             # a bug: logged; the worker serves the next one
                log.exception("RESP connection from %s failed", peer)
            finally:
                with self._lock:
                    self._idle += 1

    def stop(self) -> None:
        self._stop.set()

    def recheck(self, session: Session) -> None:
        """A session's AUTH against the reloaded ``--auth`` file (:func:`verbs.recheck`)."""
        verbs.recheck(self, session)

    def _connection(self, conn: socket.socket, peer) -> None:
        conn.setblocking(True)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        session = Session(next(self._ids), f"{peer[0]}:{peer[1]}",
                          Role.ADMIN if self.tokens is None else None, buffers=ReplyBuffers())
        out: list = []
        pending = 0

        def flush() -> None:
            nonlocal pending
            send_all(conn, out)
            out.clear()
            session.buffers.recycle()     # the values in them are sent
            pending = 0

        def before_recv() -> None:
            # The next command is not all here: answer the complete ones before it
            # now, unless more bytes already wait (a pipeline keeps its one send).
            if out and not _readable(conn):
                flush()

        reader = CommandReader(conn.recv_into, self.limits, before_recv=before_recv)
        try:
            while not session.closing:
                before = len(out)
                try:
                    args = reader.read_command()
                    if args is None:
                        break
                    kind = batchable(args)
                    if kind is not None and (reader.complete_buffered() or _readable(conn)):
                        args = self._run(conn, session, reader, args, kind, out)
                except ProtocolError as err:      # after the replies of a run before it
                    out.append(RespError(f"Protocol error: {err}").line())
                    break
                if args:
                    encode(dispatch(self, session, args), session.proto, out)
                pending += sum(len(b) if not isinstance(b, memoryview) else b.nbytes
                               for b in out[before:])
                if pending >= _FLUSH_BYTES or not reader.buffered():
                    flush()
            send_all(conn, out)
        except EOFError:                    # the stream ended inside a command: answer the
            try:                            # complete ones before it, as Redis does
                send_all(conn, out)
            except OSError:
                pass
        except OSError:
            pass                            # the peer went away; nothing to answer
        finally:
            with self._lock:
                self.stats.connections -= 1
            conn.close()

    def _run(self, conn: socket.socket, session: Session, reader: CommandReader, first: list,
             kind: str, out: list):
        """Pipelined GETs (or plain SETs) already received, answered with one batch
        call of the SDK (reads or puts in parallel, one Lookup per shard).

        Returns:
            The command that ended the run (to run next), or None.

        Raises:
            ProtocolError, EOFError: as :meth:`CommandReader.read_command`.
        """
        # A run's replies are all held until it is answered, so GETs count what their
        # values are expected to take: the largest of the connection's last run (8 MiB
        # before its first). A client that pipelines large GETs and reads nothing
        # holds about _MAX_RUN_BYTES of replies in the front, not _MAX_RUN values.
        run, nxt, failure = [first], None, None
        get_bytes = session.get_bytes_hint
        held = len(first[-1]) if kind == "SET" else get_bytes
        # Only a command that is all here (or bytes still arriving) joins the run: the
        # run's replies must not wait for a command the client has not finished.
        while (reader.complete_buffered() or _readable(conn)) and len(run) < _MAX_RUN and \
                held < _MAX_RUN_BYTES:
            try:
                args = reader.read_command()
            except (ProtocolError, EOFError) as err:    # raised once the run is answered
                failure = err
                break
            if args is None:
                break
            if batchable(args) != kind:
                nxt = args
                break
            run.append(args)
            held += len(args[-1]) if kind == "SET" else get_bytes
        replies = RUNS[kind](self, session, run)
        if kind == "GET":
            sizes = [len(r) for r in replies if isinstance(r, (bytes, bytearray, memoryview))]
            if sizes:
                session.get_bytes_hint = max(1, max(sizes))
        for reply in replies:
            encode(reply, session.proto, out)
        if failure is not None:
            raise failure
        return nxt


def _readable(conn: socket.socket) -> bool:
    """Whether more bytes from the client wait in the socket (without blocking)."""
    try:
        return bool(conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False


def batchable(args: list) -> str | None:
    """"GET" for ``GET key``, "SET" for ``SET key value`` (no options), else None."""
    if len(args) in (2, 3) and len(args[0]) == 3:
        name = bytes(args[0]).upper()
        if (name, len(args)) in ((b"GET", 2), (b"SET", 3)):
            return name.decode()
    return None


def send_all(conn: socket.socket, bufs: list) -> None:
    """Send every buffer of ``bufs`` in order (sendmsg: no joining copy)."""
    views = [memoryview(b).cast("B") for b in bufs]
    i = 0
    while i < len(views):
        sent = conn.sendmsg(views[i:i + _IOV_MAX])
        while sent and i < len(views):       # advance past what went out
            n = views[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                views[i] = views[i][sent:]
                sent = 0
        while i < len(views) and not views[i].nbytes:
            i += 1


def _refuse(conn: socket.socket) -> None:
    try:
        conn.sendall(b"-ERR max number of clients reached\r\n")
    except OSError:
        pass
    conn.close()


def serve(cfg: FrontConfig, kv) -> None:
    """Run a front until SIGTERM / SIGINT; prints ``READY {json}`` once it listens."""
    import signal

    from kvstore.process import announce_ready

    front = RespFront(cfg, kv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: front.stop())
    if front.tokens is not None and hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, lambda *_: front.tokens.reload())
    announce_ready({"address": front.address, "host": front.host, "port": front.port,
                    "master": cfg.master, "auth": front.tokens is not None})
    log.info("RESP front on %s over master %s", front.address, cfg.master)
    front.serve_forever()
