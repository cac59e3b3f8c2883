"""What a store node makes of a byte stream: which requests it reads, and where it stops.

The node's frame loop (:mod:`kvstore.store.session`) consumes bytes by rules
that depend only on the bytes and on whether the connection authenticated:

    header (32 B)   key_len + parent_len > 8192        -> one error reply, close
    names           unknown op                          -> one error reply, close
                    not authenticated, not an AUTH op   -> one error reply, close
    PUT             reads ``size`` value bytes, stored or discarded, then one reply
    AUTH_PROVE      size > 64: reply, close; else reads size bytes; a proof this
                    fuzzer made is never right: reply, close
    RDMA_CONNECT    size > MAX_CONNECT_BYTES: reply, close; else reads size bytes, one
                    (UNAVAILABLE) reply: the fuzz node serves no RDMA
    every other op  one reply, nothing more read

A stream that ends inside a frame (``PARTIAL``) ends the session where it
stops: the node answers nothing for that frame (and may drop the replies it
had queued), and never reads what it had of the frame as another frame.

So the fuzzer knows, before sending, how many replies to read and whether
the node will close; a node that answers otherwise (closes early, stays
silent) is a finding, not noise. A reply carries a value after its header
and message when it is OK and answers GET, STATS or AUTH_HELLO.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvstore.transfer.protocol import REQUEST, Op
from kvstore.transfer.rdma_wire import MAX_CONNECT_BYTES, OP_RDMA_CONNECT

_MAX_NAMES_BYTES = 8192
_MAX_PROOF_BYTES = 64
_KNOWN_OPS = frozenset(int(op) for op in Op) | {OP_RDMA_CONNECT}
_AUTH_OPS = frozenset({int(Op.AUTH_HELLO), int(Op.AUTH_PROVE)})
#: Ops whose OK reply is followed by ``size`` value bytes.
VALUE_OPS = frozenset({int(Op.GET), int(Op.STATS), int(Op.AUTH_HELLO)})


class End(enum.Enum):
    OPEN = "open"          # the stream ends on a frame boundary; the node waits for more
    CLOSED = "closed"      # the node answers, then closes (bytes after ``consumed`` unread)
    PARTIAL = "partial"    # the stream stops inside a frame; the node waits for the rest


@dataclass(frozen=True, slots=True)
class Plan:
    replies: tuple[int, ...]   # the op of each request the node answers, in order
    consumed: int              # bytes the node reads (CLOSED: what to send at most)
    end: End


def plan(data: bytes, authed: bool) -> Plan:
    """The node's reading of ``data`` sent on a connection (see the module docstring).

    Args:
        data: the bytes a client sends, starting on a frame boundary.
        authed: whether the connection completed the AUTH handshake.
    """
    replies: list[int] = []
    pos, n = 0, len(data)
    header = REQUEST.size
    while True:
        if n - pos < header:
            return Plan(tuple(replies), pos, End.OPEN if pos == n else End.PARTIAL)
        op, _flags, key_len, parent_len, _oid, size, _ck = REQUEST.unpack_from(data, pos)
        pos += header
        if key_len + parent_len > _MAX_NAMES_BYTES:
            return Plan(tuple(replies) + (op,), pos, End.CLOSED)
        if n - pos < key_len + parent_len:
            return Plan(tuple(replies), n, End.PARTIAL)
        pos += key_len + parent_len
        if op not in _KNOWN_OPS or (not authed and op not in _AUTH_OPS):
            return Plan(tuple(replies) + (op,), pos, End.CLOSED)
        if op == Op.AUTH_PROVE:
            if size > _MAX_PROOF_BYTES:
                return Plan(tuple(replies) + (op,), pos, End.CLOSED)
            if n - pos < size:
                return Plan(tuple(replies), n, End.PARTIAL)
            return Plan(tuple(replies) + (op,), pos + size, End.CLOSED)
        if op == OP_RDMA_CONNECT and size > MAX_CONNECT_BYTES:
            return Plan(tuple(replies) + (op,), pos, End.CLOSED)
        if op in (Op.PUT, OP_RDMA_CONNECT):
            if n - pos < size:
                return Plan(tuple(replies), n, End.PARTIAL)
            pos += size
        replies.append(op)
