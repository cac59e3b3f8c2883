"""Wire formats and transfer plans of the RDMA transport (pure: no pyverbs).

* :class:`QpDescriptor` / :class:`MrDescriptor`: what the RDMA_CONNECT
  exchange carries (layouts in :mod:`kvstore.transfer.rdma`).
* :func:`plan_rounds`: how values that are not in registered memory go
  through the registered staging buffer, round by round.
* :class:`RegionTable`: which registration (lkey) covers a local buffer.
"""

from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass

import numpy as np

from kvstore.errors import InvalidArgument

#: Data-protocol op that sets up RDMA on a connection (see kvstore.transfer.rdma).
#: Far above the SHM_*/PIN/STATS ops so that the core protocol can grow.
OP_RDMA_CONNECT = 32
#: Largest RDMA_CONNECT payload a node should accept.
MAX_CONNECT_BYTES = 4096

_QP_MAGIC, _MR_MAGIC, _VERSION = b"KVRQ", b"KVRM", 1
_QP = struct.Struct("<4sBBBBHHII16s")
_MR = struct.Struct("<4sB3xQQI4x")
_PSN_MASK = (1 << 24) - 1


# ---- wire descriptors (pure) -------------------------------------------------

@dataclass(frozen=True, slots=True)
class QpDescriptor:
    """What the other side needs to connect an RC queue pair to this one."""

    qpn: int          # queue pair number (24 bits)
    psn: int          # initial packet sequence number (24 bits)
    lid: int          # port LID (InfiniBand; 0 on RoCE)
    gid: bytes        # 16-byte GID (RoCE, or global routing on IB); all zero = none
    port: int = 1     # physical port number
    mtu: int = 3      # ibv_mtu enum of the port's active MTU (3 = 1024 B)
    gid_index: int = 0
    rd_atomic: int = 1  # RDMA READs this side accepts in flight (the peer sends at most this many)

    def encode(self) -> bytes:
        """The descriptor's wire bytes (``_QP`` layout, 36 B).

        Raises:
            InvalidArgument: a field does not fit its wire width.
        """
        if len(self.gid) != 16:
            raise InvalidArgument(f"a GID is 16 bytes, got {len(self.gid)}")
        if not 0 <= self.qpn <= _PSN_MASK or not 0 <= self.psn <= _PSN_MASK:
            raise InvalidArgument(f"qpn {self.qpn} / psn {self.psn} must fit in 24 bits")
        try:
            return _QP.pack(_QP_MAGIC, _VERSION, self.port, self.mtu, self.gid_index, self.lid,
                            self.rd_atomic, self.qpn, self.psn, self.gid)
        except struct.error as exc:
            raise InvalidArgument(f"QP descriptor field out of range: {exc}") from None

    @classmethod
    def decode(cls, data: bytes | memoryview) -> "QpDescriptor":
        """Parse :meth:`encode`'s bytes (exactly 36 B).

        Raises:
            InvalidArgument: wrong length, magic or version.
        """
        if len(data) != _QP.size:
            raise InvalidArgument(f"QP descriptor is {_QP.size} B, got {len(data)}")
        magic, version, port, mtu, gid_index, lid, rd_atomic, qpn, psn, gid = _QP.unpack(data)
        if magic != _QP_MAGIC or version != _VERSION:
            raise InvalidArgument(f"not a QP descriptor (magic {magic!r}, version {version})")
        return cls(qpn=qpn, psn=psn, lid=lid, gid=gid, port=port, mtu=mtu, gid_index=gid_index,
                   rd_atomic=rd_atomic)


@dataclass(frozen=True, slots=True)
class MrDescriptor:
    """A remotely accessible memory region: ``[addr, addr + length)`` under ``rkey``."""

    addr: int
    length: int
    rkey: int

    def encode(self) -> bytes:
        """The descriptor's wire bytes (``_MR`` layout, 32 B)."""
        try:
            return _MR.pack(_MR_MAGIC, _VERSION, self.addr, self.length, self.rkey)
        except struct.error as exc:
            raise InvalidArgument(f"MR descriptor field out of range: {exc}") from None

    @classmethod
    def decode(cls, data: bytes | memoryview) -> "MrDescriptor":
        """Parse :meth:`encode`'s bytes (exactly 32 B).

        Raises:
            InvalidArgument: wrong length, magic or version.
        """
        if len(data) != _MR.size:
            raise InvalidArgument(f"MR descriptor is {_MR.size} B, got {len(data)}")
        magic, version, addr, length, rkey = _MR.unpack(data)
        if magic != _MR_MAGIC or version != _VERSION:
            raise InvalidArgument(f"not an MR descriptor (magic {magic!r}, version {version})")
        return cls(addr=addr, length=length, rkey=rkey)

    def remote_address(self, offset: int, size_bytes: int) -> int:
        """Address of ``[offset, offset + size_bytes)`` of the region.

        Raises:
            InvalidArgument: the range is outside the region (a node bug).
        """
        if offset < 0 or size_bytes < 0 or offset + size_bytes > self.length:
            raise InvalidArgument(f"range [{offset}, {offset + size_bytes}) is outside the "
                                  f"node's region of {self.length} B")
        return self.addr + offset


