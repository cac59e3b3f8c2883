"""DRAM tier: one POSIX shared-memory segment with our own offset allocator.

    segment  [0 ........................................ capacity_bytes)
              | obj A |  free  | obj B | obj C |      free           |
    each object = one Allocation (offset, reserved_bytes, 64-byte aligned)

Thread safety: not thread-safe; the owning :class:`~kvstore.store.node.StoreNode`
serialises every call under its lock.
"""

from __future__ import annotations

import os
import uuid

from kvstore._proto import kvstore_pb2 as pb
from kvstore.store.allocator import Allocation, OffsetAllocator
from kvstore.transfer.shm import ShmSegment


class DramTier:
    """Objects in a shared-memory segment.

    Args:
        capacity_bytes: segment size.
        name: segment name; defaults to a unique ``kvstore-<pid>-<rand>``.
    """

    tier = pb.DRAM

    def __init__(self, capacity_bytes: int, name: str | None = None):
        self.name = name or f"kvstore-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.segment = ShmSegment(self.name, capacity_bytes, create=True)
        self.allocator = OffsetAllocator(capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.allocator.free_bytes

    def allocate(self, size_bytes: int) -> Allocation | None:
        """Reserve space; None when no free extent is large enough."""
        return self.allocator.allocate(size_bytes)

    def free(self, alloc: Allocation) -> None:
        self.allocator.free(alloc)

    def view(self, alloc: Allocation) -> memoryview:
        """The object's bytes in the segment (a view, no copy)."""
        return self.segment.view[alloc.offset:alloc.offset + alloc.size_bytes]

    def close(self) -> None:
        self.segment.close()
