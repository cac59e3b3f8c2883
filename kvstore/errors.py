"""The one error hierarchy of kvstore, and its one mapping to wire codes.

Every failure a caller can handle is a subclass of :class:`KVStoreError`.
Each class carries a :class:`kvstore._proto.kvstore_pb2.Code` (the per-item
status code used in batch replies and on the TCP data plane) and a
``grpc.StatusCode`` (used when a whole RPC fails). ``ERRORS`` below is the
only table that relates them (STYLE rule 11); retries are allowed only on
:class:`Unavailable`, declared once in :data:`RETRYABLE`.

A subclass that means more than its parent (a master warming up, a standby
naming its leader, no live store node...) has a wire code of its own, so it
crosses every path as itself: per-item statuses, the TCP data plane and the
report link carry the code; a failed RPC carries its parent's gRPC status and,
in the binary trailing metadata key :data:`ERROR_DETAIL_KEY`, an
``ErrorDetail`` (the code and the fields: a standby's ``leader``), which
:func:`from_rpc_error` decodes back into the class (bounded, checked against
the status). Callers test the class (``isinstance``), never the message: the
message is for people.
"""

from __future__ import annotations

import grpc

from kvstore._proto import kvstore_pb2 as pb


class KVStoreError(Exception):
    """Base of every kvstore error. ``code`` is the wire code."""

    code: int = pb.INTERNAL

    def __init__(self, message: str = "", *, key: str | None = None, redirect: str = ""):
        super().__init__(message)
        self.message = message
        self.key = key
        self.redirect = redirect

    def __str__(self) -> str:
        if self.key is None:
            return self.message
        return f"{self.message} (key={_shown(self.key)})"


def _shown(key: str, limit: int = 128) -> str:
    """A key as a message shows it: on one line (quoted and escaped when not all
    printable) and at most ``limit`` characters of it."""
    key = str(key)
    more = f"... ({len(key)} characters)" if len(key) > limit else ""
    key = key[:limit]
    return (key if key.isprintable() else repr(key)) + more


class NotFound(KVStoreError):
    """The key is not stored (never an empty value)."""
    code = pb.NOT_FOUND


class TooLarge(KVStoreError):
    """The value can never fit on any node (larger than every node's capacity)."""
    code = pb.TOO_LARGE


class NoSpace(KVStoreError):
    """The store is full and nothing can be evicted right now."""
    code = pb.NO_SPACE


class Unavailable(KVStoreError):
    """A master or store node cannot be reached; retryable."""
    code = pb.UNAVAILABLE


class IndexIncomplete(Unavailable):
    """A leading master still rebuilding its index (just started, or a new leader
    while the store nodes re-register): the SDK waits it out at the same master (up
    to its failover_wait_s) instead of giving up after a few tries."""
    code = pb.INDEX_INCOMPLETE


class NodesLate(Unavailable):
    """A leading master whose store nodes all missed their heartbeats within the
    last node ttl: they may only be late, so the SDK waits on the same master, as
    for :class:`IndexIncomplete`, while its call's deadline lets it retry."""
    code = pb.NODES_LATE


class NoLiveNode(Unavailable):
    """A leading master with no live store node to place a value on: an answer, not
    an outage of the master, so the SDK raises it at once (never retried)."""
    code = pb.NO_LIVE_NODE


class NotLeader(Unavailable):
    """A standby master refused the call; ``leader`` is the leader's address
    (host:port) when the standby knows it, else "". The SDK tries that one next."""
    code = pb.NOT_LEADER

    def __init__(self, message: str = "", *, key: str | None = None, redirect: str = "",
                 leader: str = ""):
        super().__init__(message, key=key, redirect=redirect)
        self.leader = leader


class Fenced(Unavailable):
    """A store node that has not heard from its master shard for longer than its
    lease: it refuses reads and writes until a master answers again."""
    code = pb.FENCED


class InvalidArgument(KVStoreError):
    """Bad input (empty key, wrong type, bad size); nothing was changed."""
    code = pb.INVALID_ARGUMENT


class KeyConflict(KVStoreError):
    """The key already holds different bytes; objects are immutable."""
    code = pb.KEY_CONFLICT


