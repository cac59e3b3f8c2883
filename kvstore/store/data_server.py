"""The store node's data server: its listeners, the accept loops, one thread per connection.

Each accepted connection runs a :class:`kvstore.store.session.Session` (the
frame loop; what a connection owns and how writes are acknowledged is
described there). The accept loop survives running out of file descriptors
(it backs off, counts ``accept_errors`` and reports the node degraded until
it accepts again), and connections over ``max_connections`` are answered
UNAVAILABLE and closed before the process could run out.

Thread safety: connection threads share only the :class:`StoreNode`, which
locks itself.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import ssl
import threading
import time

from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import TokenFile
from kvstore.errors import Unavailable
from kvstore.store.node import StoreNode
from kvstore.store.polling import POLL_S, Pollers
from kvstore.store.session import Session
from kvstore.store.stats import NodeCounter
from kvstore.store.traffic import Traffic
from kvstore.transfer.protocol import RESPONSE, keep_alive, tune_socket

log = logging.getLogger(__name__)
_TLS_HANDSHAKE_S = 10.0
_ACCEPT_BACKOFF_S = (0.01, 1.0)     # first and longest wait after a failed accept
_FD_RESERVE = 128                   # fds kept for the node's own files, sockets and channels


def default_max_connections() -> int:
    """The fd soft limit less a reserve (at least 16): the cap on data connections
    bites before the process runs out of descriptors."""
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(16, soft - _FD_RESERVE)




class DataServer:
    """Serves a :class:`StoreNode` over TCP, and over a Unix socket for clients on this host.

    Args:
        node: the object table to serve.
        host: bind address (loopback by default).
        port: 0 picks a free port; see :attr:`port` after :meth:`start`.
        local_address: also listen on this Unix socket address (see
            :func:`kvstore.transfer.protocol.local_address`); the same frames,
            without the TCP stack's cost per request (shared-memory clients
            send one small frame per get).
        rdma: the node's :class:`~kvstore.transfer.rdma.RdmaNodeEndpoint`
            (its DRAM segment registered): connections may then ask for a
            queue pair with RDMA_CONNECT and move bytes one-sided. None: that
            op answers UNAVAILABLE.
        ack_timeout_s: how long a write waits for its master to apply its
            STORED event before it fails with UNAVAILABLE.
        tokens: authenticate every connection, TCP and Unix socket (the
            handshake in :mod:`kvstore.transfer.protocol`); None: trust them.
        tls: a server context (:func:`kvstore.tls.server_context`): the TCP
            port speaks TLS (the Unix socket, same host only, does not).
        max_connections: data connections (TCP and Unix socket) open at once, at
            most; one more is answered UNAVAILABLE ("too many connections") and
            closed (counted ``connections_refused``). None: the fd limit less a
            reserve (:func:`default_max_connections`), so the cap comes first.
        write_timeout_s: longest wait (s) for the rest of a value being written
            (a PUT's bytes, or the SHM_COMMIT of a reservation); a writer that
            stalls longer loses its connection and its reservation, counted as
            ``stalled_writes``, so a stalled client never holds space for long.
        send_timeout_s: longest wait (s) for a reader to take any byte of its
            replies; a reader that stops reading (or whose host is gone: TCP
            keepalive and ``TCP_USER_TIMEOUT`` bound that by the same time, see
            :func:`~kvstore.transfer.protocol.keep_alive`) loses its connection
            and the objects it was being sent are released, counted as
            ``stalled_reads``. None: ``write_timeout_s``.
        metrics: a :class:`kvstore.metrics.ProcessMetrics`: every request is
            counted and timed on its connection's own tally; None: not timed.
            Bytes and connections are counted in :attr:`traffic` either way.
        lease: reads and writes only while it holds (a node linked to master
            shards: :mod:`kvstore.store.lease`); None: always.
        poll_s: how long a connection busy-polls for its client's next request
            after answering (0: never; None: POLL_S; :mod:`kvstore.store.polling`).

    Raises:
        OSError: an address is taken.
        ValueError: ``poll_s`` outside [0, 1].
    """

    def __init__(self, node: StoreNode, host: str = "127.0.0.1", port: int = 0,
                 local_address: str | None = None, rdma=None, ack_timeout_s: float = 2.0,
                 tokens: TokenFile | None = None, tls: ssl.SSLContext | None = None,
                 metrics=None, write_timeout_s: float = 30.0,
                 max_connections: int | None = None, lease=None,
                 send_timeout_s: float | None = None, poll_s: float | None = None):
        self.node = node
        self.lease = lease               # a kvstore.store.lease.MasterLease, or None (no master)
        self.metrics = metrics           # a kvstore.metrics.ProcessMetrics, or None
        self.write_timeout_s = write_timeout_s
        self.send_timeout_s = send_timeout_s or write_timeout_s
        self.max_connections = max_connections or default_max_connections()
        self.degraded = ""               # why new connections cannot be accepted now ("": they can)
        self.traffic = Traffic()
        self.rdma = rdma
        self.ack_timeout_s = ack_timeout_s
        self.tokens = tokens
        serving = getattr(node.tier, "serving", None)
        if tokens is not None and serving is not None:
            # A reload may take a token's keys away: native GETs go back to Python's check.
            tokens.on_reload.append(lambda _table: serving.bump_epoch())
        self.tls = tls
        self._listeners = [socket.create_server((host, port), backlog=128)]
        self.host = host
        self.port = self._listeners[0].getsockname()[1]
        if local_address:
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                unix.bind(local_address)
                unix.listen(128)
            except OSError:
                unix.close()
                self._listeners[0].close()
                raise
            self._listeners.append(unix)
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        # Sessions polling at once: one core is left for clients and the node's
        # other work (four pollers on two cores cost concurrent clients a third).
        self._pollers = Pollers(max(1, (os.cpu_count() or 2) - 1),
                               POLL_S if poll_s is None else poll_s)
        self._acceptors = [threading.Thread(target=self._accept_loop, args=(sock,),
                                            name="data-accept", daemon=True)
                           for sock in self._listeners]

    def start(self) -> "DataServer":
        for t in self._acceptors:
            t.start()
        return self

    def stop(self) -> None:
        """Stop accepting, close every connection, wait for their threads."""
        self._stopping.set()
        for sock in self._listeners:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self._threads):
            t.join(timeout=5)

    def _accept_loop(self, listener: socket.socket) -> None:
        backoff = _ACCEPT_BACKOFF_S[0]
        while not self._stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                if self._stopping.is_set() or exc.errno in (errno.EBADF, errno.EINVAL):
                    return           # the listener is closed: the server is stopping
                # Out of fds (EMFILE, ENFILE) or memory: the connection waits in the
                # listen queue; back off, say so, and accept again once fds are free.
                self.node.count(NodeCounter.ACCEPT_ERRORS)
                if not self.degraded:
                    log.error("data port cannot accept connections: %s; retrying", exc)
                self.degraded = f"cannot accept connections: {exc.strerror or exc}"
                time.sleep(backoff)
                backoff = min(backoff * 2, _ACCEPT_BACKOFF_S[1])
                continue
            backoff = _ACCEPT_BACKOFF_S[0]
            if self.degraded:
                log.info("data port accepts connections again")
                self.degraded = ""
            with self._lock:
                full = len(self._conns) >= self.max_connections
            if full:
                self._refuse(conn)
                continue
            tune_socket(conn)
            keep_alive(conn, self.send_timeout_s)
            t = threading.Thread(target=self._serve, args=(conn,), name="data-conn", daemon=True)
            with self._lock:
                self._conns.add(conn)
                self._threads.add(t)
            t.start()

    def _refuse(self, conn: socket.socket) -> None:
        """Answer a connection over the cap with UNAVAILABLE, then close it."""
        self.node.count(NodeCounter.CONNECTIONS_REFUSED)
        msg = (f"too many connections to this node ({self.max_connections}); retry later "
               f"or on another replica").encode()
        try:
            conn.settimeout(0.5)
            conn.sendall(RESPONSE.pack(pb.UNAVAILABLE, 0, len(msg), 0, 0, 0, 0, 0, 0) + msg)
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        raw = conn
        try:
            if self.tls is not None and conn.family != socket.AF_UNIX:
                # The handshake runs in the connection's thread, never in the accept loop.
                conn.settimeout(_TLS_HANDSHAKE_S)
                conn = self.tls.wrap_socket(conn, server_side=True)
                conn.settimeout(None)
        except OSError as exc:
            log.info("TLS handshake with a data client failed: %s", exc)
            with self._lock:
                self._conns.discard(raw)
                self._threads.discard(threading.current_thread())
            raw.close()
            return
        transport = "shm" if raw.family == socket.AF_UNIX else "tcp"
        session = Session(self.node, conn, self.rdma, self._pollers, self.ack_timeout_s,
                           self.tokens, self.metrics.tally() if self.metrics else None,
                           self.write_timeout_s, self.lease, self.send_timeout_s)
        self.traffic.opened(transport, session)
        try:
            session.run()
        except Unavailable:
            pass  # peer went away
        except Exception:  # a bug: log it loudly, drop the connection
            log.exception("data connection failed")
        finally:
            session.release_all()
            conn.close()
            self.traffic.closed(transport, session)
            if session.tally is not None:
                self.metrics.release(session.tally)
            with self._lock:
                self._conns.discard(raw)
                self._threads.discard(threading.current_thread())


