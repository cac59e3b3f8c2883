"""A store node's answer to one request frame, decoded once into one :class:`Reply`.

Every transport (TCP blocking and asyncio, shared memory) hands its callers a
:class:`Reply`, read by field name; nothing past the transport indexes an answer
by position or reads a protobuf status (:meth:`Reply.error` gives the error of
the one table, :mod:`kvstore.errors`).

Thread safety: a frozen record.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import KVStoreError, error_for_code


@dataclass(frozen=True, slots=True)
class Reply:
    """One answer of a store node to one request frame."""

    code: int                 # kvstore.proto Code; OK = 0
    object_id: int = 0
    size: int = 0             # bytes: the value's (GET, STATS) or the object's
    checksum: int = 0         # xxh3-64, where the op answers one
    message: str = ""         # why, on an error
    value: bytes | bytearray | memoryview = b""   # an OK GET/STATS/AUTH_HELLO's bytes
    offset: int = 0           # SHM_ALLOC / SHM_ACQUIRE: where the value is in the segment ...
    serial: int = 0           # ... and that allocation's serial (kvstore.transfer.shm_slots)

    @classmethod
    def of_header(cls, header: tuple) -> "Reply":
        """A reply from the sync transport's header tuple (code, object id, size,
        checksum, offset, message): decoded here, read by name from here on."""
        code, object_id, size, checksum, _offset, message = header
        return cls(code, object_id, size, checksum, message)

    @property
    def ok(self) -> bool:
        return self.code == pb.OK

    def error(self, key: str | None = None) -> KVStoreError | None:
        """The answer's error for ``key``, or None when it is OK."""
        return None if self.code == pb.OK else error_for_code(self.code, self.message, key=key)
