"""Offset allocator for the DRAM tier: places objects in one byte range.

The DRAM tier is one POSIX shared-memory segment per node; this allocator
decides where in ``[0, capacity_bytes)`` each object lives. It only does
arithmetic on offsets; it never touches the bytes.

Layout and invariants::

    0                                                         capacity_bytes
    |--A--|....free....|--B--|--C--|.......free.......|--D--|..free..|
    ^ every extent starts on an ``alignment`` boundary

    * allocations and free extents tile [0, capacity_bytes) exactly:
          used_bytes + free_bytes == capacity_bytes
    * free extents are fully coalesced: no two free extents touch
      (free() merges a freed range with its free neighbours at once)
    * every extent length is a multiple of ``alignment``, except the one that
      ends at capacity_bytes when capacity_bytes is not a multiple (the tail)

The algorithm lives in C++ (``kvstore/native/allocator.hpp``: a size-ordered
set for best fit, a start-ordered map for coalescing, an open-addressing
table of live allocations), so the allocator itself keeps no Python object per
allocation: 16-32 bytes of native memory per live allocation. Allocate
is a best-fit lookup, free coalesces with both neighbours; both are O(log n)
in the number of free extents. This module is its Python face: the
:class:`Allocation` handle the tiers pass around, and the same contract.

Sizes are rounded up to ``alignment`` (``reserved_bytes``); a request taken
from the tail extent is clipped at ``capacity_bytes`` instead, so that
``allocate(largest_free_bytes)`` always succeeds. A 0-byte request reserves
one alignment unit (clipped the same way), so every live allocation has its
own offset and can be freed exactly once.

Running out of space is expected: ``allocate`` returns None. Freeing an
allocation twice, or one this allocator did not hand out, is a bug and raises.

Thread safety: not thread-safe. The owner (the node's data server, through the
DRAM tier) serialises every call.
"""

from __future__ import annotations

import logging

from kvstore._native import Allocation as _NativeAllocation
from kvstore._native import OffsetAllocatorCore

logger = logging.getLogger(__name__)

DEFAULT_ALIGNMENT_BYTES = 64
"""One cache line: objects never share a line, and copies stay aligned."""


Allocation = _NativeAllocation
"""A live range handed out by an ``OffsetAllocator``: ``Allocation(offset, size_bytes,
reserved_bytes, serial=0)``, immutable, with ``end`` = offset + reserved_bytes.

A native type of 48 bytes (no GC header, no int objects): the DRAM tier keeps
one per object. ``serial`` is unique among the process's allocations, ever
(increasing from 1, one counter for every allocator): it names one lifetime of
a range, so a reader can tell "the same bytes as before" from "a later object
at the same offset" (see kvstore.transfer.shm_slots), and a stale or foreign
handle never frees a live range. Equality compares the range and sizes, not
the serial.
"""


class OffsetAllocator:
    """Best-fit offset allocator over ``[0, capacity_bytes)``.

    Args:
        capacity_bytes: size of the managed range; >= 0.
        alignment: offsets are multiples of this and sizes round up to it;
            a power of two.

    Raises:
        ValueError: an argument is out of range, or the range holds 2**40 - 1
            alignment units or more (64 TiB at the default 64 B).

    Thread safety: not thread-safe; the owner serialises calls.
    """

    __slots__ = ("_core",)

    def __init__(self, capacity_bytes: int, alignment: int = DEFAULT_ALIGNMENT_BYTES):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self._core = OffsetAllocatorCore(capacity_bytes, alignment)
        logger.debug("offset allocator: %d B, alignment %d B", capacity_bytes, alignment)

    # ------------------------------------------------------------------ queries

    @property
    def capacity_bytes(self) -> int:
        """Size of the managed range."""
        return self._core.capacity

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by live allocations (sum of ``reserved_bytes``)."""
        return self._core.used

    @property
    def free_bytes(self) -> int:
        """Bytes in free extents; ``capacity_bytes - used_bytes``."""
        return self._core.free_bytes

    @property
    def largest_free_bytes(self) -> int:
        """Length of the largest free extent; ``allocate`` of this many bytes succeeds."""
        return self._core.largest_free

    @property
    def num_allocations(self) -> int:
        """Live allocations."""
        return self._core.num_allocations

    @property
    def num_free_extents(self) -> int:
        """Free extents (1 when nothing is allocated and capacity > 0)."""
        return self._core.num_free_extents

    @property
    def native_bytes(self) -> int:
        """Bytes of the native table of live allocations (its per-allocation cost)."""
        return self._core.live_table_bytes

    # -------------------------------------------------------------- allocation

    def allocate(self, size_bytes: int) -> Allocation | None:
        """Reserves a range for ``size_bytes`` bytes.

        Args:
            size_bytes: bytes needed; >= 0.

        Returns:
            The allocation, or None when no free extent is large enough (even
            if ``free_bytes`` would be, because space is fragmented).

        Raises:
            ValueError: ``size_bytes`` is negative.
        """
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
        return self._core.allocate(size_bytes)

    def free(self, alloc: Allocation) -> None:
        """Returns an allocation's range, merging it with free neighbours.

        Args:
            alloc: a live allocation from this allocator.

        Raises:
            ValueError: ``alloc`` is not live here (double free, or foreign).
            TypeError: ``alloc`` is not an Allocation.
        """
        self._core.free(alloc)

    def check_invariants(self) -> None:
        """Verifies every invariant in the module docstring; O(n). For tests and debugging.

        Raises:
            AssertionError: an invariant is broken.
        """
        broken = self._core.check()
        assert not broken, broken

    def __repr__(self) -> str:
        return (
            f"OffsetAllocator(capacity_bytes={self.capacity_bytes}, used_bytes={self.used_bytes}, "
            f"allocations={self.num_allocations}, free_extents={self.num_free_extents}, "
            f"largest_free_bytes={self.largest_free_bytes})"
        )


__all__ = ["DEFAULT_ALIGNMENT_BYTES", "Allocation", "OffsetAllocator"]
