"""Read slots: a same-host reader checks in shared memory that an object is still served.

A same-host get used to cost a round trip to the node even when the client
knew where the object lies (SHM_ACQUIRE takes a read reference, so memory is
never reused under a copy). Objects are immutable and every DRAM allocation
has a serial that is unique for the node's life (``Allocation.serial``), so a
reader that copies first and checks afterwards needs no reference: it needs
to know that the allocation was in service for the whole copy. The node
publishes that in a table at the tail of its segment::

    segment  [0 ......... capacity) [ slot 0 | slot 1 | ... | slot N-1 ] [ trailer ]
                 objects              u64 each: the serial in service        64 B:
                                      there, 0 = none                        magic, N,
                                                                             lease_until

    node:    publish(alloc)  slot[serial % N] = serial        (on a read: SHM_ACQUIRE)
             hide(alloc)     slot[serial % N] = 0 if it holds serial
                             (before the object leaves service: retired, demoted, freed)
             lease(until)    trailer.lease_until = until       (monotonic s; 0 = none)
    reader:  s == slot[s % N]  and  now < lease_until
             copy the bytes
             s == slot[s % N]                                  -> the copy is good

Ordering argument. A serial is never published again once hidden (a hidden
allocation is never in service again; its range, reused, gets a new
serial). The node hides a slot before it frees the range, and a writer's
bytes land in a range only after the node reserved it for the writer (the
SHM_ALLOC reply), so on a machine whose stores become visible in one total
order (x86-64: TSO) a reader that sees the serial after its copy saw none of
a later object's bytes: the copy came from the object, whole. Loads are not
reordered with loads there either, so the copy happened between the two
checks. Elsewhere, and when the table is absent, readers keep the
round trip (:data:`OPTIMISTIC_READS`). A serial that collides with another
live one in the same slot only costs a round trip (the later publish wins).

The lease is the node's fence (:mod:`kvstore.store.lease`): a fenced node
answers reads UNAVAILABLE, and the reader must not bypass that through the
table, so the node writes the end of its shortest shard lease here and
readers go back to the round trip past it. ``time.monotonic`` is
CLOCK_MONOTONIC, one clock for every process of one boot. A node killed
without closing leaves its table as it was: readers holding locations copy
its (immutable, still served in the master's view) objects until the lease
runs out, the same bound the fence gives a partitioned node.

What a reader skips also includes the node's read accounting (recency,
frequency, hit counts, a prefetch used): it sends a deferred SHM_TOUCH per
read instead, which rides with its next request.

Thread safety: the node calls publish/hide/lease under its lock; readers in
any process read without one.
"""

from __future__ import annotations

import platform
import struct
import time

MAGIC = b"KVSLOTS1"
SLOT_COUNT = 1 << 16
SLOT = struct.Struct("<Q")
TRAILER = struct.Struct("<8sQd")          # magic, slot count, lease_until (monotonic s)
LEASE = struct.Struct("<d")               # lease_until alone (rewritten while readers read)
LEASE_AT = TRAILER.size - LEASE.size      # its offset in the trailer
TRAILER_BYTES = 64
TABLE_BYTES = SLOT_COUNT * SLOT.size + TRAILER_BYTES
"""Bytes the table adds after a DRAM tier's capacity (512 KiB + 64 B)."""

#: Whether this machine orders stores totally and loads with loads (TSO), which
#: the copy-then-check read relies on; elsewhere every same-host read takes a reference.
OPTIMISTIC_READS = platform.machine().lower() in ("x86_64", "amd64")


class ReadSlots:
    """The read-slot table of one segment view (see the module docstring).

    Args:
        view: the whole segment; the table is its last :data:`TABLE_BYTES`.
        create: the node's side: write the trailer (no lease yet).
    """

    def __init__(self, view: memoryview, create: bool = False):
        self._view = view
        self._trailer = len(view) - TRAILER_BYTES
        self._slots = self._trailer - SLOT_COUNT * SLOT.size
        if create:
            TRAILER.pack_into(view, self._trailer, MAGIC, SLOT_COUNT, 0.0)

    @classmethod
    def attach(cls, view: memoryview) -> ReadSlots | None:
        """The table of a mapped segment, or None when it has none (or the CPU is not TSO)."""
        if not OPTIMISTIC_READS or len(view) < TABLE_BYTES:
            return None
        magic, count, _until = TRAILER.unpack_from(view, len(view) - TRAILER_BYTES)
        if magic != MAGIC or count != SLOT_COUNT:
            return None
        return cls(view)

    def _at(self, serial: int) -> int:
        return self._slots + (serial % SLOT_COUNT) * SLOT.size

    # ---- node side --------------------------------------------------------
    def publish(self, serial: int) -> None:
        """Allocation ``serial`` is in service: readers may copy it without a reference."""
        SLOT.pack_into(self._view, self._at(serial), serial)

    def hide(self, serial: int) -> None:
        """Allocation ``serial`` leaves service (call before its range is freed)."""
        at = self._at(serial)
        if SLOT.unpack_from(self._view, at)[0] == serial:
            SLOT.pack_into(self._view, at, 0)

    def lease(self, until_s: float) -> None:
        """Readers may bypass the node until ``until_s`` (``time.monotonic``; 0: never)."""
        LEASE.pack_into(self._view, self._trailer + LEASE_AT, until_s)

    # ---- reader side ------------------------------------------------------
    def serves(self, serial: int) -> bool:
        """Whether ``serial`` is in service now and the node's lease holds."""
        if time.monotonic() >= LEASE.unpack_from(self._view, self._trailer + LEASE_AT)[0]:
            return False
        return serial != 0 and SLOT.unpack_from(self._view, self._at(serial))[0] == serial

    def still(self, serial: int) -> bool:
        """After a copy: whether ``serial`` was not hidden meanwhile."""
        return SLOT.unpack_from(self._view, self._at(serial))[0] == serial
