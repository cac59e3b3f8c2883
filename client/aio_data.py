"""The asyncio SDK's data plane: one TCP connection per node, many requests in flight.

The node answers the frames of one connection in order
(:mod:`kvstore.transfer.protocol`), so a connection here is a FIFO of
futures: a request writes its frame (and value) and queues its future in
the same step, with no await in between, so frames and futures keep one
order; one reader task reads the answers and resolves the futures in that
order. Nothing waits for one answer before the next request goes out: a
coroutine per operation, and 64 of them fill the link the way a pipelined
batch does::

    request(PUT a) ─┐                         ┌─> future a  (answer 1)
    request(GET b) ─┼─> frames a b c ─> node ─┼─> future b  (answer 2, then b's value)
    request(GET c) ─┘                         └─> future c  (answer 3, ...)

An answer that does not come within the timeout breaks the connection (its
order can no longer be trusted): every pending future fails Unavailable and
the next request opens a new connection. One timer per connection watches
the oldest pending answer (no timer per request: each costs a task).

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
from kvstore.transfer.protocol import REQUEST, RESPONSE, Op, hello_nonce_bytes

#: Wait for the socket to take what is queued only beyond this much (a drain per
#: request costs a trip through the event loop).
_DRAIN_ABOVE_BYTES = 4 << 20
#: Ops whose OK answer carries a value (its size in the answer's ``size``).
_WITH_VALUE = frozenset({Op.GET, Op.STATS, Op.AUTH_HELLO})


class Answer(tuple):
    """(code, object_id, size, checksum, message, value or b"")."""

    __slots__ = ()


class AsyncNodeConnection:
    """A pipelined connection to one store node (open with :meth:`open`).

    Args:
        timeout_s: how long one answer may take.
    """

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 timeout_s: float):
        self._reader = reader
        self._writer = writer
        self.timeout_s = timeout_s
        # (future, answer carries a value, sent at: monotonic s), in sending order.
        self._pending: collections.deque[tuple[asyncio.Future, bool, float]] = collections.deque()
        self.broken: KVStoreError | None = None
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._read_answers())
        self._watch = self._loop.call_later(self.timeout_s / 4, self._check_overdue)

    @classmethod
    async def open(cls, host: str, port: int, *, timeout_s: float = 10.0,
                   token: str | None = None, tls: ssl.SSLContext | None = None
                   ) -> "AsyncNodeConnection":
        """Connect (and authenticate with ``token``, when given).

        Raises:
            Unavailable: the node cannot be reached. Unauthenticated: a refused token.
        """
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=tls,
                                        server_hostname=host if tls else None), timeout_s)
        except (OSError, asyncio.TimeoutError, UnicodeError, ValueError, OverflowError) as exc:
            raise Unavailable(f"cannot connect to store node {host[:80]}:{port}: "
                              f"{exc or type(exc).__name__}") from None
        conn = cls(reader, writer, timeout_s)
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
                      flags: int = 0) -> Answer:
        """Send one frame (with ``payload``, a bytes-like of ``size`` bytes) and await
        its answer.

        Raises:
            Unavailable: the connection broke or the answer did not come in time.
        """
        if self.broken is not None:
            raise self.broken
        kb, pb_ = key.encode(), parent.encode()
        fut = self._loop.create_future()
        self._writer.write(REQUEST.pack(op, min(flags, 255), len(kb), len(pb_), object_id, size,
                                        checksum) + kb + pb_)
        if payload is not None and size:
            self._writer.write(payload)
        self._pending.append((fut, op in _WITH_VALUE, time.monotonic()))
        if self._writer.transport.get_write_buffer_size() > _DRAIN_ABOVE_BYTES:
            try:
                await self._writer.drain()
            except (OSError, ConnectionError) as exc:
                self._break(Unavailable(f"data connection failed: {exc}"))
        return await fut

    def _check_overdue(self) -> None:
        """The connection's one timer: the oldest answer overdue breaks the connection."""
        if self.broken is not None:
            return
        if self._pending and time.monotonic() - self._pending[0][2] > self.timeout_s:
            self._break(Unavailable(f"no answer from the node within {self.timeout_s:.1f} s"))
            return
        self._watch = self._loop.call_later(self.timeout_s / 4, self._check_overdue)

    async def _read_answers(self) -> None:
        try:
            while True:
                head = await self._reader.readexactly(RESPONSE.size)
                code, _f, msg_len, _r, oid, size, checksum, _off, _serial = RESPONSE.unpack(head)
                msg = (await self._reader.readexactly(msg_len)).decode("utf-8", "replace") \
                    if msg_len else ""
                fut, with_value, _sent = self._pending.popleft()
                value = b""
                if with_value and code == pb.OK and size:
                    value = await self._reader.readexactly(size)
                if not fut.done():
                    fut.set_result(Answer((code, oid, size, checksum, msg, value)))
        except (asyncio.IncompleteReadError, OSError, ConnectionError) as exc:
            self._break(Unavailable(f"the node closed the data connection ({exc!r})"))
        except IndexError:
            self._break(Unavailable("the node answered a request that was not sent"))
        except asyncio.CancelledError:
            self._break(Unavailable("the data connection was closed"))

    def _break(self, err: KVStoreError) -> None:
        if self.broken is None:
            self.broken = err
        self._watch.cancel()
        while self._pending:
            fut, _v, _sent = self._pending.popleft()
            if not fut.done():
                fut.set_exception(err)
        self._writer.close()
        if not self._task.done() and asyncio.current_task() is not self._task:
            self._task.cancel()

    def close(self) -> None:
        self._break(Unavailable("the data connection was closed"))
