"""A store node's statistics: counted outside its lock, at most 2 % of a core.

:class:`NodeStatsView` is the counting side of
:class:`~kvstore.store.node.StoreNode` (its base class): the full count
(:meth:`~NodeStatsView.stats`), the count that heartbeats take
(:meth:`~NodeStatsView.full_stats`) and the cheap refresh between
(:meth:`~NodeStatsView.refresh_usage`). The pure counting is in
:mod:`kvstore.store.stats`.

Thread safety: every method takes the node's lock, only for what it names.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from kvstore.store.stats import (NodeCounter, NodeStats, TierUse, count_objects,
                                 counters_by_name)


#: Objects copied per hold of the node's lock by :meth:`NodeStatsView.stats` (about 1 ms).
SNAPSHOT_CHUNK = 65536


class NodeStatsView:
    """Statistics of a StoreNode (which sets ``_table``, ``_tiering``, ``levels``,
    ``tier``, ``counters``; ``_counted``, the last full count, None at first,
    ``_recount``, a :class:`~kvstore.store.recount.Recount`, and ``_recounting``,
    whether a count is running)."""

    def stats(self) -> NodeStats:
        """Everything, counted now: O(objects), outside the lock but for a copy of the
        table, taken a chunk of SNAPSHOT_CHUNK at a time (160 ms of a core for 200k
        objects, 3 ms of it locked; see :meth:`full_stats`, :meth:`refresh_usage`)."""
        table = self._table
        with table.cond:
            end = len(table.slots)
        objs = []
        for start in range(0, end, SNAPSHOT_CHUNK):
            with table.cond:
                objs += [o for o in table.slots[start:start + SNAPSHOT_CHUNK] if o is not None]
        with table.cond:
            now = time.monotonic()
            uses = [TierUse.of(lv, level) for level, lv in enumerate(self.levels)]
            head = dict(capacity_bytes=self.tier.capacity_bytes,
                        used_bytes=self.tier.used_bytes, free_bytes=self.tier.free_bytes,
                        num_doomed=len(self._table.doomed),
                        evictions=self.counters[NodeCounter.EVICTIONS],
                        eviction_policy=self.levels[0].policy.name,
                        counters=counters_by_name(self._table.counted()))
        stats = count_objects(objs, uses, now, **head)
        for use, t in zip(uses, stats.tiers):
            if not t.eviction_blocked and use.above_high and not t.evictable_bytes:
                with self._table.cond:      # rare: over the watermark, nothing to give up
                    reason = self._tiering.blocked_reason_locked(use.level, now)
                stats = dataclasses.replace(stats, tiers=tuple(
                    dataclasses.replace(x, eviction_blocked=reason) if x is t else x
                    for x in stats.tiers))
        return stats

    def full_stats(self, min_interval_s: float) -> NodeStats:
        """The last :meth:`stats` count with its usage and counters refreshed: O(tiers),
        never O(objects) for the caller (a heartbeat: at 5M objects a count takes
        seconds, and a beat that late gets the node declared dead). The count runs
        again on a thread of its own at most every ``min_interval_s`` and every 50
        times what the last one took (so counting costs at most 2 % of a core);
        until the first one ends, the per-object figures are 0."""
        now = time.monotonic()
        if self._recount.due(now, min_interval_s) and not self._recounting:
            self._recounting = True
            threading.Thread(target=self._count, args=(now,), name="node-stats",
                             daemon=True).start()
        return self.refresh_usage(self._counted or self._usage_only())

    def _count(self, started: float) -> None:
        try:
            self._counted = self.stats()
        finally:
            self._recount.done(started)
            self._recounting = False

    def _usage_only(self) -> NodeStats:
        """Stats with no per-object figures (before a first count)."""
        with self._table.cond:
            uses = [TierUse.of(lv, level) for level, lv in enumerate(self.levels)]
        stats = count_objects([], uses, time.monotonic(), capacity_bytes=self.tier.capacity_bytes,
                              used_bytes=0, free_bytes=0, num_doomed=0, evictions=0,
                              eviction_policy=self.levels[0].policy.name)
        return stats

    def refresh_usage(self, stats: NodeStats) -> NodeStats:
        """``stats`` with its byte usage, object counts and counters brought up to date.

        O(tiers): for frequent reports (heartbeats) between full :meth:`stats`
        calls; the per-object counts (evictable, pinned, ...) stay as they were.
        """
        with self._table.cond:
            tiers = tuple(dataclasses.replace(
                t, used_bytes=lv.tier.used_bytes, free_bytes=lv.tier.free_bytes,
                num_objects=len(lv.policy)) for t, lv in zip(stats.tiers, self.levels))
            return dataclasses.replace(
                stats, used_bytes=self.tier.used_bytes, free_bytes=self.tier.free_bytes,
                num_objects=len(self._table.objects),
                evictions=self.counters[NodeCounter.EVICTIONS], tiers=tiers,
                counters=counters_by_name(self._table.counted()))
