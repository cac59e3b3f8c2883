"""DRAM tier: one POSIX shared-memory segment with our own offset allocator.

    segment  [0 ........................................ capacity_bytes) [read slots]
              | obj A |  free  | obj B | obj C |      free           |
    each object = one Allocation (offset, reserved_bytes, 64-byte aligned)
    read slots: which allocations same-host readers may copy without a
                reference (kvstore.transfer.shm_slots), TABLE_BYTES after capacity
    serving:    which allocations the native GET service may send, and how many
                of its sends are under way from each (kvstore/native/serving.hpp):
                a range it still sends from is freed only at its last send's end

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

from kvstore._native import ServingIndex
from kvstore.store.allocator import Allocation
from kvstore.store.tiers.base import OffsetTier
from kvstore.types import TierKind
from kvstore.transfer.shm import SHM_DIR, ShmSegment
from kvstore.transfer.shm_slots import TABLE_BYTES, ReadSlots

#: Copies the native GET service sends at most (about 200 B of native memory each,
#: beside the objects'); past it, reads of further objects stay Python's.
MAX_SERVED_COPIES = 1 << 20


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
        """Raises:
            ValueError: ``SHM_DIR`` (a tmpfs) has not that much room free: a segment
                larger than it would take a SIGBUS at the first page it cannot back.
        """
        if name is None:
            remove_orphan_segments()
        room = shm_free_bytes()
        if room is not None and capacity_bytes + TABLE_BYTES > room:
            raise ValueError(f"a DRAM tier of {capacity_bytes} B does not fit: {SHM_DIR} has "
                             f"{room} B free (shared memory is backed by it)")
        super().__init__(capacity_bytes)
        self.name = name or f"kvstore-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.segment = ShmSegment(self.name, capacity_bytes + TABLE_BYTES, create=True)
        self.slots = ReadSlots(self.segment.view, create=True)
        self.slots.lease(float("inf"))   # until a lease says otherwise (a node with masters)
        # What the native GET service may send (kvstore.store.native_gets).
        self.serving = ServingIndex(self.segment.view, MAX_SERVED_COPIES)
        self.serving.set_lease(float("inf"))
        self._deferred: dict[int, Allocation] = {}   # serial -> freed while still being sent
        if prefault:
            self.segment.prefault_in_background()

    def view(self, extent: Allocation) -> memoryview:
        """The object's bytes in the segment (a view, no copy)."""
        return self.segment.view[extent.offset:extent.offset + extent.size_bytes]

    def allocate(self, record) -> Allocation | None:
        self.reap()
        return super().allocate(record)

    def free(self, extent: Allocation) -> None:
        self.slots.hide(extent.serial)
        if self.serving.withdraw(extent.serial):
            self._deferred[extent.serial] = extent     # freed once its sends are over
            return
        super().free(extent)

    def reap(self) -> None:
        """Free the ranges whose last native send ended since they were freed (a range
        hidden while sent, then freed after its sends, was freed then: skipped)."""
        for serial in self.serving.take_released():
            extent = self._deferred.pop(serial, None)
            if extent is not None:
                super().free(extent)

    def publish(self, extent: Allocation) -> None:
        self.slots.publish(extent.serial)

    def serve(self, key: str, extent: Allocation, checksum: int, object_id: int,
              slot: int) -> None:
        self.serving.publish(key, extent.serial, extent.offset, extent.size_bytes, checksum,
                             object_id, slot)

    def hide(self, extent: Allocation) -> None:
        self.slots.hide(extent.serial)
        self.serving.withdraw(extent.serial)    # its free waits for sends under way

    def lease(self, until_s: float) -> None:
        self.slots.lease(until_s)
        self.serving.set_lease(until_s)

    def check_invariants(self) -> None:
        self.reap()
        super().check_invariants()

    def close(self) -> None:
        if not self.segment.closed:
            self.slots.lease(0.0)        # readers holding locations go back to the node
        self.serving.set_lease(0.0)      # no native send starts from an unmapped segment
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


def shm_free_bytes() -> int | None:
    """Bytes free in ``SHM_DIR`` (None: it cannot be asked)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
