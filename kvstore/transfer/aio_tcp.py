"""The asyncio SDK's data plane: one pipelined TCP connection per node.

A request writes its frame (and value) and queues its future in the same
step, with no await between, so frames and futures keep one order; answers
are decoded by :class:`~kvstore.transfer.framing.AnswerReader` (the
frames, the read-ahead, values received straight into their buffers) and
resolve the futures in that order. 64 coroutines fill the link as a
pipelined batch does. Values go out from the caller's buffer, on a plain
connection in one gathered ``sendmsg`` with the frames queued before them (one
wake-up of the node per value, not two); a connection whose unsent bytes pass
:data:`HIGH_WATER_BYTES` makes new requests wait.

An answer that does not come within the timeout breaks the connection (its
order can no longer be trusted): every pending future fails Unavailable and
the next request opens a new connection; one timer per connection watches the
oldest answer. A request may wait less (``timeout_s``) or be cancelled: its
answer, still to come in order, is read and dropped.

Thread safety: one event loop; a connection is used from that loop only.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time

from kvstore.auth import proof
from kvstore.transfer.framing import AnswerReader, encode_request
from kvstore.transfer.reply import Reply
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.rpc import MAX_MESSAGE_BYTES
from kvstore.transfer.protocol import Op, hello_nonce_bytes, tune_socket

#: A value up to this size is copied behind its frame; a loop iteration's frames go in one send.
_JOIN_BELOW_BYTES = 16 << 10
#: Unsent bytes above which requests wait for the socket (resume below a quarter).
HIGH_WATER_BYTES = 4 << 20


def _byte_view(payload, size: int) -> memoryview:
    """``payload`` as a flat byte view of ``size`` bytes (lengths then count bytes).

    Raises:
        InvalidArgument: not a contiguous bytes-like object of ``size`` bytes.
    """
    try:
        view = memoryview(payload)
        if not view.c_contiguous:
            raise BufferError("not C-contiguous")
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    except (TypeError, ValueError, BufferError) as exc:
        raise InvalidArgument(f"a value must be contiguous bytes: {exc}") from None
    if len(view) != size:
        raise InvalidArgument(f"a value of {len(view)} B announced as {size} B")
    return view


class _Overdue(Exception):
    """A request's own wait ended before its answer came (see :meth:`AsyncNodeConnection.request`)."""


def _dropped(fut: asyncio.Future) -> None:
    """A :meth:`AsyncNodeConnection.send_only` answer: taken, so that asyncio never
    reports an exception (a broken connection's) nobody retrieved."""
    if not fut.cancelled():
        fut.exception()


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(_Overdue())


async def _connected(host: str, port: int) -> socket.socket:
    """A non-blocking TCP socket connected to ``host``:``port`` (each address in turn).

    Raises:
        OSError: no address could be connected.
    """
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"no address for {host[:80]}")
    for family, type_, proto, _name, address in infos:
        sock = socket.socket(family, type_, proto)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error


