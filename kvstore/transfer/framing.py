"""The pipelined data connection's frames, without the socket: requests encoded,
answers decoded in order into :class:`~kvstore.transfer.reply.Reply` values.

A node answers the frames of one connection in order
(:mod:`kvstore.transfer.protocol`), so the requests in flight are a FIFO:
:meth:`AnswerReader.expect` queues one (with the most value bytes its answer
may carry, and the buffer its value goes into), and the bytes received are
decoded against the head of the queue. The receiving side asks for a buffer
(:meth:`AnswerReader.buffer`), lets the transport fill it, and hands over the
count (:meth:`AnswerReader.received`), which returns the answers now whole::

    buffer() -> [ read-ahead: headers, messages, small values ][ free ]
                or, while a large value arrives: the value's own buffer
    received(n) -> [(token, Reply), ...] in request order

No copies: headers land in a read-ahead; a value not there whole yet is
received straight into its destination (the caller's memory, or a new
bytearray). A caller that stopped waiting (:meth:`AnswerReader.abandon`) has
its answer read and dropped all the same, its value into a scratch buffer.
What no node of ours sends (a value longer than its request allows, an
overlong message, an answer to no request) raises :class:`Malformed`: the
connection cannot be trusted any more.

Thread safety: one reader per connection, used from one thread or loop.
"""

from __future__ import annotations

import collections
import time

from kvstore._proto import kvstore_pb2 as pb
from kvstore.transfer.reply import Reply
from kvstore.transfer.protocol import REQUEST, RESPONSE, Op

#: The read-ahead that answer headers (and values already there whole) land in.
READ_AHEAD_BYTES = 256 << 10
#: A node's error message is at most 1 KiB (kvstore.store.session); more is no answer of ours.
MAX_MESSAGE_BYTES = 4096
#: Ops whose OK answer carries a value (its size in the answer's ``size``).
WITH_VALUE = frozenset({Op.GET, Op.STATS, Op.AUTH_HELLO})


class Malformed(Exception):
    """An answer no node of ours sends: the connection cannot be trusted any more."""


def encode_request(op: Op, key: str, object_id: int = 0, size: int = 0, checksum: int = 0,
                   parent: str = "", flags: int = 0) -> bytes:
    """One request frame (header, key, parent); its value, if any, follows it."""
    kb, pk = key.encode(), parent.encode()
    return REQUEST.pack(op, min(flags, 255), len(kb), len(pk), object_id, size,
                        checksum) + kb + pk


class AnswerReader:
    """The answers of one connection, decoded against its requests in flight."""

    def __init__(self):
        # (token, the most value bytes its answer may carry (-1: none), sent at:
        # monotonic s, the buffer its value goes into or None), in sending order.
        self.pending: collections.deque[list] = collections.deque()
        self._ahead = bytearray(READ_AHEAD_BYTES)
        self._view = memoryview(self._ahead)
        self._start = self._end = 0
        self._head: Reply | None = None     # the answer whose value is arriving in _value
        self._value: bytearray | memoryview | None = None
        self._value_view: memoryview | None = None
        self._got = 0
        self.malformed: Malformed | None = None   # why the connection cannot be trusted

    def expect(self, token, op: Op, max_value_bytes: int, into: memoryview | None) -> None:
        """A request was sent; ``token`` comes back with its answer."""
        limit = (max_value_bytes if into is None else len(into)) if op in WITH_VALUE else -1
        self.pending.append([token, limit, time.monotonic(), into])

    def oldest_sent(self) -> float | None:
        """When the oldest request still unanswered was sent (monotonic s), or None."""
        return self.pending[0][2] if self.pending else None

    def abandon(self, token) -> None:
        """The caller of ``token`` stopped waiting: its value goes to a scratch buffer."""
        if self._value is not None and self.pending and self.pending[0][0] is token:
            if self.pending[0][3] is not None:     # being received into the caller's memory
                self._value = bytearray(len(self._value))
                self._value_view = memoryview(self._value)
            return
        for entry in self.pending:
            if entry[0] is token:
                entry[3] = None
                return

    def buffer(self) -> memoryview:
        """Where the next received bytes go."""
        if self._value_view is not None:
            return self._value_view[self._got:]
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._ahead) - self._end < RESPONSE.size + MAX_MESSAGE_BYTES:
            n = self._end - self._start
            self._ahead[:n] = self._view[self._start:self._end]
            self._start, self._end = 0, n
        return self._view[self._end:]

    def received(self, nbytes: int) -> list[tuple[object, Reply]]:
        """``nbytes`` landed in :meth:`buffer`: the answers now whole, in order. What
        follows a malformed answer is not decoded: :attr:`malformed` says why.
        """
        out: list[tuple[object, Reply]] = []
        try:
            self._received(nbytes, out)
        except Malformed as exc:
            self.malformed = exc
        return out

    def _received(self, nbytes: int, out: list) -> None:
        if self._value_view is not None:
            self._got += nbytes
            if self._got < len(self._value):
                return
            value, self._value, self._value_view = self._value, None, None
            out.append(self._answer(self._head, value))
        else:
            self._end += nbytes
        self._parse(out)

    def _parse(self, out: list) -> None:
        ahead = self._view
        while self._end - self._start >= RESPONSE.size:
            head = RESPONSE.unpack_from(self._ahead, self._start)
            code, msg_len, size = head[0], head[2], head[5]
            if msg_len > MAX_MESSAGE_BYTES:
                raise Malformed(f"a message of {msg_len} B")
            if self._end - self._start < RESPONSE.size + msg_len:
                return
            if not self.pending:
                raise Malformed("an answer to a request that was not sent")
            limit, into = self.pending[0][1], self.pending[0][3]
            with_value = limit >= 0 and code == pb.OK and size > 0
            if with_value and size > limit:
                raise Malformed(f"a value of {size} B where at most {limit} B can be")
            at = self._start + RESPONSE.size
            msg = bytes(ahead[at:at + msg_len]).decode("utf-8", "replace") if msg_len else ""
            self._start = at = at + msg_len
            reply = Reply(code, head[4], size, head[6], msg, b"", head[7], head[8])
            if not with_value:
                out.append(self._answer(reply, bytearray()))
                continue
            here = min(size, self._end - at)
            value = bytearray(size) if into is None else into[:size]
            value[:here] = ahead[at:at + here]
            self._start = at + here
            if here == size:
                out.append(self._answer(reply, value))
                continue
            self._head, self._value, self._got = reply, value, here
            self._value_view = value if into is not None else memoryview(value)
            return

    def _answer(self, reply: Reply, value) -> tuple[object, Reply]:
        token = self.pending.popleft()[0]
        return token, Reply(reply.code, reply.object_id, reply.size, reply.checksum,
                            reply.message, value, reply.offset, reply.serial)
