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

Free extents are indexed three ways, kept in step by ``_add_free`` and
``_remove_free``::

    _by_size   sorted [(length, start), ...]  best fit: bisect for the first
                                             length >= request (lowest start
                                             breaks ties)
    _by_start  {start: length}                right neighbour of a freed range
    _by_end    {end: start}                   left neighbour of a freed range

Allocate is a best-fit bisect, free coalesces in O(1) dict lookups plus a
bisect; both are O(log n) comparisons in the number of free extents (the
sorted list's insert/delete is a memmove, negligible at the extent counts a
node sees).

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

import bisect
import logging
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

DEFAULT_ALIGNMENT_BYTES = 64
"""One cache line: objects never share a line, and copies stay aligned."""


@dataclass(frozen=True, slots=True)
class Allocation:
    """A live range handed out by an ``OffsetAllocator``."""

    offset: int  # start of the range, a multiple of the alignment
    size_bytes: int  # bytes requested; the object's bytes are [offset, offset + size_bytes)
    reserved_bytes: int  # bytes taken from the free space; >= size_bytes, >= 1
    # Unique among this allocator's allocations, ever (1, 2, ...): names one
    # lifetime of a range, so a reader can tell "the same bytes as before"
    # from "a later object at the same offset" (see kvstore.transfer.shm).
    serial: int = field(default=0, compare=False)

    @property
    def end(self) -> int:
        """One past the last reserved byte."""
        return self.offset + self.reserved_bytes