class AlreadyPresent(KVStoreError):
    """Not a failure: a placed put found the key stored with equal bytes (under
    another version), so nothing was added. The SDK's put answers False for it."""
    code = pb.ALREADY_PRESENT


class WrongShard(KVStoreError):
    """The key's hash slot is owned by another master (see ``redirect``)."""
    code = pb.WRONG_SHARD


class ChecksumMismatch(KVStoreError):
    """Bytes read or written do not match the object's xxh3-64 checksum."""
    code = pb.CHECKSUM_MISMATCH


class Unauthenticated(KVStoreError):
    """No credentials, or credentials the server does not know (its ``--auth`` file)."""
    code = pb.UNAUTHENTICATED


class PermissionDenied(KVStoreError):
    """Valid credentials whose role may not do this (e.g. a ``client`` evicting)."""
    code = pb.PERMISSION_DENIED


class IdTaken(PermissionDenied):
    """A node registering under an id that another live process (another
    incarnation) holds: the master keeps the live one."""
    code = pb.ID_TAKEN


class EventsLost(KVStoreError):
    """A watch of a shard's event log (WatchEvents) asked for events the log no longer
    holds: older than its oldest retained event, or of another epoch (the master
    restarted, or another took the shard over). The subscriber missed events: it
    resyncs (re-reads what it needs), then watches from the log's oldest or newest."""
    code = pb.EVENTS_LOST


class Internal(KVStoreError):
    """A broken invariant on the server side (a bug)."""
    code = pb.INTERNAL


class ProtocolError(Internal):
    """The two ends of a connection disagree about it (a peer refused a request it
    must accept, or sent a frame that is not one of ours): the connection is closed.
    Raised on the receiving side only; on the wire it is INTERNAL."""


# The one table: error class -> gRPC status code. The wire code is the class's
# own ``code`` attribute.
ERRORS: dict[type[KVStoreError], grpc.StatusCode] = {
    NotFound: grpc.StatusCode.NOT_FOUND,
    TooLarge: grpc.StatusCode.OUT_OF_RANGE,
    NoSpace: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    IndexIncomplete: grpc.StatusCode.UNAVAILABLE,
    NodesLate: grpc.StatusCode.UNAVAILABLE,
    NoLiveNode: grpc.StatusCode.UNAVAILABLE,
    NotLeader: grpc.StatusCode.UNAVAILABLE,
    Fenced: grpc.StatusCode.UNAVAILABLE,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    KeyConflict: grpc.StatusCode.ALREADY_EXISTS,
    AlreadyPresent: grpc.StatusCode.ALREADY_EXISTS,
    WrongShard: grpc.StatusCode.FAILED_PRECONDITION,
    ChecksumMismatch: grpc.StatusCode.DATA_LOSS,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    IdTaken: grpc.StatusCode.PERMISSION_DENIED,
    EventsLost: grpc.StatusCode.OUT_OF_RANGE,
    Internal: grpc.StatusCode.INTERNAL,
}

_BY_CODE: dict[int, type[KVStoreError]] = {cls.code: cls for cls in ERRORS}
_BY_GRPC: dict[grpc.StatusCode, type[KVStoreError]] = {}
for _cls, _status in ERRORS.items():      # the first class of a status wins (KeyConflict,
    _BY_GRPC.setdefault(_status, _cls)    # Unavailable, PermissionDenied)