def encode_connect_reply(qp: QpDescriptor, mr: MrDescriptor) -> bytes:
    """The node's RDMA_CONNECT reply payload."""
    return qp.encode() + mr.encode()


def decode_connect_reply(data: bytes | memoryview) -> tuple[QpDescriptor, MrDescriptor]:
    """Parse :func:`encode_connect_reply`'s bytes.

    Raises:
        InvalidArgument: malformed reply.
    """
    if len(data) != _QP.size + _MR.size:
        raise InvalidArgument(f"RDMA_CONNECT reply is {_QP.size + _MR.size} B, got {len(data)}")
    return QpDescriptor.decode(data[:_QP.size]), MrDescriptor.decode(data[_QP.size:])


def gid_to_bytes(gid_text: str) -> bytes:
    """pyverbs' GID text (``'fe80:0000:...'``, 8 groups) -> 16 bytes."""
    try:
        raw = bytes.fromhex(gid_text.replace(":", ""))
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise InvalidArgument(f"bad GID {gid_text!r}")
    return raw


def gid_to_text(gid: bytes) -> str:
    """16 bytes -> pyverbs' GID text."""
    h = gid.hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


# ---- transfer plans (pure) -----------------------------------------------------

@dataclass(frozen=True, slots=True)
class Chunk:
    """One work request through the staging buffer."""

    item: int            # index of the value in the batch
    item_offset: int     # first byte of the value this chunk moves
    length: int          # bytes
    staging_offset: int  # where in the staging buffer


def plan_rounds(sizes: list[int], capacity_bytes: int, max_chunks: int) -> list[list[Chunk]]:
    """Split values into rounds that each fit the staging buffer.

    Values are packed in order; a value larger than what is left of a round
    continues in the next one. Zero-byte values need no work request.

    Args:
        sizes: bytes of each value.
        capacity_bytes: staging buffer size.
        max_chunks: most work requests in flight in one round.

    Returns:
        Rounds of chunks; every byte of every value is in exactly one chunk.

    Raises:
        ValueError: ``capacity_bytes`` or ``max_chunks`` is not positive.
    """
    if capacity_bytes <= 0 or max_chunks <= 0:
        raise ValueError("staging capacity and chunks per round must be positive")
    rounds: list[list[Chunk]] = []
    cur: list[Chunk] = []
    used = 0
    for item, size in enumerate(sizes):
        done = 0
        while done < size:
            if used == capacity_bytes or len(cur) == max_chunks:
                rounds.append(cur)
                cur, used = [], 0
            n = min(size - done, capacity_bytes - used)
            cur.append(Chunk(item, done, n, used))
            used += n
            done += n
    if cur:
        rounds.append(cur)
    return rounds


class RegionTable:
    """Registered local memory: which lkey covers ``[addr, addr + length)``.

    Regions must not overlap (each is one registration of distinct memory).
    """

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._regions: list[tuple[int, int, int]] = []   # (start, end, lkey), sorted by start

    def add(self, start: int, length: int, lkey: int) -> None:
        """Record a registration.

        Raises:
            ValueError: it overlaps one already recorded.
        """
        end = start + length
        i = bisect.bisect_left(self._starts, start)
        if (i > 0 and self._regions[i - 1][1] > start) or \
                (i < len(self._regions) and self._regions[i][0] < end):
            raise ValueError(f"region [{start:#x}, {end:#x}) overlaps a registered one")
        self._starts.insert(i, start)
        self._regions.insert(i, (start, end, lkey))

    def remove(self, start: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start:
            del self._starts[i]
            del self._regions[i]

    def find(self, addr: int, length: int) -> int | None:
        """The lkey of the region holding all of ``[addr, addr + length)``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        start, end, lkey = self._regions[i]
        return lkey if addr + length <= end else None


def address_of(view: memoryview) -> int:
    """Virtual address of a contiguous buffer's first byte (read-only views too)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)
