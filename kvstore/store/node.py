"""A store node: the operations on its object table, over its chain of tiers.

The node owns its memory. Objects are written once and then immutable; a
reader holds a reference for as long as it reads, and memory with a
reference is never freed or reused (the reference rules: ``table.py``)::

    begin_write --> WRITING --commit_write (checksum ok)--> COMPLETE --drop / evict--> doomed
         |                                                     |                          |
         +--abort_write / bad checksum--> freed    acquire/release (refs)   freed when refs == 0

Each object is named by (key, object_id): the master issues a fresh
object_id per put, so a drop order for an old version never frees a newer one.

Parts. The node holds its parts; only the node knows them all::

    StoreNode        node.py       writes, reads, pins, prefetch, drop, events, recovery
     +-- NodeStatsView node_stats.py  its stats, counted outside the lock (base class)
     +-- ObjectTable table.py      objects, doomed, lookahead, levels, counters, events, the lock
     +-- Tiering     tiering.py    reclaim, demotion, promotion: works on the same table
          +-- TierMover mover.py   the thread that runs Tiering's moves off the lock

Tiers. The node keeps a chain of tiers, DRAM first (``DRAM [-> GPU] [-> SSD]``,
see ``tiers/`` and ``levels.py``). Puts land in DRAM, the only tier the
transports address; every tier has its own eviction policy and its own
watermarks (the moves themselves are in ``tiering.py``)::

    DRAM  over high watermark --victims--> copy down (demote) --> GPU / SSD  (mover thread)
          a victim with a slower copy already: drop the DRAM copy (no I/O, inline)
          no tier below has room: evict                          (EVICTED event)
    SSD   over high watermark --victims--> evict (queued lmdb delete, no I/O under the lock)
    read of an object not in DRAM ---------> copy up (promote), keep the slower copy

A demotion counts only once the copy below is durable (the SSD commit);
until then the DRAM copy stays readable, and if the copy fails the object is
evicted instead. Copies between tiers run off the node's lock, in the node's
:class:`~kvstore.store.mover.TierMover` thread (demotions, prefetch
promotions) or in the reading connection's thread (a read that needs DRAM);
a reference on the object keeps both ends alive meanwhile. A write or a
promotion that finds DRAM full waits (bounded) for the mover to make room,
which is the node's backpressure. A node without slower tiers evicts inline,
under the lock, as there is nothing to copy.

Eviction never takes, at any tier, what
:meth:`~kvstore.store.objects.StoredObject.can_give_up` refuses (a
reference, a hard pin, queue lookahead); soft pins (with a TTL) go last.
An existence check never reaches the node: nothing is pinned or refreshed.
When eviction cannot free what a tier needs, :meth:`StoreNode.stats` and the
log say why (``eviction_blocked``), and a write gets NoSpace with the reason.

Every change to what the node holds (stored, demoted, promoted, evicted) is
appended to its event log (``events``, :mod:`kvstore.store.events`), which
the node's agent delivers to the master in order; a commit returns the
STORED event's ticket, and the data server acknowledges the write once the
master applied it.

Thread safety: every public method takes the node's lock (the table's
Condition, which waiters for room wait on); the data server calls them from
one thread per connection, and the mover thread calls the Tiering part,
which takes the same lock. Value bytes are copied outside the lock (a
reference, a WRITING state or a move keeps the memory in place).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, Sequence

from kvstore.errors import ChecksumMismatch, InvalidArgument, KeyConflict, NoSpace, NotFound
from kvstore.keys import value_checksum
from kvstore.sizes import check_fits
from kvstore.store.levels import DEFAULT_WATERMARKS, TierLevel, build_levels
from kvstore.store.limits import NODE_BYTES_PER_OBJECT, UNLIMITED
from kvstore.store.events import EventLog, Ticket
from kvstore.store.inventory import inventory_rows
from kvstore.store.mover import TierMover
from kvstore.store.objects import ObjectState, StoredObject
from kvstore.store.node_stats import NodeStatsView
from kvstore.store.recount import Recount
from kvstore.store.stats import NodeCounter, NodeStats
from kvstore.store.table import ObjectTable
from kvstore.store.tiering import Tiering
from kvstore.store.tiers.base import ObjectRecord, Tier
from kvstore.types import EventKind, InventoryItem, NodeEvent, TierKind

log = logging.getLogger(__name__)

#: Longest soft pin a caller may ask for (a day): what the wire carries is bounded.
MAX_SOFT_PIN_MS = 24 * 3600 * 1000
#: Longest queue-lookahead protection (an hour): a queued request reads its blocks well before.
MAX_PREFETCH_MS = 3600 * 1000


class StoreNode(NodeStatsView):
    """The object table of one node over its tiers, and the operations on it.

    Args:
        tiers: the DRAM tier, or the chain ``[DramTier, (GpuTier,) (SsdTier)]``,
            fastest first; the first must be DRAM.
        policy: eviction policy name (``kvstore.store.eviction`` registry),
            one instance per tier.
        high_watermark, low_watermark: memory tiers (DRAM, GPU) evict above
            ``high`` down to ``low`` (fractions of capacity).
        ssd_watermarks: (high, low) of the SSD tier.
        room_wait_s: how long a write or a promotion waits for the mover to
            make room before NoSpace.
        start_mover: start the mover thread now (nodes with slower tiers).
        max_objects: objects held at most (:mod:`kvstore.store.limits`).

    Attributes:
        levels: the tier chain, fastest first, one :class:`TierLevel` each.
        tier: the DRAM tier, where puts land and reads are served.
        counters: the node's counters since start, live (``kvstore.store.stats``;
            str-valued keys, so ``counters["puts"]`` reads one too).
        events: the node's event log (every change to what it holds, for the master).
        mover: the tier mover thread; None for a node with DRAM only.

    Raises:
        ValueError: bad watermarks or chain.

    Thread safety: see the module docstring.
    """

    def __init__(self, tiers: Tier | Sequence[Tier], policy: str = "default",
                 high_watermark: float = 0.95, low_watermark: float = 0.85, *,
                 ssd_watermarks: tuple[float, float] = DEFAULT_WATERMARKS[TierKind.SSD],
                 room_wait_s: float = 5.0, start_mover: bool = True,
                 max_objects: int = UNLIMITED):
        chain = [tiers] if isinstance(tiers, Tier) else list(tiers)
        self._table = ObjectTable(build_levels(chain, policy, high_watermark, low_watermark,
                                               ssd_watermarks))
        self.max_objects = max_objects
        self._tiering = Tiering(self._table, room_wait_s)
        self.levels: list[TierLevel] = self._table.levels
        self.tier: Tier = chain[0]
        self.counters: dict[NodeCounter, int] = self._table.counters
        self.events: EventLog = self._table.events
        self.tenants = self._table.tenants    # tenants' shares: eviction order (tenant_shares.py)
        self.events.set_on_applied(lambda event: self.confirm(event.key, event.object_id))
        self._counted: NodeStats | None = None      # the last full count (full_stats) ...
        self._recount = Recount()                    # ... and when to count again
        self._recounting = False                     # ... a count runs (full_stats)
        self._recover()
        self.mover: TierMover | None = self._tiering.mover
        if self.mover is not None and start_mover:
            self.mover.start()

    # ================================================================ write
    def begin_write(self, key: str, object_id: int, size_bytes: int, checksum: int,
                    parent: str | None = None, replica_num: int = 0) -> tuple[StoredObject, bool]:
        """Reserve DRAM for a new object (waiting, bounded, for the mover to make room);
        ``replica_num`` (what the put asked for, 0: not said) goes to the inventory.

        Returns:
            ``(obj, already_present)``: when this exact version is already
            complete, ``already_present`` is True and nothing must be written.

        Raises:
            InvalidArgument: negative size, or this version is being written.
            TooLarge: larger than :meth:`max_object_bytes` (kvstore.sizes.check_fits).
            NoSpace: no room, even after evicting or demoting every object that
                may go; the message says what holds the rest.
        """
        if size_bytes < 0:
            raise InvalidArgument(f"size_bytes must be >= 0, got {size_bytes}", key=key)
        check_fits(size_bytes, self.max_object_bytes(), "this node", key=key)
        record = ObjectRecord(key, object_id, size_bytes, checksum, parent, replica_num)
        with self._table.cond:
            present = self._present_locked(key, object_id, checksum)
            if present is not None:
                return present, True
            self.tenants.check_limit(key, size_bytes)   # over its tenant's quota alone: NoSpace
            self._check_count_locked(record)
            alloc = self._tiering.room_for_put_locked(record)   # NoSpace: no room for it
            try:
                # The lock may have been released while waiting: look again.
                present = self._present_locked(key, object_id, checksum)
            except (InvalidArgument, KeyConflict):
                self.tier.free(alloc)
                raise
            if present is not None:
                self.tier.free(alloc)
                return present, True
            # The writer holds a reference until commit or abort, so a drop
            # during the write never frees memory that is still being filled.
            obj = StoredObject.of(record, [alloc] + [None] * (len(self.levels) - 1), refs=1)
            if key in self._table.objects:
                # A newer version: staged until its master confirms it; the one
                # in service stays readable (and is retired) only then.
                obj.staged = True
                self._table.staged[(key, object_id)] = obj
            else:
                self._table.enter(obj)
            return obj, False

    def _check_count_locked(self, record: ObjectRecord) -> None:
        """Make room for one more object under ``max_objects`` (evicting one that may go
        for this put, where a policy evicts); raises NoSpace when none may go."""
        key = record.key
        held = len(self._table.objects) + len(self._table.staged)
        if held < self.max_objects or self._tiering.evict_one_locked(record):
            return
        self.counters[NodeCounter.OVER_OBJECT_LIMIT] += 1
        raise NoSpace(f"this node holds {held} objects, its limit (--max-objects "
                      f"{self.max_objects}: about {self.max_objects * NODE_BYTES_PER_OBJECT >> 20}"
                      f" MiB of its memory at {NODE_BYTES_PER_OBJECT} B each, beside the "
                      f"values), and none may be evicted", key=key)

    def _present_locked(self, key: str, object_id: int, checksum: int) -> StoredObject | None:
        """This exact version, complete (None: not here).

        Raises:
            KeyConflict: the object id holds other committed bytes.
            InvalidArgument: this version is being written already.
        """
        old = self._table.objects.get(key)
        if old is None or old.object_id != object_id:
            old = self._table.staged.get((key, object_id))
        if old is None:
            return None
        if old.state is ObjectState.WRITING:
            raise InvalidArgument("this version is being written already", key=key)
        if checksum and old.checksum != checksum:    # 0: announced at the commit
            raise KeyConflict(f"object {object_id} already holds other bytes "
                              f"(checksum {old.checksum:#x}); objects are immutable", key=key)
        return old

    def max_object_bytes(self) -> int:
        """The largest value this node keeps: written into the first tier, and below
        the high watermark of a tier that evicts (a larger one would be evicted as
        soon as it was stored, and everything else with it)."""
        keep = max(int(lv.high * lv.tier.capacity_bytes) if lv.policy.evicts
                   else lv.tier.capacity_bytes for lv in self.levels)
        return min(self.tier.capacity_bytes, keep)

    def write_view(self, obj: StoredObject) -> memoryview:
        """Where the writer puts the value (valid while ``obj`` is WRITING)."""
        return self.tier.view(obj.copy(0))

    def commit_write(self, obj: StoredObject, checksum: int | None = None,
                     actual: int | None = None) -> Ticket:
        """Verify the checksum and make the object readable here.

        Args:
            checksum: the value's checksum when it was not known at
                :meth:`begin_write` (a value written part by part); None: the
                one announced there.
            actual: the xxh3-64 of the bytes in the write's space, when the
                caller hashed them as they arrived there (a TCP put hashes each
                chunk it received); None: they are hashed here.

        Returns:
            The ticket of the object's STORED event: the write is acknowledged
            once it is resolved (the master made the object visible).

        Raises:
            ChecksumMismatch: the bytes are not what the writer announced;
                the space is freed and nothing stays behind.
            NotFound: the object was dropped while being written.
        """
        if actual is None:
            actual = value_checksum(self.tier.view(obj.copy(0)))
        with self._table.cond:
            if checksum is not None and obj.state is ObjectState.WRITING:
                obj.checksum = checksum
            if actual != obj.checksum:
                self.counters[NodeCounter.CHECKSUM_ERRORS] += 1
                self._table.retire(obj)
                self._table.release(obj)
                raise ChecksumMismatch(f"checksum {actual:#x} != announced {obj.checksum:#x}",
                                       key=obj.key)
            if obj.doomed:
                # Dropped while being written: the writer loses, memory goes back.
                self._table.release(obj)
                raise NotFound("object was dropped while being written", key=obj.key)
            obj.state = ObjectState.COMPLETE
            self._table.release(obj)
            self.counters[NodeCounter.PUTS] += 1
            obj.last_access_s = time.monotonic()
            if not obj.staged:            # a staged version enters the policy in service
                self.levels[0].policy.on_insert(obj.slot, obj.copy(0).reserved_bytes,
                                                obj.last_access_s,
                                                self._table.slot_of(obj.parent), obj.key)
            # Before anything that may follow it (an inline eviction): events are ordered.
            ticket = self._table.emit(EventKind.STORED, obj, TierKind.DRAM)
            if not self.events.has_delivery():
                self._confirm_locked(obj.key, obj.object_id)   # no master to ask (tests, tools)
            self._tiering.after_growth_locked(0)
            return ticket

    def confirm(self, key: str, object_id: int) -> None:
        """The master applied this object's STORED event (called before its writer is
        acknowledged): it counts as committed, and a staged newer version replaces
        the one in service."""
        with self._table.cond:
            self._confirm_locked(key, object_id)

    def _confirm_locked(self, key: str, object_id: int) -> None:
        obj = self._table.confirm(key, object_id)
        if obj is not None and obj.copy(0) is not None:
            self.levels[0].policy.on_insert(obj.slot, obj.copy(0).reserved_bytes,
                                            obj.last_access_s, self._table.slot_of(obj.parent),
                                            obj.key)
        self._tiering.after_growth_locked(0)    # it may be demoted now

    def abort_write(self, obj: StoredObject) -> None:
        """Give back the space of an unfinished write."""
        with self._table.cond:
            if obj.state is ObjectState.WRITING:
                self._table.retire(obj)
                self._table.release(obj)

    # ================================================================ read
    def acquire(self, key: str, object_id: int = 0, *, require_dram: bool = True,
                held_bytes: int = 0) -> StoredObject:
        """Take a read reference on a complete object (``object_id`` 0 = any version).

        An object not in DRAM is promoted first (an SSD or GPU hit; the slower copy
        stays). The first read of a prefetched object ends its lookahead protection.

        Args:
            require_dram: True (shared-memory readers): the object must end up
                in DRAM, else NoSpace. False (TCP): when DRAM has no room soon,
                return it anyway and read it with :meth:`read_into`.
            held_bytes: DRAM bytes the caller holds referenced itself (a connection's
                batch): past DRAM with them, a promotion does not wait for room.

        Raises:
            NotFound: no complete object under this key (and version), or its only
                copy turned out corrupt. NoSpace: ``require_dram`` and no DRAM room.
        """
        with self._table.cond:
            obj = self._complete_locked(key, object_id)
            obj.refs += 1
            self._note_read_locked(obj)
            if obj.copy(0) is not None:
                return obj
            futile = held_bytes + obj.size_bytes > self.tier.capacity_bytes   # see Args
            wait_s = 0.0 if futile else self._tiering.room_wait_s
            try:
                self._tiering.promote_locked(obj, wait_s if require_dram else min(wait_s, 0.25))
            except NoSpace:
                if require_dram:
                    self._table.release(obj)
                    raise
            except BaseException:
                self._table.release(obj)
                raise
            return obj

    def touch(self, key: str, object_id: int) -> int:
        """Count a read made without a reference (SHM_TOUCH) as :meth:`acquire` does;
        returns its bytes (0, counting nothing, when the version is gone meanwhile)."""
        with self._table.cond:
            obj = self._table.objects.get(key)
            if obj is None or obj.state is not ObjectState.COMPLETE or (
                    object_id and obj.object_id != object_id):
                return 0
            self._note_read_locked(obj)
            return obj.size_bytes

    def read_view(self, obj: StoredObject) -> memoryview:
        """The object's DRAM bytes (valid while the caller holds its reference)."""
        return self.tier.view(obj.copy(0))

    def read_into(self, obj: StoredObject, dest: memoryview) -> None:
        """Copy the object's bytes from its fastest copy (the caller holds a reference).

        Raises:
            TierIOError: the slower tier failed.
        """
        level = obj.best_level()
        self.levels[level].tier.read_into(obj.copy(level), dest)

    def release(self, obj: StoredObject) -> None:
        """Drop a read reference taken by :meth:`acquire`."""
        with self._table.cond:
            self._table.release(obj)

    def note_native_reads(self, touches: bytes) -> None:
        """Note the native GET service's reads (:meth:`ObjectTable.native_reads`)."""
        with self._table.cond:
            self._table.native_reads(touches)

    # ================================================================ pins, lookahead
    def pin(self, key: str, object_id: int = 0, ttl_ms: int = 0) -> None:
        """Pin an object: hard (``ttl_ms`` 0: never evicted until unpinned) or
        soft (evicted only after unpinned objects, for ``ttl_ms``).

        Raises:
            NotFound: no such complete object.
            InvalidArgument: ``ttl_ms`` above MAX_SOFT_PIN_MS.
        """
        if not 0 <= ttl_ms <= MAX_SOFT_PIN_MS:
            raise InvalidArgument(f"ttl_ms must be in [0, {MAX_SOFT_PIN_MS}], got {ttl_ms}",
                                  key=key)
        with self._table.cond:
            obj = self._complete_locked(key, object_id)
            if ttl_ms:
                obj.soft_pin_until_s = max(obj.soft_pin_until_s, time.monotonic() + ttl_ms / 1000)
            else:
                obj.hard_pins += 1
            self.counters[NodeCounter.PINS] += 1

    def unpin(self, key: str, object_id: int = 0, soft: bool = False) -> bool:
        """Drop one hard pin, or (``soft``) the soft pin. Returns whether one was held.

        Raises:
            NotFound: no such complete object.
        """
        with self._table.cond:
            obj = self._complete_locked(key, object_id)
            if soft:
                held = obj.soft_pin_until_s > time.monotonic()
                obj.soft_pin_until_s = 0.0
            else:
                held = obj.hard_pins > 0
                obj.hard_pins = max(0, obj.hard_pins - 1)
            self.counters[NodeCounter.UNPINS] += held
            self._tiering.after_growth_locked(0)
            return held

    def prefetch(self, key: str, object_id: int = 0, deadline_ms: int = 0) -> bool:
        """Queue lookahead: a queued request will read this object within ``deadline_ms``.

        Protects the object from eviction at every tier until its first read
        or the deadline, and promotes it to DRAM in the background when it is
        only in slower tiers. Returns True when it is in DRAM already.

        Raises:
            NotFound: no such complete object.
            InvalidArgument: ``deadline_ms`` is 0 or above MAX_PREFETCH_MS.
        """
        if not 0 < deadline_ms <= MAX_PREFETCH_MS:
            raise InvalidArgument(f"prefetch needs 0 < deadline_ms <= {MAX_PREFETCH_MS}, "
                                  f"got {deadline_ms}", key=key)
        with self._table.cond:
            obj = self._complete_locked(key, object_id)
            now = time.monotonic()
            self.counters[NodeCounter.PREFETCH_REQUESTS] += 1
            if key not in self._table.protected:
                self.counters[NodeCounter.PREFETCHES] += 1
                self._table.protected[key] = obj
            obj.protect_until_s = max(obj.protect_until_s, now + deadline_ms / 1000)
            for level, extent in obj.copy_items():
                if extent is not None:
                    self.levels[level].policy.on_prefetch(obj.slot, now)
            if obj.copy(0) is not None:
                return True
            self._table.prefetch_queue[key] = obj
            if self.mover is not None:
                self.mover.wake()
            return False

    # ================================================================ removal, events
    def drop_removed(self, key: str, object_id: int) -> bool:
        """Drop a version its master removed, at the remover's request (the DROP data
        op): no reader gets it once ``remove`` returned. Reported EVICTED, so a master
        that still indexes this replica (a DROP nobody's remove ordered) forgets it.
        Returns True when an object was dropped.

        Raises:
            InvalidArgument: ``object_id`` 0 (a DROP names one version).
        """
        if not object_id:
            raise InvalidArgument("DROP needs the object id of the version removed", key=key)
        with self._table.cond:
            obj = self._retire_locked(key, object_id)
            if obj is not None:
                self._table.emit(EventKind.EVICTED, obj, None)
            return obj is not None

    def drop(self, key: str, object_id: int = 0) -> bool:
        """Free an object (``object_id`` 0 = whatever version is there).

        Memory under a reader is freed when the last reader releases it.
        Returns True when an object was dropped.
        """
        with self._table.cond:
            return self._retire_locked(key, object_id) is not None

    def _retire_locked(self, key: str, object_id: int) -> StoredObject | None:
        """Retire that version (0: whichever is in service), counted as a drop."""
        obj = self._table.objects.get(key)
        if obj is None or (object_id and obj.object_id != object_id):
            obj = self._table.staged.get((key, object_id)) if object_id else None
        if obj is not None:
            self._table.retire(obj)
            self.counters[NodeCounter.DROPS] += 1
        return obj

    def take_events(self) -> list[NodeEvent]:
        """Changes not yet handed to a delivering agent, in order (see ``events``).

        For a node without an agent (tests, tools): with an agent, its router
        takes them, and events taken here never reach the master.
        """
        return [ticket.event for ticket in self.events.take()]

    def inventory(self) -> list[tuple[str, int, int, int]]:
        """(key, object_id, size_bytes, checksum) of every complete object."""
        with self._table.cond:
            return [(o.key, o.object_id, o.size_bytes, o.checksum)
                    for o in self._table.objects.values() if o.state is ObjectState.COMPLETE]

    def holdings(self) -> list[tuple[str, int, int, int, TierKind]]:
        """(key, object_id, size_bytes, checksum, tier it is served from) of every complete object."""
        with self._table.cond:
            return [(o.key, o.object_id, o.size_bytes, o.checksum,
                     self.levels[o.best_level()].tier.kind)
                    for o in self._table.objects.values() if o.state is ObjectState.COMPLETE]

    def inventory_items(self) -> list[InventoryItem]:
        """Every complete object in service (:meth:`inventory_chunks` in one list)."""
        return [it for chunk in self.inventory_chunks() for it in chunk]

    def inventory_rows(self, chunk_items: int = 4096,
                       owns: Callable[[str], bool] | None = None) -> Iterator[list[tuple]]:
        """:meth:`inventory_chunks` as plain rows, what a registration sends
        (:func:`kvstore.store.inventory.inventory_rows`)."""
        return inventory_rows(self._table, self.levels, chunk_items, owns)

    def inventory_chunks(self, chunk_items: int = 4096,
                         owns: Callable[[str], bool] | None = None) -> Iterator[list[InventoryItem]]:
        """Every complete object in service, for a registration, ``chunk_items`` at a time.

        The lock is taken once per chunk, never for the whole table: writes and
        reads go on between chunks. Each chunk says what its objects are when
        it is read; whatever changes after that reaches the master as events,
        which the agent delivers after the last chunk (an object entering
        service meanwhile may be missed here: its STORED event follows).
        ``pending``: no master applied its STORED event yet, so it is never
        indexed from here.

        Args:
            chunk_items: objects looked at per chunk (a chunk holds at most this many).
            owns: key -> whether to list it (one shard's keys); None: every key.
        """
        for rows in inventory_rows(self._table, self.levels, chunk_items, owns):
            yield [InventoryItem(key, object_id, size_bytes, checksum, TierKind(tier),
                                 pending=pending, replica_num=replica_num)
                   for key, object_id, size_bytes, checksum, tier, pending, replica_num in rows]

    # ================================================================ stats
    def count(self, counter: NodeCounter, n: int = 1) -> None:
        """Add ``n`` to one of the node's counters (any thread)."""
        with self._table.cond:
            self.counters[counter] += n

    def check_invariants(self, idle: bool = False) -> None:
        """Fails loudly when tier accounting and the table disagree (for tests)."""
        self._table.check_invariants(idle)

    def close(self) -> None:
        """Stop the mover and close every tier."""
        if self.mover is not None:
            self.mover.stop()
        for lv in self.levels:
            lv.tier.close()

    # ================================================================ internals (lock held)
    def _complete_locked(self, key: str, object_id: int) -> StoredObject:
        obj = self._table.objects.get(key)
        if obj is None or obj.state is not ObjectState.COMPLETE or (
                object_id and obj.object_id != object_id):
            raise NotFound("not on this node", key=key)
        return obj

    def _note_read_locked(self, obj: StoredObject) -> None:
        self._table.published(obj)       # later reads may skip Python (shm, native gets)
        obj.last_access_s = time.monotonic()
        for level, extent in obj.copy_items():
            if extent is not None:
                self.levels[level].policy.on_access(obj.slot, obj.last_access_s)
        self.counters[NodeCounter.GETS] += 1
        if obj.key in self._table.protected and self._table.protected[obj.key] is obj:
            self._table.end_protection(obj, used=True)

    # ================================================================ restart
    def _recover(self) -> None:
        """Adopt what persistent tiers kept across a restart (checksums checked by the tier)."""
        for level, lv in enumerate(self.levels):
            if not lv.tier.persistent:
                continue
            for record, extent in lv.tier.recover():
                old = self._table.objects.get(record.key)
                if old is not None:       # two versions on disk: the later write wins
                    self._table.retire(old)
                obj = StoredObject.of(record, [None] * len(self.levels), state=ObjectState.COMPLETE,
                                      confirmed=True)   # only confirmed objects leave DRAM
                obj.set_copy(level, extent)
                self._table.enter(obj)
                lv.policy.on_insert(obj.slot, extent.reserved_bytes, obj.last_access_s,
                                    self._table.slot_of(record.parent), record.key)
                self.counters[NodeCounter.RECOVERED] += 1
            self.counters[NodeCounter.RECOVERY_DROPPED_CORRUPT] += lv.tier.dropped.corrupt
            self.counters[NodeCounter.RECOVERY_DROPPED_SURPLUS] += lv.tier.dropped.surplus
            if self.counters[NodeCounter.RECOVERED]:
                log.info("recovered %d object(s) from %s", self.counters[NodeCounter.RECOVERED],
                         lv.tier.kind.name)
