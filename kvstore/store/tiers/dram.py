"""DRAM tier: one POSIX shared-memory segment with our own offset allocator.

    segment  [0 ........................................ capacity_bytes)
              | obj A |  free  | obj B | obj C |      free           |
    each object = one Allocation (offset, reserved_bytes, 64-byte aligned)

The only host-addressable tier: transports write into it (TCP ``recv_into``,
same-host clients copying through the segment) and read from it, so every
put lands here and an object is promoted here before a shared-memory read.

Thread safety: allocation and accounting are serialised by the owning
:class:`~kvstore.store.node.StoreNode`'s lock; views may be used from any
thread while the node keeps the extent alive.
"""

from __future__ import annotations

import os
import uuid

from kvstore.store.allocator import Allocation
from kvstore.store.tiers.base import OffsetTier
from kvstore.types import TierKind
from kvstore.transfer.shm import SHM_DIR, ShmSegment


class DramTier(OffsetTier):
    """Objects in a shared-memory segment.

    Args:
        capacity_bytes: segment size.
        name: segment name; defaults to a unique ``kvstore-<pid>-<rand>``.
        prefault: map every page of the segment now, on a background thread
            (about 0.45 s per GiB here), so puts do not pay page faults: the
            tier's memory is committed at start, as the node was told to hold
            it (``--no-prefault``: pages are taken at their first write).
    """

    kind = TierKind.DRAM

    def __init__(self, capacity_bytes: int, name: str | None = None, prefault: bool = False):
        if name is None:
            remove_orphan_segments()
        super().__init__(capacity_bytes)
        self.name = name or f"kvstore-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.segment = ShmSegment(self.name, capacity_bytes, create=True)
        if prefault:
            self.segment.prefault_in_background()

    def view(self, extent: Allocation) -> memoryview:
        """The object's bytes in the segment (a view, no copy)."""
        return self.segment.view[extent.offset:extent.offset + extent.size_bytes]

    def close(self) -> None:
        self.segment.close()


def remove_orphan_segments() -> list[str]:
    """Unlink ``kvstore-<pid>-*`` segments whose creating process is gone.

    A node killed with SIGKILL cannot unlink its segment, and tmpfs keeps its
    pages in memory until someone does; the next node on the host does it.
    A segment whose pid is alive (even if reused by another program) is kept.

    Returns:
        The names removed.
    """
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 3 or parts[0] != "kvstore" or not parts[1].isdigit():
            continue
        try:
            os.kill(int(parts[1]), 0)
            continue                      # alive (or not ours to judge)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
            removed.append(name)
        except OSError:
            pass
    return removed