# Transport-level gRPC failures that mean "could not reach the server".
_BY_GRPC[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable
_BY_GRPC[grpc.StatusCode.CANCELLED] = Unavailable

#: The only errors a client retries.
RETRYABLE: tuple[type[KVStoreError], ...] = (Unavailable,)
#: ... and their gRPC codes, for callers that see a status code (the conductor).
RETRYABLE_STATUS: frozenset[grpc.StatusCode] = frozenset(ERRORS[c] for c in RETRYABLE)

#: The binary trailing-metadata key of a failed RPC's ``ErrorDetail``.
ERROR_DETAIL_KEY = "kvstore-error-bin"
#: An ``ErrorDetail`` longer than this is ignored (read as the plain status).
MAX_ERROR_DETAIL_BYTES = 1024


def code_name(code: int) -> str:
    """The name of a wire ``Code``; ``CODE_<n>`` for a number no code has (sent by a
    newer or a broken peer: proto3 enums are open)."""
    try:
        return pb.Code.Name(code)
    except ValueError:
        return f"CODE_{code}"


def unwrap(result):
    """``result`` itself, unless it is a :class:`KVStoreError`: then it is raised (the
    one-key form of a call that answers per key a value or an error)."""
    if isinstance(result, KVStoreError):
        raise result
    return result


def error_for_code(code: int, message: str = "", *, key: str | None = None,
                   redirect: str = "", leader: str = "") -> KVStoreError:
    """Build the exception for a wire ``Code`` (``OK`` is a caller bug; an unknown
    code is :class:`Internal`). ``leader`` is kept by :class:`NotLeader` only."""
    if code == pb.OK:
        raise ValueError("error_for_code called with OK")
    cls = _BY_CODE.get(code, Internal)
    message = message or code_name(code)
    if cls is NotLeader:
        return NotLeader(message, key=key, redirect=redirect, leader=leader)
    return cls(message, key=key, redirect=redirect)


def to_status(err: KVStoreError) -> pb.Status:
    """Per-item status message for an error."""
    return pb.Status(code=err.code, message=err.message, redirect=err.redirect)


OK_STATUS = pb.Status(code=pb.OK)


def status_code(err: KVStoreError) -> grpc.StatusCode:
    """The gRPC status code of a whole call that fails with ``err``."""
    return ERRORS.get(type(err)) or next(
        (code for cls, code in ERRORS.items() if isinstance(err, cls)), grpc.StatusCode.INTERNAL)


def error_detail(err: KVStoreError) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata a failed RPC carries for ``err`` (its code and fields),
    for ``context.abort(..., trailing_metadata=...)``."""
    detail = pb.ErrorDetail(code=err.code, leader=getattr(err, "leader", ""),
                            redirect=err.redirect)
    return ((ERROR_DETAIL_KEY, detail.SerializeToString()),)


def _detail_of(exc: grpc.RpcError) -> pb.ErrorDetail | None:
    """The ``ErrorDetail`` of a failed RPC, or None (none, too large, undecodable)."""
    try:
        metadata = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    except Exception:              # a call that never reached a server has none to give
        return None
    for k, v in metadata or ():
        if k == ERROR_DETAIL_KEY and isinstance(v, bytes):
            return decode_detail(v)
    return None


def decode_detail(raw: bytes) -> pb.ErrorDetail | None:
    """An ``ErrorDetail`` from its bytes, or None (longer than MAX_ERROR_DETAIL_BYTES,
    undecodable)."""
    if len(raw) > MAX_ERROR_DETAIL_BYTES:
        return None
    try:
        return pb.ErrorDetail.FromString(raw)
    except Exception:      # protobuf's DecodeError: not a detail of ours
        return None


def from_rpc_error(exc: grpc.RpcError) -> KVStoreError:
    """Translate a failed RPC into the kvstore error it stands for: the class its
    ``ErrorDetail`` names when that class's gRPC status is the call's, else the
    first class of the status (:data:`ERRORS`)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_from_status(code, details or str(code), _detail_of(exc))


def error_from_status(code: grpc.StatusCode, message: str,
                      detail: pb.ErrorDetail | None) -> KVStoreError:
    """The kvstore error of a failed call's gRPC status, message and ``ErrorDetail``
    (None: none came) by the rule of :func:`from_rpc_error` (also the rule of a
    call's FAILED answer on a master's socket port, :mod:`kvstore.transfer.call_link`)."""
    if detail is not None:
        cls = _BY_CODE.get(detail.code)
        if cls is not None and ERRORS[cls] == code:
            return error_for_code(detail.code, message, redirect=detail.redirect[:256],
                                  leader=detail.leader[:256])
    cls = _BY_GRPC.get(code, Unavailable if code == grpc.StatusCode.UNKNOWN else Internal)
    return cls(message)