class AsyncNodeConnection(asyncio.BufferedProtocol):
    """A pipelined connection to one store node (open with :meth:`open`).

    Args:
        timeout_s: how long one answer may take.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.broken: KVStoreError | None = None
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._reader = AnswerReader()
        self._writable: asyncio.Future | None = None    # set while writing is paused
        self._out = bytearray()          # frames (and small values) not written yet
        self._out_scheduled = False
        self._sock: socket.socket | None = None     # a plain connection's (not TLS) socket
        self._watch = self._loop.call_later(timeout_s / 4, self._check_overdue)

    @classmethod
    async def open(cls, host: str, port: int, *, timeout_s: float = 10.0,
                   token: str | None = None, tls: ssl.SSLContext | None = None
                   ) -> "AsyncNodeConnection":
        """Connect (and authenticate with ``token``, when given).

        Raises:
            Unavailable: the node cannot be reached. Unauthenticated: a refused token.
        """
        conn = cls(timeout_s)
        loop = asyncio.get_running_loop()
        try:
            if tls is None:         # our own socket: a value goes out with its frame
                conn._sock = await asyncio.wait_for(_connected(host, port), timeout_s)
                await loop.create_connection(lambda: conn, sock=conn._sock)
            else:
                await asyncio.wait_for(loop.create_connection(
                    lambda: conn, host, port, ssl=tls, server_hostname=host), timeout_s)
        except (OSError, asyncio.TimeoutError, UnicodeError, ValueError, OverflowError) as exc:
            if conn._sock is not None and conn._transport is None:
                conn._sock.close()
            conn._watch.cancel()
            raise Unavailable(f"cannot connect to store node {host[:80]}:{port}: "
                              f"{exc or type(exc).__name__}") from None
        try:
            if token:
                hello = await conn.request(Op.AUTH_HELLO, "")
                if hello_nonce_bytes(hello.code, hello.size, hello.message):
                    answer = proof(token, bytes(hello.value))
                    err = (await conn.request(Op.AUTH_PROVE, "", size=len(answer),
                                              payload=answer)).error()
                    if err is not None:
                        raise err
        except BaseException:
            conn.close()
            raise
        return conn

    async def request(self, op: Op, key: str, object_id: int = 0, size: int = 0,
                      checksum: int = 0, payload=None, parent: str = "",
                      flags: int = 0, max_value_bytes: int = MAX_MESSAGE_BYTES,
                      into: memoryview | None = None,
                      timeout_s: float | None = None, on_queued=None) -> Reply:
        """Send one frame (with ``payload``, a bytes-like of ``size`` bytes) and await
        its answer. A value answered (GET, STATS, AUTH_HELLO) may have at most
        ``max_value_bytes`` (``len(into)`` with ``into``), else the connection breaks;
        it is received into ``into`` when given, else into a new bytearray.

        Args:
            timeout_s: wait this long at most when less than the connection's timeout.
            on_queued: called once the frame is queued (its answer will come, whether
                or not this coroutine still waits for it).

        Raises:
            Unavailable: the connection broke or the answer did not come in time.
            InvalidArgument: ``payload`` is not ``size`` contiguous bytes (nothing is
                sent or queued: the other requests on the connection go on).
        """
        value = _byte_view(payload, size) if payload is not None and size else None
        while self._writable is not None and self.broken is None:
            await asyncio.shield(self._writable)
        if self.broken is not None:
            raise self.broken
        fut = self._loop.create_future()
        self._out += encode_request(op, key, object_id, size, checksum, parent, flags)
        if value is not None:
            if size <= _JOIN_BELOW_BYTES:
                self._out += value
            else:                          # a large value goes from the caller's buffer
                self._write_with(value)
                if self.broken is not None:    # the send failed: no answer will come
                    raise self.broken
        if self._out and not self._out_scheduled:
            self._out_scheduled = True     # the frames of this loop iteration, one send
            self._loop.call_soon(self._write_out)
        self._reader.expect(fut, op, max_value_bytes, into)
        if on_queued is not None:
            on_queued()
        if timeout_s is None or timeout_s >= self.timeout_s:
            timer = None                   # the connection's own timer watches it
        else:                              # a plain timer: asyncio.timeout costs twice as much
            timer = self._loop.call_at(self._loop.time() + max(0.0, timeout_s), _expire, fut)
        try:
            return await fut
        except _Overdue:
            self._reader.abandon(fut)
            raise Unavailable(f"no answer from the node within {timeout_s:.3g} s") from None
        except asyncio.CancelledError:
            self._reader.abandon(fut)
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def unanswered(self) -> int:
        """Requests sent or queued whose answers have not been read yet."""
        return len(self._reader.pending)

    def send_only(self, op: Op, key: str, object_id: int = 0) -> None:
        """Queue a value-less frame whose answer nobody waits for (SHM_TOUCH, SHM_RELEASE,
        SHM_ABORT): it goes out with this loop iteration's frames (at once past
        :data:`_JOIN_BELOW_BYTES` queued, for a caller that never yields), and its
        answer, an error too, is read and dropped. Nothing on a broken connection."""
        if self.broken is not None:
            return
        fut = self._loop.create_future()
        fut.add_done_callback(_dropped)
        self._out += encode_request(op, key, object_id)
        self._reader.expect(fut, op, 0, None)
        if len(self._out) >= _JOIN_BELOW_BYTES and self._writable is None:
            self._write_out()
        elif not self._out_scheduled:
            self._out_scheduled = True
            self._loop.call_soon(self._write_out)

    def _write_with(self, payload: memoryview) -> None:
        """The frames queued so far, then ``payload``: in one gathered ``sendmsg`` (one
        TCP segment train and one wake-up of the node, not two) on a plain socket whose
        transport has nothing buffered; what the kernel did not take, and everything
        on a TLS connection, goes through the transport, in order."""
        out, self._out = self._out, bytearray()
        if self.broken is not None:
            return
        sent = 0
        if self._sock is not None and not self._transport.get_write_buffer_size():
            try:
                sent = self._sock.sendmsg([out, payload])
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as exc:
                self._break(Unavailable(f"sending to the node failed: {exc}"))
                return
        if sent < len(out):
            self._transport.write(memoryview(out)[sent:])
            self._transport.write(payload)
        elif sent < len(out) + len(payload):
            self._transport.write(payload[sent - len(out):])

    def _write_out(self) -> None:
        self._out_scheduled = False
        if self._out and self.broken is None:
            out, self._out = self._out, bytearray()
            self._transport.write(out)

    # ---- the protocol's callbacks ----
    def connection_made(self, transport) -> None:
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                tune_socket(sock)
            except OSError:
                pass
        transport.set_write_buffer_limits(high=HIGH_WATER_BYTES)

    def connection_lost(self, exc) -> None:
        self._break(Unavailable(f"the node closed the data connection ({exc!r})"))

    def eof_received(self) -> bool:
        return False                       # close: nothing more can be answered

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._reader.buffer()

    def buffer_updated(self, nbytes: int) -> None:
        for fut, reply in self._reader.received(nbytes):
            if not fut.done():
                fut.set_result(reply)
        if self._reader.malformed is not None:
            self._break(Unavailable(f"a malformed answer from the node: {self._reader.malformed}"))

    def _check_overdue(self) -> None:
        """The connection's one timer: the oldest answer overdue breaks the connection."""
        if self.broken is not None:
            return
        sent = self._reader.oldest_sent()
        if sent is not None and time.monotonic() - sent > self.timeout_s:
            self._break(Unavailable(f"no answer from the node within {self.timeout_s:.1f} s"))
            return
        self._watch = self._loop.call_later(self.timeout_s / 4, self._check_overdue)

    def _break(self, err: KVStoreError) -> None:
        if self.broken is None:
            self.broken = err
        self._watch.cancel()
        while self._reader.pending:
            fut = self._reader.pending.popleft()[0]
            if not fut.done():
                fut.set_exception(err)
        self.resume_writing()
        if self._transport is not None:
            self._transport.close()

    def close(self) -> None:
        self._break(Unavailable("the data connection was closed"))


