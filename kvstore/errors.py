"""The one error hierarchy of kvstore, and its one mapping to wire codes.

Every failure a caller can handle is a subclass of :class:`KVStoreError`.
Each class carries a :class:`kvstore._proto.kvstore_pb2.Code` (the per-item
status code used in batch replies and on the TCP data plane) and a
``grpc.StatusCode`` (used when a whole RPC fails). ``ERRORS`` below is the
only table that relates them (STYLE rule 11); retries are allowed only on
:class:`Unavailable`, declared once in :data:`RETRYABLE`.
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
        return f"{self.message} (key={self.key})" if self.key is not None else self.message


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


class Internal(KVStoreError):
    """A broken invariant on the server side (a bug)."""
    code = pb.INTERNAL


# The one table: error class -> gRPC status code. The wire code is the class's
# own ``code`` attribute.
ERRORS: dict[type[KVStoreError], grpc.StatusCode] = {
    NotFound: grpc.StatusCode.NOT_FOUND,
    TooLarge: grpc.StatusCode.OUT_OF_RANGE,
    NoSpace: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    KeyConflict: grpc.StatusCode.ALREADY_EXISTS,
    AlreadyPresent: grpc.StatusCode.ALREADY_EXISTS,
    WrongShard: grpc.StatusCode.FAILED_PRECONDITION,
    ChecksumMismatch: grpc.StatusCode.DATA_LOSS,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
    Internal: grpc.StatusCode.INTERNAL,
}

_BY_CODE: dict[int, type[KVStoreError]] = {cls.code: cls for cls in ERRORS}
_BY_GRPC: dict[grpc.StatusCode, type[KVStoreError]] = {}
for _cls, _status in ERRORS.items():      # the first class of a status wins (KeyConflict)
    _BY_GRPC.setdefault(_status, _cls)
# Transport-level gRPC failures that mean "could not reach the server".
_BY_GRPC[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable
_BY_GRPC[grpc.StatusCode.CANCELLED] = Unavailable

#: The only errors a client retries.
RETRYABLE: tuple[type[KVStoreError], ...] = (Unavailable,)
#: ... and their gRPC codes, for callers that see a status code (the conductor).
RETRYABLE_STATUS: frozenset[grpc.StatusCode] = frozenset(ERRORS[c] for c in RETRYABLE)

#: How an Unavailable from a master that is rebuilding its index (just started,
#: or a new leader, while the store nodes re-register) begins: the SDK waits
#: that out (up to its failover_wait_s) instead of giving up after a few tries.
INDEX_INCOMPLETE = "index incomplete"
#: How an Unavailable begins that a leading master answers when no store node is
#: alive to place a value on: an answer, not an outage of the master, so the SDK
#: raises it at once (a node that died is out of the grants after the node ttl).
#: For one more node ttl after the last node's heartbeats stopped the master
#: answers a plain, retried Unavailable instead: that node may only have been late.
NO_LIVE_NODE = "no live store node"
#: How the Unavailable begins that a leading master answers instead, within one
#: node ttl of the last node's heartbeats stopping (that node may only be late):
#: the SDK waits it out on the same master, as :data:`INDEX_INCOMPLETE`, for as
#: long as its call's deadline lets it retry.
NODES_LATE = "every store node missed its heartbeats just now"


def code_name(code: int) -> str:
    """The name of a wire ``Code``; ``CODE_<n>`` for a number no code has (sent by a
    newer or a broken peer: proto3 enums are open)."""
    try:
        return pb.Code.Name(code)
    except ValueError:
        return f"CODE_{code}"


def error_for_code(code: int, message: str = "", *, key: str | None = None,
                   redirect: str = "") -> KVStoreError:
    """Build the exception for a wire ``Code`` (``OK`` is a caller bug; an unknown
    code is :class:`Internal`)."""
    if code == pb.OK:
        raise ValueError("error_for_code called with OK")
    cls = _BY_CODE.get(code, Internal)
    return cls(message or code_name(code), key=key, redirect=redirect)


def to_status(err: KVStoreError) -> pb.Status:
    """Per-item status message for an error."""
    return pb.Status(code=err.code, message=err.message, redirect=err.redirect)


OK_STATUS = pb.Status(code=pb.OK)


def status_code(err: KVStoreError) -> grpc.StatusCode:
    """The gRPC status code of a whole call that fails with ``err``."""
    return ERRORS.get(type(err)) or next(
        (code for cls, code in ERRORS.items() if isinstance(err, cls)), grpc.StatusCode.INTERNAL)


def from_rpc_error(exc: grpc.RpcError) -> KVStoreError:
    """Translate a failed RPC into the kvstore error it stands for."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_GRPC.get(code, Unavailable if code == grpc.StatusCode.UNKNOWN else Internal)
    return cls(details or str(code))
