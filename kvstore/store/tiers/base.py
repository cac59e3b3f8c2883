"""The storage-tier contract: where a store node keeps the bytes of its objects.

A node keeps its objects in a chain of tiers, fastest first. Every tier
speaks the same small interface, so the node's object table, its eviction
loop and its mover never ask which kind of memory they are talking to::

    Tier (this module)         allocate / free      bytes in and out
    -----------------------    -----------------    --------------------------------------
    DramTier  (dram.py)        offset allocator     view(): zero-copy host view (shm segment)
    GpuTier   (gpu.py)         offset allocator     write_many / read_into: H2D / D2H copies
    SsdTier   (ssd.py)         byte budget          write_many: one durable lmdb commit

Accounting is the tier's own and exact: ``used_bytes + free_bytes ==
capacity_bytes`` always, where used counts what live extents reserve
(allocator alignment, SSD page rounding). An extent is reserved by
``allocate`` before any byte moves and returned by ``free``; running out of
space is a return value (None), never an exception.

Persistent tiers (``persistent = True``) keep what ``write_many`` wrote across
restarts, with an :class:`ObjectRecord` per object, and hand it back from
``recover()``; ``write_many`` returns only once the bytes are durable.

Thread safety: ``allocate``, ``free`` and the accounting properties are not
thread-safe; the owning :class:`~kvstore.store.node.StoreNode` calls them
under its lock. Byte movement (``view`` contents, ``write_many``,
``read_into``, ``flush``) runs outside that lock, on extents the node keeps
alive with a reference; each tier makes those calls safe from any thread.
Blocking I/O (SSD) happens only in these byte-movement calls, never on an
event loop (the data server and the mover are plain threads).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

from kvstore.store.allocator import Allocation, OffsetAllocator
from kvstore.types import TierKind


class TierIOError(Exception):
    """Bytes could not be moved in or out of a tier (disk full, I/O error, device error).

    Expected under pressure (e.g. lmdb's map is full): the node counts the
    move as failed and carries on; it is not a kvstore wire error.
    """


@dataclass(frozen=True, slots=True)
class ObjectRecord:
    """What a persistent tier keeps about an object beside its bytes."""

    key: str              # the object's key
    object_id: int        # the master's id of this version
    size_bytes: int       # value length
    checksum: int         # xxh3-64 of the value
    parent: str | None    # previous block of its prefix chain (eviction hint), or None
    replica_num: int = 0  # replicas its put asked for (0: not said); a rebuilt master index learns it


@dataclass(frozen=True, slots=True)
class RecoveryDrops:
    """Records a persistent tier dropped at recovery (deleted from it), by cause."""

    corrupt: int = 0    # damaged: unreadable, value missing, wrong size or checksum
    surplus: int = 0    # intact, but beyond the capacity (restarted with a smaller size)


class Extent(Protocol):
    """Where one object lives in one tier (each tier has its own handle type)."""

    @property
    def size_bytes(self) -> int: ...       # the object's bytes

    @property
    def reserved_bytes(self) -> int: ...   # what it takes from the tier's capacity


class Tier(ABC):
    """One storage tier of a node.

    Subclasses set ``kind`` and, for tiers that survive restarts, ``persistent``.
    """

    kind: TierKind
    persistent: bool = False
    dropped: RecoveryDrops = RecoveryDrops()   # by recover() (persistent tiers)

    # ---- accounting (caller holds the node's lock) ----
    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """Bytes this tier may hold (the ``--dram`` / ``--ssd`` / ``--gpu`` size)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes reserved by live extents."""

    @property
    def free_bytes(self) -> int:
        """``capacity_bytes - used_bytes``."""
        return self.capacity_bytes - self.used_bytes

    def largest_free_bytes(self) -> int:
        """The largest object ``allocate`` could place now (fragmentation-aware)."""
        return self.free_bytes

    @abstractmethod
    def allocate(self, record: ObjectRecord) -> Extent | None:
        """Reserve room for ``record.size_bytes`` bytes; None when it does not fit."""

    @abstractmethod
    def free(self, extent: Extent) -> None:
        """Return an extent's room. Freeing twice is a bug and raises."""

    # ---- bytes (any thread; the extent is kept alive by the caller) ----
    def view(self, extent: Extent) -> memoryview | None:
        """The extent's bytes as a writable host view (no copy), or None when the
        tier is not host-addressable (GPU, SSD): use ``write_many`` / ``read_into``."""
        return None

    def write_many(self, items: list[tuple[Extent, memoryview]]) -> None:
        """Copy each source into its extent; durable on return for persistent tiers.

        Raises:
            TierIOError: nothing of this call may be assumed written.
        """
        for extent, src in items:
            view = self.view(extent)
            if view is None:
                raise NotImplementedError(f"{type(self).__name__} must implement write_many")
            view[:] = src

    def read_into(self, extent: Extent, dest: memoryview) -> None:
        """Copy the extent's bytes into ``dest[:extent.size_bytes]``.

        Raises:
            TierIOError: the bytes could not be read.
        """
        view = self.view(extent)
        if view is None:
            raise NotImplementedError(f"{type(self).__name__} must implement read_into")
        dest[:extent.size_bytes] = view

    # ---- same-host readers without a reference (kvstore.transfer.shm_slots) ----
    def publish(self, extent: Extent) -> None:
        """An object in service here was read: same-host readers may copy it unreferenced
        until :meth:`hide`. No-op on tiers that same-host clients cannot map."""

    def hide(self, extent: Extent) -> None:
        """The extent's object leaves service here (before its room is reused)."""

    def serve(self, key: str, extent: Extent, checksum: int, object_id: int, slot: int) -> None:
        """An object in service here, confirmed and read: the node's native GET service
        may send it (:mod:`kvstore.store.native_gets`) until :meth:`hide` or
        :meth:`free`. No-op on tiers it cannot send from."""

    def lease(self, until_s: float) -> None:
        """Unreferenced readers stop at ``until_s`` (``time.monotonic``): the node's fence."""

    # ---- persistence ----
    def recover(self) -> list[tuple[ObjectRecord, Extent]]:
        """Objects that survived a restart, already accounted as used (persistent tiers);
        what it dropped is counted in :attr:`dropped`."""
        return []

    def flush(self) -> None:
        """Apply deferred work (e.g. queued SSD deletes); called off the node's lock."""

    def check_invariants(self) -> None:
        """Fails loudly when the accounting is broken (for tests)."""
        assert 0 <= self.used_bytes <= self.capacity_bytes, (self.used_bytes, self.capacity_bytes)

    def close(self) -> None:
        """Release the tier's resources (the node is stopping)."""


class OffsetTier(Tier):
    """A tier that is one contiguous byte range placed by an :class:`OffsetAllocator`
    (DRAM's shared-memory segment, GPU's device buffer); extents are Allocations."""

    def __init__(self, capacity_bytes: int):
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

    def largest_free_bytes(self) -> int:
        return self.allocator.largest_free_bytes

    def allocate(self, record: ObjectRecord) -> Allocation | None:
        """Reserve an extent of ``record.size_bytes``; None when no free extent fits."""
        return self.allocator.allocate(record.size_bytes)

    def free(self, extent: Allocation) -> None:
        self.allocator.free(extent)

    def check_invariants(self) -> None:
        self.allocator.check_invariants()


def copy_between(src: Tier, src_extent: Extent, dst: Tier, dst_extent: Extent) -> None:
    """Copy one object's bytes from one tier to another (no staging when either side has a view).

    Raises:
        TierIOError: from either tier.
    """
    src_view = src.view(src_extent)
    if src_view is not None:
        dst.write_many([(dst_extent, src_view)])
        return
    dst_view = dst.view(dst_extent)
    if dst_view is not None:
        src.read_into(src_extent, dst_view)
        return
    staging = memoryview(bytearray(src_extent.size_bytes))
    src.read_into(src_extent, staging)
    dst.write_many([(dst_extent, staging)])