class OffsetAllocator:
    """Best-fit offset allocator over ``[0, capacity_bytes)``.

    Args:
        capacity_bytes: size of the managed range; >= 0.
        alignment: offsets are multiples of this and sizes round up to it;
            a power of two.

    Raises:
        ValueError: an argument is out of range.

    Thread safety: not thread-safe; the owner serialises calls.
    """

    __slots__ = (
        "_capacity_bytes",
        "_alignment",
        "_used_bytes",
        "_free_bytes",
        "_by_size",
        "_by_start",
        "_by_end",
        "_live",
        "_serial",
    )

    def __init__(self, capacity_bytes: int, alignment: int = DEFAULT_ALIGNMENT_BYTES):
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self._capacity_bytes = capacity_bytes
        self._alignment = alignment
        self._used_bytes = 0
        self._free_bytes = 0
        self._by_size: list[tuple[int, int]] = []  # (length, start), sorted
        self._by_start: dict[int, int] = {}  # start -> length
        self._by_end: dict[int, int] = {}  # end -> start
        self._live: dict[int, Allocation] = {}  # offset -> live allocation
        self._serial = 0  # the last serial handed out
        if capacity_bytes:
            self._add_free(0, capacity_bytes)
        logger.debug("offset allocator: %d B, alignment %d B", capacity_bytes, alignment)

    # ------------------------------------------------------------------ queries

    @property
    def capacity_bytes(self) -> int:
        """Size of the managed range."""
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by live allocations (sum of ``reserved_bytes``)."""
        return self._used_bytes

    @property
    def free_bytes(self) -> int:
        """Bytes in free extents; ``capacity_bytes - used_bytes``."""
        return self._free_bytes

    @property
    def largest_free_bytes(self) -> int:
        """Length of the largest free extent; ``allocate`` of this many bytes succeeds."""
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def num_allocations(self) -> int:
        """Live allocations."""
        return len(self._live)

    @property
    def num_free_extents(self) -> int:
        """Free extents (1 when nothing is allocated and capacity > 0)."""
        return len(self._by_size)

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
        want = -(-max(size_bytes, 1) // self._alignment) * self._alignment
        i = bisect.bisect_left(self._by_size, (want, -1))
        if i < len(self._by_size):
            length, start = self._by_size[i]
            reserved = want
        else:
            # No aligned fit; the tail extent may still hold it, clipped at capacity.
            start = self._by_end.get(self._capacity_bytes)
            if start is None or start + max(size_bytes, 1) > self._capacity_bytes:
                return None
            length = self._capacity_bytes - start
            reserved = min(want, length)
        self._remove_free(start, length)
        if length > reserved:
            self._add_free(start + reserved, length - reserved)
        self._serial += 1
        alloc = Allocation(offset=start, size_bytes=size_bytes, reserved_bytes=reserved,
                           serial=self._serial)
        self._live[start] = alloc
        self._used_bytes += reserved
        return alloc

    def free(self, alloc: Allocation) -> None:
        """Returns an allocation's range, merging it with free neighbours.

        Args:
            alloc: a live allocation from this allocator.

        Raises:
            ValueError: ``alloc`` is not live here (double free, or foreign).
        """
        live = self._live.get(alloc.offset)
        if live != alloc or live.serial != alloc.serial:
            raise ValueError(f"free of an allocation that is not live here (double free or foreign): {alloc}")
        del self._live[alloc.offset]
        self._used_bytes -= alloc.reserved_bytes
        start, end = alloc.offset, alloc.end
        left_start = self._by_end.get(start)
        if left_start is not None:
            self._remove_free(left_start, start - left_start)
            start = left_start
        right_length = self._by_start.get(end)
        if right_length is not None:
            self._remove_free(end, right_length)
            end += right_length
        self._add_free(start, end - start)

    # ----------------------------------------------------------- free extents

    def _add_free(self, start: int, length: int) -> None:
        bisect.insort(self._by_size, (length, start))
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._free_bytes += length

    def _remove_free(self, start: int, length: int) -> None:
        i = bisect.bisect_left(self._by_size, (length, start))
        if i == len(self._by_size) or self._by_size[i] != (length, start):
            raise AssertionError(f"free extent [{start}, {start + length}) missing from the size index")
        del self._by_size[i]
        del self._by_start[start]
        del self._by_end[start + length]
        self._free_bytes -= length

    def check_invariants(self) -> None:
        """Verifies every invariant in the module docstring; O(n). For tests and debugging.

        Raises:
            AssertionError: an invariant is broken.
        """
        assert self._used_bytes + self._free_bytes == self._capacity_bytes, "used + free != capacity"
        assert self._by_size == sorted(self._by_size), "size index unsorted"
        assert len(self._by_size) == len(self._by_start) == len(self._by_end), "free indexes differ"
        assert sum(a.reserved_bytes for a in self._live.values()) == self._used_bytes, "used_bytes drifted"
        assert sum(length for length, _ in self._by_size) == self._free_bytes, "free_bytes drifted"
        ranges = [(start, length, True) for length, start in self._by_size]
        ranges += [(a.offset, a.reserved_bytes, False) for a in self._live.values()]
        ranges.sort()
        cursor, prev_free = 0, False
        for start, length, is_free in ranges:
            assert start == cursor, f"gap or overlap at {cursor} (next range starts at {start})"
            assert length > 0, f"empty range at {start}"
            assert start % self._alignment == 0, f"unaligned range at {start}"
            assert not (is_free and prev_free), f"uncoalesced free extents meet at {start}"
            if is_free:
                assert self._by_start[start] == length and self._by_end[start + length] == start
            else:
                alloc = self._live[start]
                assert alloc.reserved_bytes >= alloc.size_bytes
            if start + length != self._capacity_bytes:
                assert length % self._alignment == 0, f"unaligned length at {start}"
            cursor, prev_free = start + length, is_free
        assert cursor == self._capacity_bytes, f"ranges end at {cursor}, not {self._capacity_bytes}"

    def __repr__(self) -> str:
        return (
            f"OffsetAllocator(capacity_bytes={self._capacity_bytes}, used_bytes={self._used_bytes}, "
            f"allocations={len(self._live)}, free_extents={len(self._by_size)}, "
            f"largest_free_bytes={self.largest_free_bytes})"
        )


__all__ = ["DEFAULT_ALIGNMENT_BYTES", "Allocation", "OffsetAllocator"]
