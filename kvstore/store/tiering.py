"""How a store node moves objects between its tiers: reclaim, demotion, promotion.

This is the half of :class:`~kvstore.store.node.StoreNode` that decides
where bytes live; ``node.py`` is the object table it works on. Per tier of
the chain (a :class:`TierLevel`: the tier, its own eviction policy and
watermarks), reclaim runs when the tier is above its high watermark (down to
the low one) or when a writer or a promotion waits for room::

    for each victim the policy proposes (unpinned first, then soft-pinned):
        it has a copy in another tier   -> drop this copy        (inline, no I/O)
        this is the slowest tier        -> evict the object      (inline; SSD delete is queued)
        a slower tier can take it       -> plan a demotion       (the mover copies it off the lock)
        no slower tier can              -> evict the object      (counted as evicted_no_room)

A planned move holds a reference on its object, so nothing frees either end
while the bytes travel; :meth:`Tiering.finish_moves` installs the new copy
(a demotion is only counted once the copy below is durable) and drops the
faster one if nobody started reading, pinned or prefetched it meanwhile.
A faster tier also gives up copies inline when an allocation needs room, but
only while the policy's next victim needs no copy, so policy order is kept.

Promotion copies an object up to DRAM and keeps the slower copy (objects
are immutable, so it never goes stale, and the next demotion is free). A
read promotes synchronously in its connection's thread; a prefetch queues
the object for the mover.

Thread safety: methods named ``*_locked`` run with the node's lock held
(``_promote_locked`` and ``_wait_for_room_locked`` release it while they copy
or wait); the mover-side methods take it themselves.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

from kvstore.errors import NoSpace, NotFound
from kvstore.store.eviction import EvictionPolicy
from kvstore.types import EventKind
from kvstore.store.mover import run_moves
from kvstore.store.objects import Move, ObjectState, StoredObject
from kvstore.store.stats import NodeCounter
from kvstore.store.tiers.base import Extent, ObjectRecord, Tier
from kvstore.types import TierKind

log = logging.getLogger(__name__)

#: Default (high, low) watermarks per tier kind, as fractions of capacity.
DEFAULT_WATERMARKS: dict[TierKind, tuple[float, float]] = {
    TierKind.DRAM: (0.95, 0.85),
    TierKind.GPU: (0.95, 0.85),
    TierKind.SSD: (0.95, 0.90),
}
#: Bytes one mover round plans at most per tier (keeps lock holds and commits short).
MOVE_BATCH_BYTES = 16 * 1024 * 1024
_BLOCKED_LOG_INTERVAL_S = 5.0


@dataclass(slots=True, eq=False)
class TierLevel:
    """One tier of the chain with its policy, watermarks and reclaim state."""

    tier: Tier
    policy: EvictionPolicy
    high: float                 # fraction of capacity
    low: float
    want_bytes: int = 0         # room that waiting writers / promoters need now
    prefetch_want_bytes: int = 0  # room the next queued prefetch promotion needs
    rounds: int = 0             # reclaim rounds run for this level
    blocked: str = ""           # set by a round that could free nothing it needed
    blocked_logged_s: float = 0.0
    draining: bool = False      # passed ``high``; reclaiming until back at ``low`` (hysteresis)


class Tiering:
    """Tier movement for :class:`~kvstore.store.node.StoreNode` (its base class).

    Uses the node's ``levels``, ``tier`` (DRAM), ``mover``, ``room_wait_s``,
    ``counters``, lock/condition and object table; see the module docstring.
    """

    def plan_reclaim(self) -> list[Move]:
        """One reclaim round over every tier that needs room, slowest first.

        Frees what needs no copy at once (a slower copy exists; the slowest
        tier evicts) and returns the demotions for the mover to copy off the
        lock, then hand back to :meth:`finish_moves`.
        """
        moves: list[Move] = []
        with self._cond:
            now = time.monotonic()
            for level in reversed(range(len(self.levels))):
                need = self._need_bytes_locked(level)
                if need <= 0:
                    self.levels[level].blocked = ""
                    continue
                freed = self._reclaim_locked(level, min(need, MOVE_BATCH_BYTES), now, moves)
                self._note_round_locked(level, need, freed, now)
            self._cond.notify_all()   # waiters re-check: room freed inline, or nothing found
        return moves

    def plan_prefetch(self) -> list[Move]:
        """Promotions to DRAM of queued prefetched objects, as far as DRAM has room now."""
        moves: list[Move] = []
        with self._cond:
            now = time.monotonic()
            lv0 = self.levels[0]
            lv0.prefetch_want_bytes = 0
            planned = 0
            for key, obj in list(self._prefetch_queue.items()):
                if planned >= MOVE_BATCH_BYTES:
                    break
                if (obj.doomed or obj.copies[0] is not None or obj.protect_until_s <= now
                        or self._objects.get(key) is not obj):
                    del self._prefetch_queue[key]
                    continue
                if obj.moving or obj.promoting:
                    continue
                alloc = self._allocate_locked(0, obj.record)
                if alloc is None:
                    lv0.prefetch_want_bytes = obj.size_bytes   # the next reclaim round makes room
                    break
                del self._prefetch_queue[key]
                obj.refs += 1
                obj.promoting = True
                moves.append(Move(obj, obj.best_level(), 0, alloc))
                planned += obj.size_bytes
        return moves

    def finish_moves(self, moves: list[Move]) -> None:
        """Install (or give back) the copies of moves the mover has run."""
        with self._cond:
            for move in moves:
                if move.dst_level == 0:
                    self._finish_promotion_locked(move)
                else:
                    self._finish_demotion_locked(move)
            self._cond.notify_all()

    def sweep_protection(self) -> None:
        """End lookahead protections whose deadline passed (counted as wasted)."""
        with self._cond:
            now = time.monotonic()
            for key, obj in list(self._protected.items()):
                if obj.protect_until_s <= now:
                    self._end_protection_locked(obj, used=False)

    def flush_tiers(self) -> None:
        """Deferred tier work (queued SSD deletes); call off the lock."""
        for lv in self.levels:
            lv.tier.flush()

    # ---- internals (lock held) ----
    def _can_give_up(self, level: int, obj: StoredObject | None, soft_ok: bool,
                     now: float) -> bool:
        """May the copy of ``obj`` at ``level`` be dropped (evicted or demoted) now?"""
        return (obj is not None and obj.copies[level] is not None
                and obj.state is ObjectState.COMPLETE and obj.refs == 0 and not obj.moving
                and not obj.promoting and obj.hard_pins == 0 and obj.protect_until_s <= now
                and (soft_ok or obj.soft_pin_until_s <= now))

    def _victims(self, level: int, now: float):
        """Candidate objects at ``level`` in eviction order: unpinned first, then soft-pinned.

        Lazy: the caller drops each yielded copy (or plans its move) before
        asking for the next, as the policy's contract wants.
        """
        policy = self.levels[level].policy
        for soft_ok in (False, True):
            gen = policy.victims(None, can_evict=lambda k, s=soft_ok: self._can_give_up(
                level, self._objects.get(k), s, now))
            try:
                for key in gen:
                    yield self._objects[key]
            finally:
                close = getattr(gen, "close", None)   # a policy may return a plain iterator
                if close is not None:
                    close()

    def _need_bytes_locked(self, level: int) -> int:
        """Bytes ``level`` must give up now.

        Watermarks with hysteresis: passing ``high`` starts draining, which
        goes on -- over later rounds, as readers let go -- until use is back
        at ``low``; a round that frees only part of the excess does not end it.
        """
        lv = self.levels[level]
        cap = lv.tier.capacity_bytes
        if lv.tier.used_bytes > lv.high * cap:
            lv.draining = True
        excess = lv.tier.used_bytes - int(lv.low * cap) if lv.draining else 0
        if excess <= 0:
            lv.draining = False
            excess = 0
        return max(excess, lv.want_bytes + lv.prefetch_want_bytes)

    @staticmethod
    def _has_other_copy(obj: StoredObject, level: int) -> bool:
        return any(e is not None for i, e in enumerate(obj.copies) if i != level)

    def _is_bottom(self, level: int) -> bool:
        return level == len(self.levels) - 1

    def _reclaim_locked(self, level: int, need: int, now: float,
                        moves: list[Move] | None) -> int:
        """Give up copies at ``level`` in policy order until ``need`` bytes are freed or planned.

        With ``moves`` None only what needs no copy is done (drop a copy that
        has a duplicate in another tier; evict at the bottom); otherwise objects that
        need a copy below are planned as demotions. Returns the bytes freed
        or planned to be freed.
        """
        freed = 0
        bottom = self._is_bottom(level)
        gen = self._victims(level, now)
        try:
            for obj in gen:
                if freed >= need:
                    break
                reserved = obj.copies[level].reserved_bytes
                if self._has_other_copy(obj, level):
                    self._drop_copy_locked(obj, level)
                elif bottom:
                    self._evict_locked(obj)
                elif moves is None:
                    continue
                else:
                    target = self._place_below_locked(obj, level)
                    if target is None:
                        self.counters[NodeCounter.EVICTED_NO_ROOM] += 1
                        self._evict_locked(obj)
                    else:
                        obj.refs += 1
                        obj.moving = True
                        moves.append(Move(obj, level, *target))
                freed += reserved
        finally:
            gen.close()
        return freed

    def _place_below_locked(self, obj: StoredObject, level: int) -> tuple[int, Extent] | None:
        """Reserve room for ``obj`` in the first slower tier that has it (the
        slowest tier may evict for it)."""
        for lower in range(level + 1, len(self.levels)):
            if self.levels[lower].tier.capacity_bytes < obj.size_bytes:
                continue
            extent = self._allocate_locked(lower, obj.record)
            if extent is not None:
                return lower, extent
        return None

    def _allocate_locked(self, level: int, record: ObjectRecord) -> Extent | None:
        """Allocate at ``level``, giving up victims inline while that needs no copy.

        The slowest tier (or a node's only tier) evicts until the extent fits.
        A faster tier drops copies that have a duplicate in another tier, in
        policy order, and stops at the first victim that would need a copy:
        that one is the mover's (so policy order is kept).
        """
        tier = self.levels[level].tier
        extent = tier.allocate(record)
        if extent is not None:
            return extent
        bottom = self._is_bottom(level)
        gen = self._victims(level, time.monotonic())
        try:
            for obj in gen:
                if self._has_other_copy(obj, level):
                    self._drop_copy_locked(obj, level)
                elif bottom:
                    self._evict_locked(obj)
                else:
                    return None
                extent = tier.allocate(record)
                if extent is not None:
                    return extent
        finally:
            gen.close()
        return None

    def _wait_for_room_locked(self, level: int, record: ObjectRecord,
                              timeout_s: float) -> Extent | None:
        """Wait for the mover to make room at ``level``; None when it cannot (or time is up)."""
        if self.mover is None or not self.mover.running:
            return None
        lv = self.levels[level]
        deadline = time.monotonic() + timeout_s
        start_round = lv.rounds
        lv.want_bytes += record.size_bytes
        try:
            while True:
                self.mover.wake()
                self._cond.wait(0.05)
                extent = self._allocate_locked(level, record)
                if extent is not None:
                    return extent
                if lv.rounds > start_round + 1 and lv.blocked:
                    return None   # the mover tried and found nothing more to move
                if time.monotonic() > deadline:
                    return None
        finally:
            lv.want_bytes -= record.size_bytes

    def _promote_locked(self, obj: StoredObject, wait_s: float) -> None:
        """Copy ``obj`` (referenced by the caller) up to DRAM; releases the lock while copying.

        Raises:
            NoSpace: no room in DRAM within ``wait_s``.
            NotFound: dropped meanwhile, or its copy was corrupt (then evicted).
        """
        while obj.promoting or obj.moving:
            self._cond.wait(0.05)
        if obj.doomed:
            raise NotFound("dropped while being read", key=obj.key)
        if obj.copies[0] is not None:
            return
        obj.promoting = True
        move = None
        try:
            alloc = self._allocate_locked(0, obj.record)
            if alloc is None and wait_s > 0:
                alloc = self._wait_for_room_locked(0, obj.record, wait_s)
            if alloc is None:
                self.counters[NodeCounter.PROMOTION_FAILURES] += 1
                raise NoSpace(self._no_space_message(0, obj.size_bytes), key=obj.key)
            move = Move(obj, obj.best_level(), 0, alloc)
            with self._unlocked():
                run_moves(self, [move])
            obj.refs += 1                        # _finish_promotion_locked releases one
            self._finish_promotion_locked(move)
            self._cond.notify_all()
        finally:
            obj.promoting = False
        if obj.copies[0] is None:
            raise NotFound(f"promotion failed: {move.error if move else 'dropped'}", key=obj.key)

    def _finish_promotion_locked(self, move: Move) -> None:
        obj = move.obj
        obj.promoting = False
        if obj.doomed or not move.ok:
            self.tier.free(move.dst_extent)
            if not obj.doomed:
                self.counters[NodeCounter.PROMOTION_FAILURES] += 1
                log.error("promotion of %s from %s failed: %s; object evicted", obj.key,
                          self.levels[move.src_level].tier.kind.name, move.error)
                self._evict_locked(obj)
        else:
            obj.copies[0] = move.dst_extent
            self.levels[0].policy.on_insert(obj.key, move.dst_extent.reserved_bytes,
                                            max(obj.last_access_s, time.monotonic()), obj.parent)
            self.counters[NodeCounter.PROMOTIONS] += 1
            self._emit(EventKind.PROMOTED, obj, TierKind.DRAM)
        self._release_locked(obj)

    def _finish_demotion_locked(self, move: Move) -> None:
        obj = move.obj
        obj.moving = False
        dst = self.levels[move.dst_level]
        if obj.doomed or not move.ok:
            dst.tier.free(move.dst_extent)
            if not move.ok and not obj.doomed:
                # Not durable below: the object is evicted, not offloaded.
                self.counters[NodeCounter.DEMOTION_FAILURES] += 1
                log.warning("demotion of %s to %s failed (%s): evicted", obj.key,
                            dst.tier.kind.name, move.error)
                if obj.refs == 1:
                    self._evict_locked(obj)
        else:
            obj.copies[move.dst_level] = move.dst_extent
            dst.policy.on_insert(obj.key, move.dst_extent.reserved_bytes, obj.last_access_s,
                                 obj.parent)
            self.counters[NodeCounter.DEMOTIONS] += 1
            # Someone may have started reading, pinned or prefetched it meanwhile:
            # then the faster copy stays too, and a later round drops it for free.
            if (obj.refs == 1 and obj.hard_pins == 0
                    and obj.protect_until_s <= time.monotonic()):
                self._drop_copy_locked(obj, move.src_level)
        self._release_locked(obj)

    def _drop_copy_locked(self, obj: StoredObject, level: int) -> None:
        """Drop the copy at ``level`` of an object that has another copy (no reader holds it).

        Dropping the fastest copy is a demotion (an event); dropping a slower
        duplicate changes nothing get sees.
        """
        was_best = obj.best_level() == level
        extent = obj.copies[level]
        obj.copies[level] = None
        self.levels[level].policy.on_remove(obj.key)
        self.levels[level].tier.free(extent)
        if was_best:
            self._emit(EventKind.DEMOTED, obj, self.levels[obj.best_level()].tier.kind)

    def _after_growth_locked(self, level: int) -> None:
        """A tier grew (or a pin went): evict inline, or wake the mover."""
        lv = self.levels[level]
        if lv.tier.used_bytes <= lv.high * lv.tier.capacity_bytes and not lv.draining:
            return
        if self._is_bottom(level):
            now = time.monotonic()
            need = self._need_bytes_locked(level)
            self._note_round_locked(level, need, self._reclaim_locked(level, need, now, None), now)
        elif self.mover is not None:
            self.mover.wake()

    def _note_round_locked(self, level: int, need: int, freed: int, now: float) -> None:
        """Record a reclaim round; one that freed nothing says why (stats, rate-limited log)."""
        lv = self.levels[level]
        lv.rounds += 1
        lv.blocked = "" if freed else self._blocked_reason_locked(level, now)
        if lv.blocked and now - lv.blocked_logged_s > _BLOCKED_LOG_INTERVAL_S:
            lv.blocked_logged_s = now
            log.warning("%s tier needs %d B but %s", lv.tier.kind.name, need, lv.blocked)

    @contextlib.contextmanager
    def _unlocked(self):
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def _blocked_reason_locked(self, level: int, now: float) -> str:
        lv = self.levels[level]
        here = [o for o in self._objects.values() if o.copies[level] is not None]
        reading = sum(o.refs > 0 or o.state is not ObjectState.COMPLETE for o in here)
        moving = sum(o.moving or o.promoting for o in here)
        pinned = sum(o.hard_pins > 0 for o in here)
        protected = sum(o.protect_until_s > now for o in here)
        doomed = sum(o.copies[level] is not None for o in self._doomed)
        held = sum(o.copies[level].reserved_bytes for o in here
                   if not self._can_give_up(level, o, True, now))
        held += sum(o.copies[level].reserved_bytes for o in self._doomed
                    if o.copies[level] is not None)
        used, cap = lv.tier.used_bytes, lv.tier.capacity_bytes
        chains = ("" if held >= used else
                  f"; the policy offers none of the other {used - held} B (a prefix-chain "
                  f"block goes only after its cached continuations)")
        return (f"nothing evictable in {lv.tier.kind.name} ({used} of {cap} B used): "
                f"{reading} objects being read or written, {moving} being moved, "
                f"{pinned} hard-pinned, {protected} protected by prefetch lookahead, "
                f"{doomed} awaiting their last reader{chains}")

    def _no_space_message(self, level: int, size_bytes: int) -> str:
        tier = self.levels[level].tier
        now = time.monotonic()
        evictable = sum(o.copies[level].reserved_bytes for o in self._objects.values()
                        if self._can_give_up(level, o, True, now))
        why = (self._blocked_reason_locked(level, now) if not evictable else
               f"{evictable} B evictable were not freed within {self.room_wait_s} s"
               + ("" if self.mover is not None and self.mover.running else
                  " (the tier mover is not running)"))
        return (f"no free extent of {size_bytes} B in {tier.kind.name} (free {tier.free_bytes} B, "
                f"largest {tier.largest_free_bytes()} B) and {why}")
