"""How a store node moves objects between its tiers: reclaim, demotion, promotion.

:class:`Tiering` is the part of a :class:`~kvstore.store.node.StoreNode`
that decides where bytes live; it works on the node's
:class:`~kvstore.store.table.ObjectTable` and owns the
:class:`~kvstore.store.mover.TierMover` thread that runs its moves. Per tier
of the chain (a :class:`~kvstore.store.levels.TierLevel`: the tier, its own
eviction policy and watermarks), reclaim runs when the tier is above its high
watermark (down to the low one) or when a writer or a promotion waits for
room::

    for each victim the policy proposes (unpinned first, then soft-pinned):
        it has a copy in another tier   -> drop this copy        (inline, no I/O)
        this is the slowest tier        -> evict the object      (inline; SSD delete is queued)
        a slower tier can take it       -> plan a demotion       (the mover copies it off the lock)
        no slower tier can              -> evict the object      (counted as evicted_no_room)
        not yet confirmed by a master   -> skipped until it is   (slower tiers hold confirmed only)

A planned move holds a reference on its object, so nothing frees either end
while the bytes travel; :meth:`Tiering.finish_moves` installs the new copy
(a demotion is only counted once the copy below is durable) and drops the
faster one if nobody started reading, pinned or prefetched it meanwhile.
A faster tier also gives up copies inline when an allocation needs room, but
only while the policy's next victim needs no copy, so policy order is kept.
What a victim may never be: :meth:`~kvstore.store.objects.StoredObject.can_give_up`.

Promotion copies an object up to DRAM and keeps the slower copy (objects
are immutable, so it never goes stale, and the next demotion is free). A
read promotes synchronously in its connection's thread; a prefetch queues
the object for the mover.

Every change to what get reads from the node (DEMOTED when the fastest copy
goes, PROMOTED, EVICTED) is queued as an event on the table.

Thread safety: methods named ``*_locked`` run with the node's lock held
(``promote_locked`` and ``wait_for_room_locked`` release it while they copy
or wait); the mover-side methods (:class:`~kvstore.store.mover.MoverWork`)
take it themselves.
"""

from __future__ import annotations

import logging
import time
from typing import Generator

from kvstore.errors import NoSpace, NotFound
from kvstore.store.mover import TierMover, run_moves
from kvstore.store.objects import Move, StoredObject
from kvstore.store.recount import Recount
from kvstore.store.stats import NodeCounter
from kvstore.store.tier_reasons import blocked_reason
from kvstore.store.table import ObjectTable
from kvstore.store.tiers.base import Extent, ObjectRecord
from kvstore.types import EventKind, TierKind

log = logging.getLogger(__name__)

#: Bytes and objects one mover round plans at most per tier (keeps lock holds and commits
#: short: 7,864 demotions of 1 KiB held the lock 61 ms to plan and 68 to finish).
MOVE_BATCH_BYTES = 16 * 1024 * 1024
MOVE_BATCH_OBJECTS = 1024
#: Objects an inline eviction round gives up at most once under the high watermark (see below).
INLINE_VICTIMS = 128
_BLOCKED_LOG_INTERVAL_S = 5.0
#: O(objects) diagnostics under the lock (why a tier is blocked, a NoSpace message's
#: reason) are counted again at most this often while nothing changes, and at most
#: every 50 times what the last count took (2 % of the lock): a full node with
#: nothing to evict spent 96 ms counting 95k objects at every put before.
RECOUNT_S = 0.25


