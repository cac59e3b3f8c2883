"""What a store node knows about each object it holds, and the moves between its tiers.

An object has at most one copy per tier of the node's chain (level 0 is
DRAM, then the slower tiers)::

    copies   [ DRAM extent | GPU extent | SSD extent ]     None where absent
               level 0       level 1      level 2          (GPU only with --gpu)

The fastest copy serves reads; a slower copy of an object that also sits
in DRAM is kept (objects are immutable, so it never goes stale) and makes
the next demotion of that object free.

Thread safety: owned by the node's lock (:class:`~kvstore.store.table.ObjectTable`);
the mover and readers touch a :class:`Move`'s extents off the lock while
the object's reference keeps them alive.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from kvstore.store.tiers.base import Extent, ObjectRecord


class ObjectState(enum.Enum):
    WRITING = 1    # space reserved, bytes arriving
    COMPLETE = 2   # checksum verified, readable


@dataclass(slots=True, eq=False)
class StoredObject:
    key: str
    object_id: int                 # the master's id of this version
    size_bytes: int
    checksum: int                  # xxh3-64 announced by the writer
    parent: str | None             # previous block of its prefix chain (eviction hint)
    copies: list[Extent | None]    # per level of the node's chain; None = no copy there
    state: ObjectState = ObjectState.WRITING
    confirmed: bool = False        # a master applied its STORED event (or recovered from a tier)
    staged: bool = False           # a newer version waiting for the master; not in service yet
    refs: int = 0                  # readers, the writer, a move in flight; > 0 pins every copy
    doomed: bool = False           # out of service; if still referenced, freed at last release
    moving: bool = False           # the mover is copying it between tiers
    promoting: bool = False        # a reader or the mover is copying it up to DRAM
    hard_pins: int = 0             # PIN without a TTL, until as many UNPINs
    soft_pin_until_s: float = 0.0  # monotonic; evicted only after unpinned objects until then
    protect_until_s: float = 0.0   # monotonic; prefetch lookahead: never evicted until then
    last_access_s: float = field(default_factory=time.monotonic)
    replica_num: int = 0           # replicas its put asked for (0: not said), for the inventory
    slot: int = -1                 # its position in the table's slots while in service

    @property
    def alloc(self) -> Extent | None:
        """The DRAM copy's extent (None when the object is only in slower tiers)."""
        return self.copies[0]

    @classmethod
    def of(cls, record: ObjectRecord, copies: list[Extent | None], **state) -> StoredObject:
        """The object a tier record describes, with its copies (and any other fields)."""
        return cls(record.key, record.object_id, record.size_bytes, record.checksum,
                   record.parent, copies, replica_num=record.replica_num, **state)

    @property
    def record(self) -> ObjectRecord:
        return ObjectRecord(self.key, self.object_id, self.size_bytes, self.checksum, self.parent,
                            self.replica_num)

    def best_level(self) -> int | None:
        """Level of the fastest copy, None when there is none."""
        for level, extent in enumerate(self.copies):
            if extent is not None:
                return level
        return None

    def can_give_up(self, level: int, soft_ok: bool, now: float) -> bool:
        """May the copy at ``level`` be dropped (evicted or demoted) now?

        What eviction never takes, at any tier::

            state WRITING            not readable yet
            refs > 0                 being read, written or moved (a reference)
            moving, promoting        a copy between tiers is in flight
            hard_pins > 0            pinned until as many unpins
            protect_until_s > now    prefetch lookahead, until its first read or deadline
            soft_pin_until_s > now   only with ``soft_ok``: soft pins go last, not never

        Args:
            level: the tier level of the copy.
            soft_ok: whether soft-pinned objects may go (the second pass).
            now: ``time.monotonic()`` of the caller's round.

        Returns:
            False also when there is no copy at ``level``.
        """
        return (self.copies[level] is not None
                and self.state is ObjectState.COMPLETE and self.refs == 0 and not self.moving
                and not self.promoting and self.hard_pins == 0 and self.protect_until_s <= now
                and (soft_ok or self.soft_pin_until_s <= now))


@dataclass(slots=True, eq=False)
class Move:
    """One object's copy from one tier to another, planned under the node's lock.

    The planner takes a reference on ``obj`` and marks it moving (demotion)
    or promoting (promotion); the extent ``dst_extent`` is reserved but not yet
    installed. The mover copies off the lock, then hands the move back with
    ``ok`` set, and the node installs or frees the new copy.
    """

    obj: StoredObject
    src_level: int
    dst_level: int
    dst_extent: Extent
    ok: bool = False               # set by the mover: bytes copied (and durable, for SSD)
    error: str = ""                # why not, when not ok