class AsyncConnections:
    """One :class:`AsyncNodeConnection` per node, opened on first use and again after
    it broke; callers that want the same node meanwhile share one open.

    Args:
        timeout_s: how long one answer may take (each connection's).
        token: the client token; tls: the context for nodes that speak TLS.
    """

    def __init__(self, timeout_s: float, token: str | None, tls: ssl.SSLContext | None):
        self.timeout_s, self.token, self.tls = timeout_s, token, tls
        self._conns: dict[str, AsyncNodeConnection] = {}
        self._opening: dict[str, asyncio.Future] = {}

    async def get(self, node, timeout_s: float) -> AsyncNodeConnection:
        """The connection to ``node`` (a :class:`~kvstore.types.NodeAddress`), opened
        within ``timeout_s`` when it is not open.

        Raises:
            Unavailable: the node cannot be reached; Unauthenticated: it refused the token.
        """
        conn = self.ready(node)
        if conn is not None:
            return conn
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                return await self._get(node)
        except TimeoutError:
            raise Unavailable(f"cannot connect to store node {node.node_id} within "
                              f"{timeout_s:.1f} s") from None

    def ready(self, node) -> AsyncNodeConnection | None:
        """The open connection to ``node``, or None (then :meth:`get` opens one)."""
        conn = self._conns.get(node.node_id)
        return conn if conn is not None and conn.broken is None else None

    async def _get(self, node) -> AsyncNodeConnection:
        conn = self.ready(node)
        if conn is not None:
            return conn
        pending = self._opening.get(node.node_id)
        if pending is None:
            pending = self._opening[node.node_id] = asyncio.ensure_future(AsyncNodeConnection.open(
                node.host, node.data_port, timeout_s=self.timeout_s, token=self.token,
                tls=self.tls if node.tls else None))
        try:
            conn = self._conns[node.node_id] = await asyncio.shield(pending)
        finally:
            if self._opening.get(node.node_id) is pending and pending.done():
                del self._opening[node.node_id]
        return conn

    def __len__(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