class Tiering:
    """Tier movement for one node's object table (see the module docstring).

    Args:
        table: the node's object table; its levels are the tier chain.
        room_wait_s: how long a write or a promotion waits for the mover to
            make room before NoSpace (what :meth:`no_space_message_locked` cites).

    Attributes:
        tiers: the chain's tiers, fastest first (for the mover's copies).
        mover: the thread that runs this part's moves, not started; None for
            a node with DRAM only (it evicts inline, there is nothing to copy).

    Thread safety: see the module docstring.
    """

    def __init__(self, table: ObjectTable, room_wait_s: float):
        self._table = table
        self._levels = table.levels
        self.room_wait_s = room_wait_s
        # Per level: the last NoSpace message's O(objects) part, and when to count it again.
        self._why = [""] * len(table.levels)
        self._why_count = [Recount() for _ in table.levels]
        self.tiers = tuple(lv.tier for lv in table.levels)
        self.mover: TierMover | None = TierMover(self) if len(table.levels) > 1 else None

    # ================================================================ mover side (takes the lock)
    def plan_reclaim(self) -> list[Move]:
        """One reclaim round over every tier that needs room, slowest first.

        Frees what needs no copy at once (a slower copy exists; the slowest
        tier evicts) and returns the demotions for the mover to copy off the
        lock, then hand back to :meth:`finish_moves`.
        """
        moves: list[Move] = []
        with self._table.cond:
            now = time.monotonic()
            for level in reversed(range(len(self._levels))):
                need = self._levels[level].need_bytes()
                if need <= 0:
                    self._levels[level].blocked = ""
                    continue
                freed = self._reclaim_locked(level, min(need, MOVE_BATCH_BYTES), now, moves,
                                             (0, MOVE_BATCH_OBJECTS))
                self._note_round_locked(level, need, freed, now)
            self._table.cond.notify_all()   # waiters re-check: room freed inline, or nothing found
        return moves

    def plan_prefetch(self) -> list[Move]:
        """Promotions to DRAM of queued prefetched objects, as far as DRAM has room now."""
        moves: list[Move] = []
        table = self._table
        with table.cond:
            now = time.monotonic()
            lv0 = self._levels[0]
            lv0.prefetch_want_bytes = 0
            planned = 0
            for key, obj in list(table.prefetch_queue.items()):
                if planned >= MOVE_BATCH_BYTES:
                    break
                if (obj.doomed or obj.copy(0) is not None or obj.protect_until_s <= now
                        or table.objects.get(key) is not obj):
                    del table.prefetch_queue[key]
                    continue
                if obj.moving or obj.promoting:
                    continue
                alloc = self.allocate_locked(0, obj.record)
                if alloc is None:
                    lv0.prefetch_want_bytes = obj.size_bytes   # the next reclaim round makes room
                    break
                del table.prefetch_queue[key]
                obj.refs += 1
                obj.promoting = True
                moves.append(Move(obj, obj.best_level(), 0, alloc))
                planned += obj.size_bytes
        return moves

    def finish_moves(self, moves: list[Move]) -> None:
        """Install (or give back) the copies of moves the mover has run."""
        with self._table.cond:
            for move in moves:
                if move.dst_level == 0:
                    self._finish_promotion_locked(move)
                else:
                    self._finish_demotion_locked(move)
            self._table.cond.notify_all()

    def sweep_protection(self) -> None:
        """End lookahead protections whose deadline passed (counted as wasted)."""
        table = self._table
        with table.cond:
            now = time.monotonic()
            for obj in list(table.protected.values()):
                if obj.protect_until_s <= now:
                    table.end_protection(obj, used=False)

    def flush_tiers(self) -> None:
        """Deferred tier work (queued SSD deletes); call off the lock."""
        for tier in self.tiers:
            tier.flush()

    # ================================================================ node side (lock held)
    def room_for_put_locked(self, record: ObjectRecord) -> Extent:
        """DRAM for a new object: allocated, giving up what may go for it (room for a
        put of its tenant, :mod:`kvstore.store.tenant_shares`), waiting (bounded by
        ``room_wait_s``) for the mover while that may free enough.

        Raises:
            NoSpace: no room, even after giving up every object that may go for
                it; the message says what holds the rest (and names the tenant
                when only its own objects and those of tenants above their share
                could go).
        """
        alloc = self.allocate_locked(0, record, for_put=True)
        if alloc is None and not self.could_fit_locked(0, record.size_bytes, record):
            self._table.counters[NodeCounter.NO_FIT] += 1
            raise NoSpace(self._put_no_space_locked(record) + "; nothing was evicted for it",
                          key=record.key)
        if alloc is None:
            alloc = self.wait_for_room_locked(0, record, self.room_wait_s, for_put=True)
        if alloc is None:
            raise NoSpace(self._put_no_space_locked(record), key=record.key)
        return alloc

    def allocate_locked(self, level: int, record: ObjectRecord,
                        for_put: bool = False) -> Extent | None:
        """Allocate at ``level``, giving up victims inline while that needs no copy;
        ``for_put``: ``record`` is a new object's, the victims those that may go for
        a put of its tenant (:meth:`TenantShares.victims_for
        <kvstore.store.tenant_shares.TenantShares.victims_for>`).

        The slowest tier (or a node's only tier) evicts until the extent fits.
        A faster tier drops copies that have a duplicate in another tier, in
        policy order, and stops at the first victim that would need a copy:
        that one is the mover's (so policy order is kept).

        Returns:
            The extent, or None when it does not fit now.
        """
        tier = self._levels[level].tier
        extent = tier.allocate(record)
        if extent is not None:
            return extent
        put = record if for_put else None
        if not self.could_fit_locked(level, record.size_bytes, put):
            return None        # evicting everything evictable would not do: evict nothing
        bottom = self._is_bottom(level)
        gen = self._victims(level, time.monotonic(), put)
        try:
            for obj in gen:
                if self._has_other_copy(obj, level):
                    self._drop_copy_locked(obj, level)
                elif bottom:
                    self._evict_locked(obj, level)
                else:
                    return None
                extent = tier.allocate(record)
                if extent is not None:
                    return extent
        finally:
            gen.close()
        return None

    def evict_one_locked(self, put: ObjectRecord | None = None) -> bool:
        """Evict one object, the first victim of the slowest tier whose policy evicts
        (the node's object limit: :mod:`kvstore.store.limits`), one that may go for
        ``put`` when given (see :meth:`allocate_locked`). Returns False when no
        object may go."""
        now = time.monotonic()
        for level in reversed(range(len(self._levels))):
            if not self._levels[level].policy.evicts:
                continue
            gen = self._victims(level, now, put)
            try:
                for obj in gen:
                    self._evict_locked(obj, level)
                    self._table.counters[NodeCounter.EVICTED_FOR_COUNT] += 1
                    return True
            finally:
                gen.close()
        return False

    #: Objects under this fraction of a tier skip :meth:`could_fit_locked`'s count:
    #: a few victims make room for them, and the count is O(objects).
    FIT_CHECK_FRACTION = 1 / 64

    def could_fit_locked(self, level: int, size_bytes: int,
                         put: ObjectRecord | None = None) -> bool:
        """Whether ``size_bytes`` could fit at ``level`` once every copy that may go
        now is given up (free + evictable >= size); with ``put`` (a new object's
        record), every copy that may go for it (:meth:`allocate_locked`). False
        means: refuse at once, evicting nothing (a 30 MiB put must not empty a 64 MiB
        tier and then fail). Small objects are assumed to fit (see FIT_CHECK_FRACTION)."""
        tier = self._levels[level].tier
        if size_bytes <= tier.free_bytes or size_bytes < tier.capacity_bytes * self.FIT_CHECK_FRACTION:
            return True
        now = time.monotonic()
        if put is not None and self._table.tenants.restricted(put.key, put.size_bytes):
            return tier.free_bytes + self._table.tenants.room_for(level, put.key, now) >= size_bytes
        room = tier.free_bytes
        for o in self._table.objects.values():
            copy = o.copy(level)
            if copy is not None and o.can_give_up(level, True, now):
                room += copy.reserved_bytes
                if room >= size_bytes:
                    return True
        return False

    def wait_for_room_locked(self, level: int, record: ObjectRecord, timeout_s: float,
                             for_put: bool = False) -> Extent | None:
        """Wait for the mover to make room at ``level``; releases the lock while waiting.
        (The mover's rounds give up victims in the background order; what this
        thread gives up inline is as :meth:`allocate_locked`'s ``for_put``.)

        Returns:
            The extent, or None when the mover is not running, found nothing
            more to move, or time is up.
        """
        if self.mover is None or not self.mover.running:
            return None
        lv = self._levels[level]
        deadline = time.monotonic() + timeout_s
        start_round = lv.rounds
        lv.want_bytes += record.size_bytes
        try:
            while True:
                self.mover.wake()
                self._table.cond.wait(0.05)
                extent = self.allocate_locked(level, record, for_put)
                if extent is not None:
                    return extent
                if lv.blocked and lv.blocked_round > start_round + 1:
                    # The mover tried and found nothing more to move: counted by a round
                    # that saw this want (a reason kept from before it may be stale).
                    return None
                if time.monotonic() > deadline:
                    return None
        finally:
            lv.want_bytes -= record.size_bytes

    def promote_locked(self, obj: StoredObject, wait_s: float) -> None:
        """Copy ``obj`` (referenced by the caller) up to DRAM; releases the lock while copying.

        Raises:
            NoSpace: no room in DRAM within ``wait_s``.
            NotFound: dropped meanwhile, or its copy was corrupt (then evicted).
        """
        table = self._table
        while obj.promoting or obj.moving:
            table.cond.wait(0.05)
        if obj.doomed:
            raise NotFound("dropped while being read", key=obj.key)
        if obj.copy(0) is not None:
            return
        obj.promoting = True
        move = None
        try:
            alloc = self.allocate_locked(0, obj.record)
            if alloc is None and wait_s > 0:
                alloc = self.wait_for_room_locked(0, obj.record, wait_s)
            if alloc is None:
                table.counters[NodeCounter.PROMOTION_FAILURES] += 1
                raise NoSpace(self.no_space_message_locked(0, obj.size_bytes), key=obj.key)
            move = Move(obj, obj.best_level(), 0, alloc)
            with table.unlocked():
                run_moves(self.tiers, [move])
            obj.refs += 1                        # _finish_promotion_locked releases one
            self._finish_promotion_locked(move)
            table.cond.notify_all()
        finally:
            obj.promoting = False
        if obj.copy(0) is None:
            raise NotFound(f"promotion failed: {move.error if move else 'dropped'}", key=obj.key)

    def after_growth_locked(self, level: int) -> None:
        """A tier grew (or a pin went): evict inline, or wake the mover."""
        lv = self._levels[level]
        if not lv.above_high() and not lv.draining:
            return
        if self._is_bottom(level):
            need = lv.need_bytes()     # 0: draining ended at the last round
            if need <= 0:
                lv.blocked = ""
                return
            # Back under the high watermark, then a bounded round: the drain to the low one
            # goes on in the next puts' rounds (one put gave up 1,638 objects, 16 ms, before).
            now = time.monotonic()
            freed = self._reclaim_locked(level, need, now, None,
                                         (lv.over_high_bytes(), INLINE_VICTIMS))
            self._note_round_locked(level, need, freed, now)
        elif self.mover is not None:
            self.mover.wake()

    def blocked_reason_locked(self, level: int, now: float) -> str:
        """Why nothing at ``level`` can be given up: what holds its objects, counted."""
        return blocked_reason(self._table, self._levels[level], level, self._is_bottom(level), now)

    def no_space_message_locked(self, level: int, size_bytes: int) -> str:
        """The NoSpace message for ``size_bytes`` at ``level``: the numbers, and why."""
        tier = self._levels[level].tier
        now = time.monotonic()
        why = self._why[level]
        if not self._levels[level].policy.evicts:
            why = (f"eviction is off (eviction policy {self._levels[level].policy.name}): "
                   f"its {tier.used_bytes} B stay until removed")
        elif self._why_count[level].due(now, RECOUNT_S):
            # O(objects) under the lock: a full node refusing puts one after
            # another counts at most once a RECOUNT_S, not at every refusal.
            evictable = sum(o.copy(level).reserved_bytes for o in self._table.objects.values()
                            if o.can_give_up(level, True, now))
            why = (self.blocked_reason_locked(level, now) if not evictable else
                   f"{evictable} B evictable were not freed within {self.room_wait_s} s"
                   + ("" if self.mover is not None and self.mover.running else
                      " (the tier mover is not running)"))
            self._why[level] = why
            self._why_count[level].done(now)
        return (f"no free extent of {size_bytes} B in {tier.kind.name} (free {tier.free_bytes} B, "
                f"largest {tier.largest_free_bytes()} B) and {why}")

    # ================================================================ internals (lock held)
    def _put_no_space_locked(self, record: ObjectRecord) -> str:
        """:meth:`no_space_message_locked` for a put, naming its tenant when only its
        own objects and those of tenants above their share may go for it."""
        return (self._table.tenants.over_share_message(record.key, record.size_bytes)
                + self.no_space_message_locked(0, record.size_bytes))

    def _victims(self, level: int, now: float,
                 put: ObjectRecord | None = None) -> Generator[StoredObject, None, None]:
        """Candidate objects at ``level`` in eviction order: unpinned first, then soft-pinned;
        while tenants have guaranteed shares, all of that for the objects of tenants above
        their share first, then for all; for ``put`` (room for a new object), the
        passes that may go for its tenant (:mod:`kvstore.store.tenant_shares`).

        Lazy: the caller drops each yielded copy (or plans its move) before
        asking for the next, as the policy's contract wants.
        """
        slots = self._table.slots
        policy = self._levels[level].policy
        shares = self._table.tenants

        passes = (shares.victims_for() if put is None
                  else shares.victims_for(put.key, put.size_bytes))

        def can_evict(slot: int, soft_ok: bool, allowed) -> bool:
            obj = slots[slot]
            return (obj is not None and obj.can_give_up(level, soft_ok, now)
                    and (allowed is None or allowed(obj.key)))

        for allowed in passes:
            for soft_ok in (False, True):
                gen = policy.victims(None, can_evict=lambda k, s=soft_ok, a=allowed:
                                     can_evict(k, s, a))
                try:
                    for slot in gen:
                        yield slots[slot]
                finally:
                    close = getattr(gen, "close", None)   # a policy may return a plain iterator
                    if close is not None:
                        close()

    @staticmethod
    def _has_other_copy(obj: StoredObject, level: int) -> bool:
        return any(i != level for i, _ in obj.copy_items())

    def _is_bottom(self, level: int) -> bool:
        return level == len(self._levels) - 1

    def _reclaim_locked(self, level: int, need: int, now: float, moves: list[Move] | None,
                        bound: tuple[int, int] | None = None) -> int:
        """Give up copies at ``level`` in policy order until ``need`` bytes are freed or planned.

        With ``moves`` None only what needs no copy is done (drop a copy that
        has a duplicate in another tier; evict at the bottom); otherwise objects that
        need a copy below are planned as demotions. ``bound`` (bytes, objects):
        stop after that many objects once that many bytes are freed. Returns the
        bytes freed or planned to be freed.
        """
        freed = given = 0
        bottom = self._is_bottom(level)
        gen = self._victims(level, now)
        try:
            for obj in gen:
                if freed >= need or (bound and given >= bound[1] and freed >= bound[0]):
                    break
                reserved = obj.copy(level).reserved_bytes
                if self._has_other_copy(obj, level):
                    self._drop_copy_locked(obj, level)
                elif bottom:
                    self._evict_locked(obj, level)
                elif moves is None or not obj.confirmed:
                    # Unconfirmed (no master applied its STORED yet): it waits in
                    # DRAM, as slower tiers, which survive a restart, hold only
                    # confirmed objects; its confirmation runs reclaim again.
                    continue
                else:
                    target = self._place_below_locked(obj, level)
                    if target is None:
                        self._table.counters[NodeCounter.EVICTED_NO_ROOM] += 1
                        self._evict_locked(obj, level)
                    else:
                        obj.refs += 1
                        obj.moving = True
                        moves.append(Move(obj, level, *target))
                freed += reserved
                given += 1
            else:
                # Nothing else may go (pinned, read, held): a drain ends here. Else
                # every later put ran a round, scanning what is held, and gave itself up.
                self._levels[level].draining = False
        finally:
            gen.close()
        return freed

    def _place_below_locked(self, obj: StoredObject, level: int) -> tuple[int, Extent] | None:
        """Reserve room for ``obj`` in the first slower tier that has it (the
        slowest tier may evict for it)."""
        for lower in range(level + 1, len(self._levels)):
            if self._levels[lower].tier.capacity_bytes < obj.size_bytes:
                continue
            extent = self.allocate_locked(lower, obj.record)
            if extent is not None:
                return lower, extent
        return None

    def _finish_promotion_locked(self, move: Move) -> None:
        table = self._table
        obj = move.obj
        obj.promoting = False
        if obj.doomed or not move.ok:
            self._levels[0].tier.free(move.dst_extent)
            if not obj.doomed:
                table.counters[NodeCounter.PROMOTION_FAILURES] += 1
                log.error("promotion of %s from %s failed: %s; object evicted", obj.key,
                          self._levels[move.src_level].tier.kind.name, move.error)
                self._evict_locked(obj, move.src_level)
        else:
            obj.set_copy(0, move.dst_extent)
            self._levels[0].policy.on_insert(obj.slot, move.dst_extent.reserved_bytes,
                                             max(obj.last_access_s, time.monotonic()),
                                             table.slot_of(obj.parent), obj.key)
            table.counters[NodeCounter.PROMOTIONS] += 1
            table.emit(EventKind.PROMOTED, obj, TierKind.DRAM)
        table.release(obj)

    def _finish_demotion_locked(self, move: Move) -> None:
        table = self._table
        obj = move.obj
        obj.moving = False
        dst = self._levels[move.dst_level]
        if obj.doomed or not move.ok:
            dst.tier.free(move.dst_extent)
            if not move.ok and not obj.doomed:
                # Not durable below: the object is evicted, not offloaded.
                table.counters[NodeCounter.DEMOTION_FAILURES] += 1
                log.warning("demotion of %s to %s failed (%s): evicted", obj.key,
                            dst.tier.kind.name, move.error)
                if obj.refs == 1:
                    self._evict_locked(obj, move.src_level)
        else:
            obj.set_copy(move.dst_level, move.dst_extent)
            dst.policy.on_insert(obj.slot, move.dst_extent.reserved_bytes, obj.last_access_s,
                                 table.slot_of(obj.parent), obj.key)
            table.counters[NodeCounter.DEMOTIONS] += 1
            # Someone may have started reading, pinned or prefetched it meanwhile:
            # then the faster copy stays too, and a later round drops it for free.
            if (obj.refs == 1 and obj.hard_pins == 0
                    and obj.protect_until_s <= time.monotonic()):
                self._drop_copy_locked(obj, move.src_level)
        table.release(obj)

    def _drop_copy_locked(self, obj: StoredObject, level: int) -> None:
        """Drop the copy at ``level`` of an object that has another copy (no reader holds it).

        Dropping the fastest copy is a demotion (an event); dropping a slower
        duplicate changes nothing get sees.
        """
        was_best = obj.best_level() == level
        extent = obj.copy(level)
        obj.set_copy(level, None)
        self._levels[level].policy.on_remove(obj.slot, obj.key)
        self._levels[level].tier.free(extent)
        if was_best:
            self._table.emit(EventKind.DEMOTED, obj, self._levels[obj.best_level()].tier.kind)

    def _evict_locked(self, obj: StoredObject, level: int) -> None:
        """Give the object up on this node (every copy), from the tier at ``level``
        that needed the room: counted (node and tier), and an EVICTED event."""
        self._table.retire(obj)
        self._table.counters[NodeCounter.EVICTIONS] += 1
        self._levels[level].evictions += 1
        self._table.emit(EventKind.EVICTED, obj, None)

    def _note_round_locked(self, level: int, need: int, freed: int, now: float) -> None:
        """Record a reclaim round; one that freed nothing says why (stats, rate-limited log)."""
        lv = self._levels[level]
        lv.rounds += 1
        # A round that found nothing new while demotions out of this tier are still
        # being copied is not blocked: their room comes when they finish, and a
        # writer waiting for it must not give up (wait_for_room_locked) before then.
        # A tier that stays blocked (rounds freeing nothing, as every put into a full
        # tier with nothing evictable runs one) is counted again only every
        # RECOUNT_S; a round that frees or plans something clears it at once, and
        # moves are only planned by such rounds.
        if freed or need <= 0 or (not lv.draining and not lv.above_high()
                                  and lv.tier.largest_free_bytes() >= need):
            lv.blocked = ""        # (the last: one free extent holds every waiter's want)
        elif not lv.blocked or lv.blocked_count.due(now, RECOUNT_S):
            t0 = time.monotonic()
            # (Nothing is demoted out of the slowest tier: no scan for it there.)
            in_flight = not self._is_bottom(level) and any(
                o.moving and o.copy(level) is not None for o in self._table.objects.values())
            lv.blocked = "" if in_flight else self.blocked_reason_locked(level, now)
            lv.blocked_round = lv.rounds
            lv.blocked_count.done(t0)
        if lv.blocked and now - lv.blocked_logged_s > _BLOCKED_LOG_INTERVAL_S:
            lv.blocked_logged_s = now
            log.warning("%s tier needs %d B but %s", lv.tier.kind.name, need, lv.blocked)
