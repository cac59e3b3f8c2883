"""The asyncio SDK's data plane: one TCP connection per node, many requests in flight.

The node answers the frames of one connection in order
(:mod:`kvstore.transfer.protocol`), so a connection here is a FIFO of
futures: a request writes its frame (and value) and queues its future in
the same step, with no await in between, so frames and futures keep one
order; the connection's protocol callbacks parse the answers as they arrive
and resolve the futures in that order. Nothing waits for one answer before
the next request goes out: a coroutine per operation, and 64 of them fill
the link the way a pipelined batch does::

    request(PUT a) ─┐                         ┌─> future a  (answer 1)
    request(GET b) ─┼─> frames a b c ─> node ─┼─> future b  (answer 2, then b's value)
    request(GET c) ─┘                         └─> future c  (answer 3, ...)

No copies on the way in: the connection is an :class:`asyncio.BufferedProtocol`,
so the event loop receives answer headers into a 256 KiB read-ahead and a
value that is not there whole yet straight into the bytearray the get
returns (asyncio's StreamReader appended every chunk to a buffer, then
copied the value out twice: a 4 MiB get ran at a third of the sync
client's speed). Values go out from the caller's buffer (the transport
copies only what the socket does not take at once), with the socket's
buffers as large as the sync client's; a connection whose unsent bytes pass
:data:`HIGH_WATER_BYTES` makes new requests wait until it drained.

An answer that does not come within the timeout breaks the connection (its
order can no longer be trusted): every pending future fails Unavailable and
the next request opens a new connection. One timer per connection watches
the oldest pending answer (no timer per request: each costs a task). A
request may wait less (``timeout_s``: a read with another replica to try, a
call's deadline) or be cancelled: its caller gets Unavailable (or the
cancel) and its answer, still to come in order, is read and dropped -- its
value into a scratch buffer, never into the caller's memory any more -- so
the connection and the other requests on it go on.

Thread safety: one event loop; a connection is used from that loop only.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time

from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import proof
from kvstore.errors import KVStoreError, Unavailable, error_for_code
from kvstore.rpc import MAX_MESSAGE_BYTES
from kvstore.transfer.protocol import REQUEST, RESPONSE, Op, hello_nonce_bytes, tune_socket

#: A value up to this size is copied behind its frame; the frames a loop iteration
#: queues go out in one write (one send), not a send each.
_JOIN_BELOW_BYTES = 16 << 10
#: A node's error message is at most 1 KiB (kvstore.store.session); more is no answer of ours.
_MAX_MESSAGE_BYTES = 4096


class _Malformed(Exception):
    """An answer no node of ours sends: the connection cannot be trusted any more."""


#: Unsent bytes above which requests wait for the socket (resume below a quarter).
HIGH_WATER_BYTES = 4 << 20
#: The read-ahead that answer headers (and values already there whole) land in.
READ_AHEAD_BYTES = 256 << 10
#: Ops whose OK answer carries a value (its size in the answer's ``size``).
_WITH_VALUE = frozenset({Op.GET, Op.STATS, Op.AUTH_HELLO})


class Answer(tuple):
    """(code, object_id, size, checksum, message, value: bytearray, empty without one)."""

    __slots__ = ()


class AsyncNodeConnection(asyncio.BufferedProtocol):
    """A pipelined connection to one store node (open with :meth:`open`).

    Args:
        timeout_s: how long one answer may take.
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        # (future, the most value bytes its answer may carry (-1: none), sent at:
        # monotonic s, the buffer its value goes into or None), in sending order.
        self._pending: collections.deque[tuple[asyncio.Future, int, float, object]] = collections.deque()
        self.broken: KVStoreError | None = None
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._ahead = bytearray(READ_AHEAD_BYTES)
        self._ahead_view = memoryview(self._ahead)
        self._start = self._end = 0
        # The answer whose value is being received straight into _value.
        self._head: tuple | None = None
        self._value: bytearray | None = None
        self._value_view: memoryview | None = None
        self._got = 0
        self._writable: asyncio.Future | None = None    # set while writing is paused
        self._out = bytearray()          # frames (and small values) not written yet
        self._out_scheduled = False
        self._watch = self._loop.call_later(self.timeout_s / 4, self._check_overdue)

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
            await asyncio.wait_for(loop.create_connection(
                lambda: conn, host, port, ssl=tls, server_hostname=host if tls else None),
                timeout_s)
        except (OSError, asyncio.TimeoutError, UnicodeError, ValueError, OverflowError) as exc:
            conn._watch.cancel()
            raise Unavailable(f"cannot connect to store node {host[:80]}:{port}: "
                              f"{exc or type(exc).__name__}") from None
        if token:
            try:
                await conn._authenticate(token)
            except BaseException:
                conn.close()
                raise
        return conn

    async def _authenticate(self, token: str) -> None:
        code, _oid, size, _ck, msg, nonce = await self.request(Op.AUTH_HELLO, "")
        if not hello_nonce_bytes(code, size, msg):
            return                         # the node needs no authentication
        answer = proof(token, bytes(nonce))
        code, *_rest, msg, _v = await self.request(Op.AUTH_PROVE, "", size=len(answer),
                                                   payload=answer)
        if code != pb.OK:
            raise error_for_code(code, msg)

    async def request(self, op: Op, key: str, object_id: int = 0, size: int = 0,
                      checksum: int = 0, payload=None, parent: str = "",
                      flags: int = 0, max_value_bytes: int = MAX_MESSAGE_BYTES,
                      into: memoryview | None = None,
                      timeout_s: float | None = None) -> Answer:
        """Send one frame (with ``payload``, a bytes-like of ``size`` bytes) and await
        its answer. A value answered (GET, STATS, AUTH_HELLO) may have at most
        ``max_value_bytes`` (``len(into)`` with ``into``), else the connection
        breaks; it is received into ``into`` when given (the answer's value is
        then ``into[:size]``), else into a new bytearray.

        Args:
            timeout_s: wait this long at most when less than the connection's
                timeout (the answer is then dropped when it comes; see the module doc).

        Raises:
            Unavailable: the connection broke or the answer did not come in time.
        """
        while self._writable is not None and self.broken is None:
            await asyncio.shield(self._writable)
        if self.broken is not None:
            raise self.broken
        kb, pb_ = key.encode(), parent.encode()
        fut = self._loop.create_future()
        frame = REQUEST.pack(op, min(flags, 255), len(kb), len(pb_), object_id, size,
                             checksum) + kb + pb_
        self._out += frame
        if payload is not None and size:
            if size <= _JOIN_BELOW_BYTES:
                self._out += payload
            else:                          # a large value goes from the caller's buffer
                self._write_out()
                self._transport.write(payload)
        if self._out and not self._out_scheduled:
            self._out_scheduled = True     # the frames of this loop iteration, one send
            self._loop.call_soon(self._write_out)
        limit = (max_value_bytes if into is None else len(into)) if op in _WITH_VALUE else -1
        self._pending.append((fut, limit, time.monotonic(), into))
        try:
            if timeout_s is None or timeout_s >= self.timeout_s:
                return await fut
            async with asyncio.timeout(max(0.0, timeout_s)):
                return await fut
        except TimeoutError:
            self._abandon(fut)
            raise Unavailable(f"no answer from the node within {timeout_s:.1f} s") from None
        except asyncio.CancelledError:
            self._abandon(fut)
            raise

    def _abandon(self, fut: asyncio.Future) -> None:
        """The caller of ``fut`` stopped waiting: its answer (read in order all the
        same) goes nowhere, its value into a scratch buffer instead of the caller's."""
        if self._value is not None and self._pending and self._pending[0][0] is fut:
            if self._pending[0][3] is not None:      # being received into the caller's memory
                self._value = bytearray(len(self._value))
                self._value_view = memoryview(self._value)
            return
        for j, (f, limit, sent, into) in enumerate(self._pending):
            if f is fut:
                if into is not None:
                    self._pending[j] = (f, limit, sent, None)
                return

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
        if self._value_view is not None:
            return self._value_view[self._got:]
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._ahead) - self._end < RESPONSE.size + _MAX_MESSAGE_BYTES:
            n = self._end - self._start
            self._ahead[:n] = self._ahead_view[self._start:self._end]
            self._start, self._end = 0, n
        return self._ahead_view[self._end:]

    def buffer_updated(self, nbytes: int) -> None:
        try:
            if self._value_view is not None:
                self._got += nbytes
                if self._got < len(self._value):
                    return
                value, self._value, self._value_view = self._value, None, None
                self._answer(self._head, value)
            else:
                self._end += nbytes
            self._parse()
        except IndexError:
            self._break(Unavailable("the node answered a request that was not sent"))
        except _Malformed as exc:
            self._break(Unavailable(f"a malformed answer from the node: {exc}"))

    def _parse(self) -> None:
        """Answer every request whose answer is in the read-ahead; a value that is
        not there whole is received into its own buffer from here on."""
        ahead = self._ahead_view
        while self._end - self._start >= RESPONSE.size:
            head = RESPONSE.unpack_from(self._ahead, self._start)
            code, msg_len, size = head[0], head[2], head[5]
            if msg_len > _MAX_MESSAGE_BYTES:
                raise _Malformed(f"a message of {msg_len} B")
            if self._end - self._start < RESPONSE.size + msg_len:
                return
            limit = self._pending[0][1] if self._pending else -1
            with_value = limit >= 0 and code == pb.OK and size > 0
            if with_value and size > limit:
                raise _Malformed(f"a value of {size} B where at most {limit} B can be")
            at = self._start + RESPONSE.size
            msg = bytes(ahead[at:at + msg_len]).decode("utf-8", "replace") if msg_len else ""
            at += msg_len
            self._start = at
            if not with_value:
                self._answer((code, head[4], size, head[6], msg), bytearray())
                continue
            here = min(size, self._end - at)
            into = self._pending[0][3]
            value = bytearray(size) if into is None else into[:size]
            value[:here] = ahead[at:at + here]
            self._start = at + here
            if here == size:
                self._answer((code, head[4], size, head[6], msg), value)
                continue
            self._head = (code, head[4], size, head[6], msg)
            self._value, self._got = value, here
            self._value_view = value if into is not None else memoryview(value)
            return

    def _answer(self, head: tuple, value) -> None:
        fut = self._pending.popleft()[0]
        if not fut.done():
            fut.set_result(Answer((*head, value)))

    def _check_overdue(self) -> None:
        """The connection's one timer: the oldest answer overdue breaks the connection."""
        if self.broken is not None:
            return
        if self._pending and time.monotonic() - self._pending[0][2] > self.timeout_s:
            self._break(Unavailable(f"no answer from the node within {self.timeout_s:.1f} s"))
            return
        self._watch = self._loop.call_later(self.timeout_s / 4, self._check_overdue)

    def _break(self, err: KVStoreError) -> None:
        if self.broken is None:
            self.broken = err
        self._watch.cancel()
        while self._pending:
            fut = self._pending.popleft()[0]
            if not fut.done():
                fut.set_exception(err)
        self.resume_writing()
        if self._transport is not None:
            self._transport.close()

    def close(self) -> None:
        self._break(Unavailable("the data connection was closed"))
