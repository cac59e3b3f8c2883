"""A store node's object table: what the node holds, who references it, and the one lock.

The table is the state the node's parts share: its operations
(:class:`~kvstore.store.node.StoreNode`) and its tier movement
(:class:`~kvstore.store.tiering.Tiering`) both work on it::

    objects          key -> the version in service (WRITING or COMPLETE): a native map
                     (kvstore/native/key_map.cpp) of 8 B an entry that reads each key
                     from the record at its slot
    slots            the same objects, each at a fixed position (``obj.slot``), None where
                     one left service: an inventory reads them a chunk at a time, taking
                     the lock per chunk, with no copy of the whole table (see
                     :meth:`~kvstore.store.node.StoreNode.inventory_chunks`)
    staged           (key, object_id) -> a newer version of a key in service, written but
                     not yet confirmed by the master: it replaces the one in service only
                     when the master applies its STORED event (bytes written to the data
                     port without the master never displace what the master confirmed)
    doomed           out of service but still referenced: freed at the last release
    protected        key -> object under prefetch lookahead
    prefetch_queue   key -> object the mover is to promote to DRAM, FIFO
    levels           the tier chain, fastest first          (levels.py)
    counters         NodeCounter -> count since start        (stats.py)
    tenants          bytes in service per tenant, and their guaranteed shares (tenant_shares.py)
    events           every change to what the node holds, for the master (events.py)
    lock, cond       one lock over all of it; writers and promotions waiting for room wait on cond

References. ``obj.refs`` counts the object's readers, its writer (from
``begin_write`` to commit or abort) and the moves in flight. Memory with a
reference is never freed or reused (no time-based lease decides that), so
bytes can be copied off the lock::

    retire(obj)    out of ``objects`` (a drop, an eviction, a newer version): doomed,
                   and hidden from same-host readers without a reference (shm_slots)
                     refs == 0  ->  every copy is freed now
                     refs  > 0  ->  kept in ``doomed``; release() of the last reference frees it

Thread safety: not thread-safe by itself. Every attribute and method is used
with ``lock`` held (callers take ``cond``) and no method takes it (but
:meth:`check_invariants`, for tests);
:meth:`ObjectTable.unlocked` lets a holder release it around a copy or a wait.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
from typing import Iterator

from kvstore._native import KeyMap
from kvstore.store.events import EventLog, Ticket
from kvstore.store.levels import TierLevel
from kvstore.store.objects import PARENT_BYTES, ObjectState, StoredObject
from kvstore.store.stats import NodeCounter
from kvstore.store.tenant_shares import TenantShares
from kvstore.types import EventKind, NodeEvent, TierKind


class ObjectTable:
    """The shared state of one store node (see the module docstring).

    Args:
        levels: the node's tier chain (:func:`~kvstore.store.levels.build_levels`).

    Thread safety: every attribute and method is used with ``lock`` held.
    """

    def __init__(self, levels: list[TierLevel]):
        self.levels = levels
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.slots: list[StoredObject | None] = []
        # key -> the record at its slot: 8 B an entry, no key string (kvstore/native/key_map.cpp)
        self.objects: KeyMap = KeyMap(self.slots)
        self._free_slots: list[int] = []              # positions of slots that are None
        self.staged: dict[tuple[str, int], StoredObject] = {}
        self.doomed: set[StoredObject] = set()
        self.protected: dict[str, StoredObject] = {}       # prefetch lookahead in force
        self.prefetch_queue: dict[str, StoredObject] = {}  # to promote to DRAM, FIFO
        self.counters: dict[NodeCounter, int] = dict.fromkeys(NodeCounter, 0)
        self.events = EventLog()
        self.tenants = TenantShares(self)     # counts only while some tenant has a share

    def enter(self, obj: StoredObject) -> None:
        """Put ``obj`` in service under its key (the caller retired any other version).

        It takes a free slot: an inventory scan already past that position
        misses it, which is right, as its STORED event (or, for a recovered
        object, nothing since) is delivered after the inventory.
        """
        if self._free_slots:
            obj.slot = self._free_slots.pop()
            self.slots[obj.slot] = obj
        else:
            obj.slot = len(self.slots)
            self.slots.append(obj)
        self.objects[obj.key] = obj           # (the map reads the key from slots[obj.slot])
        if self.tenants.active:
            self.tenants.add(obj.key, obj.size_bytes)
        if obj.parent is not None and not obj._key_form & PARENT_BYTES:
            # The parent's own key string, when it is here: one string per key, not
            # two (a chained block's parent key costs 88 bytes otherwise; a key of
            # 32 hex characters is kept as its 16 bytes, no string at all).
            parent = self.objects.get(obj.parent)
            if parent is not None:
                obj.parent = parent.key

    def slot_of(self, key: str | None) -> int:
        """The slot of the object in service under ``key`` (an eviction policy's
        name for it), or -1: no key, or none in service."""
        if key is None:
            return -1
        obj = self.objects.get(key)
        return -1 if obj is None else obj.slot

    def _leave(self, obj: StoredObject) -> None:
        del self.objects[obj.key]             # before its slot is emptied: read from there
        if self.tenants.active:
            self.tenants.sub(obj.key, obj.size_bytes)
        self.slots[obj.slot] = None
        self._free_slots.append(obj.slot)
        obj.slot = -1

    def retire(self, obj: StoredObject) -> None:
        """Take ``obj`` out of service: free now, or at its last release (see the module docstring).

        Ends its lookahead protection (a prefetch wasted) and tells each
        tier's policy that its copy is gone. Retiring twice does nothing.
        """
        if obj.doomed:
            return
        slot = obj.slot                     # the policies know it by its slot
        if self.objects.get(obj.key) is obj:
            self._leave(obj)
        obj.doomed = True
        if obj.copy(0) is not None:       # before any reader could see it gone
            self.levels[0].tier.hide(obj.copy(0))
        if self.protected.get(obj.key) is obj:
            self.end_protection(obj, used=False)
        if self.prefetch_queue.get(obj.key) is obj:
            del self.prefetch_queue[obj.key]
        if obj.staged:                      # never in service: no policy knows it
            obj.staged = False
            self.staged.pop((obj.key, obj.object_id), None)
        elif obj.state is ObjectState.COMPLETE:
            for level, extent in obj.copy_items():
                if extent is not None:
                    self.levels[level].policy.on_remove(slot, obj.key)
        if obj.refs > 0:
            self.doomed.add(obj)
        else:
            self._free_copies(obj)

    def confirm(self, key: str, object_id: int) -> StoredObject | None:
        """The master applied the STORED event of (key, object_id): mark it confirmed,
        and put a staged version in service in place of the older one. Returns the
        object that entered service (None: it was in service already, or is gone)."""
        obj = self.objects.get(key)
        if obj is not None and obj.object_id == object_id:
            obj.confirmed = True
            return None
        obj = self.staged.pop((key, object_id), None)
        if obj is None or obj.doomed:
            return None
        obj.staged = False
        obj.confirmed = True
        old = self.objects.get(key)
        if old is not None:
            self.retire(old)
        self.enter(obj)
        return obj

    def release(self, obj: StoredObject) -> None:
        """Drop one reference; the last one of a retired object frees its copies.

        Raises:
            AssertionError: ``obj`` has no reference (a release without an
                acquire is a bug).
        """
        if obj.refs <= 0:
            raise AssertionError(f"release without a reference on {obj.key}")
        obj.refs -= 1
        if obj.refs == 0 and obj.doomed:
            self.doomed.discard(obj)
            self._free_copies(obj)

    def end_protection(self, obj: StoredObject, used: bool) -> None:
        """End the lookahead protection of ``obj``: a prefetch used (by a read) or wasted."""
        self.protected.pop(obj.key, None)
        self.prefetch_queue.pop(obj.key, None)
        obj.protect_until_s = 0.0
        self.counters[NodeCounter.PREFETCH_USED if used else NodeCounter.PREFETCH_WASTED] += 1

    def published(self, obj: StoredObject) -> None:
        """``obj`` was read where it is: its DRAM copy, if any, may be copied by same-host
        readers without the node (shm_slots) and, while it is the confirmed version in
        service, sent by the native GET service (:mod:`kvstore.store.native_gets`),
        each until the copy is hidden or freed."""
        extent = obj.copy(0)
        if extent is None:
            return
        tier = self.levels[0].tier
        tier.publish(extent)
        if obj.confirmed and self.objects.get(obj.key) is obj:
            tier.serve(obj.key, extent, obj.checksum, obj.object_id, obj.slot)

    def native_reads(self, touches: bytes) -> None:
        """Note what the native GET service read, as a Python read does, per copy read
        (``touches``: pairs of int64 table slot and uint64 allocation serial): its
        recency for the policies and a prefetch used. A copy gone or moved since is
        skipped. (Its reads are counted as they are sent: :meth:`counted`.)"""
        now = time.monotonic()
        for slot, serial in struct.iter_unpack("<qQ", touches):
            obj = self.slots[slot] if 0 <= slot < len(self.slots) else None
            extent = None if obj is None else obj.copy(0)
            if extent is None or extent.serial != serial:
                continue
            obj.last_access_s = now
            for level, _extent in obj.copy_items():
                self.levels[level].policy.on_access(slot, now)
            if self.protected.get(obj.key) is obj:
                self.end_protection(obj, used=True)

    def counted(self) -> dict[NodeCounter, int]:
        """The node's counters, with the reads the native GET service sent."""
        serving = getattr(self.levels[0].tier, "serving", None)
        if serving is None or not serving.gets:
            return self.counters
        out = dict(self.counters)
        out[NodeCounter.GETS] += serving.gets
        return out

    def emit(self, kind: EventKind, obj: StoredObject, tier: TierKind | None) -> Ticket:
        """Append the event of a change to what the node holds (``tier``: None for EVICTED)."""
        return self.events.append(NodeEvent(kind, obj.key, obj.object_id, tier, obj.size_bytes,
                                            obj.checksum))

    @contextlib.contextmanager
    def unlocked(self) -> Iterator[None]:
        """Release the lock for the body of a ``with`` (held before and after it)."""
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()

    def _free_copies(self, obj: StoredObject) -> None:
        for level, extent in obj.copy_items():
            if extent is not None:
                self.levels[level].tier.free(extent)
                obj.set_copy(level, None)

    def check_invariants(self, idle: bool = False) -> None:
        """Fails loudly when tier accounting and the table disagree (for tests).

        Args:
            idle: no move is in flight, so every reserved extent is an installed copy.
        """
        with self.cond:
            for level, lv in enumerate(self.levels):
                lv.tier.check_invariants()
                assert lv.tier.used_bytes + lv.tier.free_bytes == lv.tier.capacity_bytes
                held = sum(o.copy(level).reserved_bytes
                           for o in [*self.objects.values(), *self.staged.values(),
                                     *self.doomed]
                           if o.copy(level) is not None)
                # A move in flight has reserved its destination but not installed it.
                assert held == lv.tier.used_bytes if idle else held <= lv.tier.used_bytes, (
                    lv.tier.kind.name, held, lv.tier.used_bytes)
                assert all(self.slots[o.slot] is o for o in self.objects.values())
                assert len(lv.policy) == sum(o.copy(level) is not None
                                             and o.state is ObjectState.COMPLETE
                                             for o in self.objects.values()), lv.tier.kind.name
