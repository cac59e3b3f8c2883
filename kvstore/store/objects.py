"""What a store node knows about each object it holds, and the moves between its tiers.

An object has at most one copy per tier of the node's chain (level 0 is
DRAM, then the slower tiers)::

    copy(level)   DRAM extent | GPU extent | SSD extent     None where absent
                  level 0       level 1      level 2        (GPU only with --gpu)

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
from dataclasses import dataclass

from kvstore._native import StoredObjectBase, untracked_subclass
from kvstore.store.tiers.base import Extent, ObjectRecord


class ObjectState(enum.Enum):
    WRITING = 1    # space reserved, bytes arriving
    COMPLETE = 2   # checksum verified, readable


_COMPLETE = 1          # _flags bits; a set bit means the field is True
_CONFIRMED = 2
_STAGED = 4
_DOOMED = 8
_MOVING = 16
_PROMOTING = 32
_MANY = 64             # _copy is a list indexed by level (two copies or more)
_DRAM = 128            # its DRAM copy (level 0) is inline in the record, not in _copy
_LEVEL_SHIFT = 8       # with one copy in _copy: its level, in bits 8..15
KEY_BYTES = 1          # _key_form bits (read-only): the key is kept as its 16 bytes, ...
PARENT_BYTES = 2       # ... the parent's key too (32 lowercase hex characters each)


def _flag(bit: int, doc: str) -> property:
    def get(self) -> bool:
        return self._flags & bit != 0

    def put(self, value: bool) -> None:
        self._flags = self._flags | bit if value else self._flags & ~bit

    return property(get, put, doc=doc)


class ObjectExtras:
    """The rarely set fields of a :class:`StoredObject` (pins, prefetch lookahead),
    apart so that an object never pinned or prefetched does not carry them."""

    __slots__ = ("hard_pins", "soft_pin_until_s", "protect_until_s")

    def __init__(self) -> None:
        self.hard_pins = 0
        self.soft_pin_until_s = 0.0
        self.protect_until_s = 0.0


_NO_EXTRAS = ObjectExtras()   # shared, read-only: what an object without extras reads


class StoredObject(StoredObjectBase):
    """One version of an object on this node: its identity, its copies and its state.

    Memory (64-bit CPython): 128 bytes, its fields stored inline by the native
    base (``kvstore/native/stored_object.cpp``: object_id, size_bytes, checksum,
    last_access_s, slot, refs, replica_num, the flags and the DRAM copy's
    offset, reserved bytes and serial are C numbers, not Python objects of
    their own; a key and a parent key of 32 lowercase hex characters, as
    :mod:`kvstore.keys` makes them, are kept as their 16 bytes and read as a new
    string; the type is built without the cyclic GC), plus its slower copies'
    extents. Compact by layout::

        DRAM     the DRAM copy (level 0), inline while _flags has _DRAM; copy(0)
                 hands it out as a new Allocation (equal to the one installed)
        _copy    the one slower copy's extent (its level in _flags), or None;
                 a list by level only while it has two copies or more there
        _flags   state, confirmed, staged, doomed, moving, promoting (bits),
                 and the one copy's level
        _extra   None, or an ObjectExtras once pinned or prefetched

    A native object table would keep all of it in arrays (see the i33 report).

    Args:
        key: its key.
        object_id: the master's id of this version.
        size_bytes: value length.
        checksum: xxh3-64 announced by the writer.
        parent: previous block of its prefix chain (eviction hint), or None.
        copies: per level of the node's chain, its extent or None.
        state, confirmed, staged, refs, doomed, moving, promoting, hard_pins,
            soft_pin_until_s, protect_until_s, last_access_s, replica_num, slot:
            the fields below (keyword arguments).
    """

    __slots__ = ()      # the fields are the native base's

    def __init__(self, key: str, object_id: int, size_bytes: int, checksum: int,
                 parent: str | None, copies: list[Extent | None] | None = None, *,
                 state: ObjectState = ObjectState.WRITING, confirmed: bool = False,
                 staged: bool = False, refs: int = 0, doomed: bool = False, moving: bool = False,
                 promoting: bool = False, hard_pins: int = 0, soft_pin_until_s: float = 0.0,
                 protect_until_s: float = 0.0, last_access_s: float | None = None,
                 replica_num: int = 0, slot: int = -1) -> None:
        self.key = key
        self.object_id = object_id         # the master's id of this version
        self.size_bytes = size_bytes
        self.checksum = checksum           # xxh3-64 announced by the writer
        self.parent = parent               # previous block of its prefix chain (eviction hint)
        self.replica_num = replica_num     # replicas its put asked for (0: not said), for the inventory
        self.refs = refs                   # readers, the writer, a move in flight; > 0 pins every copy
        # monotonic, of the last read or write (the policies' clock)
        self.last_access_s = time.monotonic() if last_access_s is None else last_access_s
        self.slot = slot                   # its position in the table's slots while in service
        self._copy: Extent | list[Extent | None] | None = None
        self._flags = ((_COMPLETE if state is ObjectState.COMPLETE else 0)
                       | (_CONFIRMED if confirmed else 0) | (_STAGED if staged else 0)
                       | (_DOOMED if doomed else 0) | (_MOVING if moving else 0)
                       | (_PROMOTING if promoting else 0))
        self._extra: ObjectExtras | None = None
        for level, extent in enumerate(copies or ()):
            if extent is not None:
                self.set_copy(level, extent)
        if hard_pins or soft_pin_until_s or protect_until_s:
            extra = self._extras()
            extra.hard_pins, extra.soft_pin_until_s = hard_pins, soft_pin_until_s
            extra.protect_until_s = protect_until_s

    # ------------------------------------------------------------ state

    @property
    def state(self) -> ObjectState:
        """WRITING (space reserved, bytes arriving) or COMPLETE (checksum verified, readable)."""
        return ObjectState.COMPLETE if self._flags & _COMPLETE else ObjectState.WRITING

    @state.setter
    def state(self, value: ObjectState) -> None:
        self._flags = (self._flags | _COMPLETE if value is ObjectState.COMPLETE
                       else self._flags & ~_COMPLETE)

    confirmed = _flag(_CONFIRMED, "A master applied its STORED event (or it was recovered from a tier).")
    staged = _flag(_STAGED, "A newer version waiting for the master; not in service yet.")
    doomed = _flag(_DOOMED, "Out of service; if still referenced, freed at the last release.")
    moving = _flag(_MOVING, "The mover is copying it between tiers.")
    promoting = _flag(_PROMOTING, "A reader or the mover is copying it up to DRAM.")

    def _extras(self) -> ObjectExtras:
        if self._extra is None:
            self._extra = ObjectExtras()
        return self._extra

    @property
    def hard_pins(self) -> int:
        """PINs without a TTL, until as many UNPINs."""
        return (self._extra or _NO_EXTRAS).hard_pins

    @hard_pins.setter
    def hard_pins(self, value: int) -> None:
        self._extras().hard_pins = value

    @property
    def soft_pin_until_s(self) -> float:
        """Monotonic; evicted only after unpinned objects until then."""
        return (self._extra or _NO_EXTRAS).soft_pin_until_s

    @soft_pin_until_s.setter
    def soft_pin_until_s(self, value: float) -> None:
        self._extras().soft_pin_until_s = value

    @property
    def protect_until_s(self) -> float:
        """Monotonic; prefetch lookahead: never evicted until then."""
        return (self._extra or _NO_EXTRAS).protect_until_s

    @protect_until_s.setter
    def protect_until_s(self, value: float) -> None:
        self._extras().protect_until_s = value

    # ------------------------------------------------------------ copies

    def copy(self, level: int) -> Extent | None:
        """The extent of its copy at ``level`` of the node's chain, or None."""
        if level == 0 and self._flags & _DRAM:
            return self._dram()
        c = self._copy
        if self._flags & _MANY:
            return c[level] if level < len(c) else None
        return c if c is not None and self._flags >> _LEVEL_SHIFT == level else None

    def set_copy(self, level: int, extent: Extent | None) -> None:
        """Install (``extent``) or forget (None) its copy at ``level``."""
        if level == 0:
            if extent is not None and self._set_dram(extent):    # inline: no object kept
                extent = None
            else:
                self._set_dram(None)
            if extent is None and self._copy is None:
                return
        flags = self._flags
        if flags & _MANY:
            c = self._copy
            if level >= len(c):
                c.extend([None] * (level + 1 - len(c)))
            c[level] = extent
            if extent is None and sum(e is not None for e in c) <= 1:   # back to one copy
                items = [(i, e) for i, e in enumerate(c) if e is not None]
                self._flags = flags & ~_MANY & ((1 << _LEVEL_SHIFT) - 1)
                self._copy = None
                if items:
                    self.set_copy(*items[0])
            return
        have = self._copy is not None
        at = flags >> _LEVEL_SHIFT
        if not have or at == level:
            if extent is None:
                self._copy = None
            else:
                self._copy = extent
                self._flags = (flags & ((1 << _LEVEL_SHIFT) - 1)) | (level << _LEVEL_SHIFT)
        elif extent is not None:       # a second copy: a list from now on
            c: list[Extent | None] = [None] * (max(at, level) + 1)
            c[at], c[level] = self._copy, extent
            self._copy = c
            self._flags = flags | _MANY

    def copy_items(self) -> list[tuple[int, Extent]]:
        """(level, extent) of each copy, fastest first."""
        c, flags = self._copy, self._flags
        if flags & _MANY:
            out = [(level, e) for level, e in enumerate(c) if e is not None]
        else:
            out = [] if c is None else [(flags >> _LEVEL_SHIFT, c)]
        if flags & _DRAM:
            out.insert(0, (0, self._dram()))
        return out

    @property
    def alloc(self) -> Extent | None:
        """The DRAM copy's extent (None when the object is only in slower tiers)."""
        return self.copy(0)

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
        items = self.copy_items()
        return items[0][0] if items else None

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
        if (self.refs or self._flags & (_COMPLETE | _MOVING | _PROMOTING) != _COMPLETE
                or self.copy(level) is None):
            return False
        extra = self._extra
        return extra is None or (extra.hard_pins == 0 and extra.protect_until_s <= now
                                 and (soft_ok or extra.soft_pin_until_s <= now))

    def __repr__(self) -> str:
        return (f"StoredObject(key={self.key!r}, object_id={self.object_id}, "
                f"size_bytes={self.size_bytes}, state={self.state.name}, refs={self.refs}, "
                f"copies={self.copy_items()}, slot={self.slot})")


# Rebuilt without the cyclic GC: a class statement's subclass of a native type is
# always GC-tracked (16 B more per object, and every new object walked by the young
# collections), though a record never refers back to itself.
StoredObject = untracked_subclass(StoredObject)


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


def inventory_rows(objects, tiers: list[int]) -> list[tuple]:
    """(key, object_id, size_bytes, checksum, tier, pending, replica_num) of each complete
    object of ``objects`` (None skipped): what a registration lists
    (:mod:`kvstore.store.inventory`). ``tiers``: the wire tier of each level; an object's
    is its fastest copy's; pending: its STORED event not yet applied by a master.

    Reads the flags directly (about 0.6 µs an object here, 1.7 with the properties): it
    runs over every object of the node, under its lock, a chunk at a time."""
    out = []
    for o in objects:
        if o is None:
            continue
        f = o._flags
        if not f & _COMPLETE:
            continue
        level = (0 if f & _DRAM else f >> _LEVEL_SHIFT if not f & _MANY and o._copy is not None
                 else o.best_level())
        out.append((o.key, o.object_id, o.size_bytes, o.checksum, tiers[level],
                    not f & _CONFIRMED, o.replica_num))
    return out
