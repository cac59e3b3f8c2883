"""Re-replication: bringing objects back to the number of replicas their put asked for.

When a node dies, the objects it held have fewer live replicas. Each
maintenance round the master orders, for each such object, one copy from
a node holding a live replica to a live node holding none (most free space
first, not quarantined); the order travels in the source's next heartbeat
reply, the source copies over the data plane (kvstore/store/repair.py), the
target reports the copy STORED like any put (which makes it a replica), and
the source reports the order done. At most one
copy per object is in flight; one unanswered within ``timeout_ms`` is
given up and planned again.

The full scan for such objects runs only when one can exist: the index's
``repair_hint`` is set by every change that can leave an entry short of
replicas (an eviction, a forgotten node, an inventory sync, a multi-replica
put completed by its first replica, a failed copy), the planner notes when
the set of alive or healthy nodes changed since its last scan, and it keeps
scanning while the last scan found work or a copy is in flight (deadlines,
more than ``max_orders``). Otherwise a round costs nothing: on a busy master
the scan of every entry each 200 ms round was about 30 % of its event loop.

Thread safety: owned by the master's event loop, like the index.
"""

from __future__ import annotations

import logging
from typing import Iterator

from kvstore.master.counters import MasterCounter as C
from kvstore.master.entries import SCAN_SLICE
from kvstore.master.index import ObjectIndex
from kvstore.sizes import fits
from kvstore.types import CopyOrder, CopyResult, NodeId

log = logging.getLogger(__name__)


class RepairPlanner:
    """Plans repair copies over one shard's index and membership.

    Args:
        index: the shard's index (its membership is the index's).
        timeout_ms: a copy unanswered this long is given up.
        max_orders: copies ordered per round at most.
    """

    def __init__(self, index: ObjectIndex, timeout_ms: int = 10_000, max_orders: int = 64):
        self.index = index
        self.timeout_ms = timeout_ms
        self.max_orders = max_orders
        self._seen: tuple[frozenset, frozenset] | None = None   # (alive, healthy) at the last scan
        self._busy = True            # the last scan found work, or a copy was in flight
        self.ordered = 0             # copies the last round ordered

    def plan(self, now_ms: int) -> int:
        """Order copies for under-replicated objects; returns the number ordered.
        (All at once; the master's maintenance runs :meth:`plan_steps`.)"""
        for _ in self.plan_steps(now_ms):
            pass
        return self.ordered

    def plan_steps(self, now_ms: int) -> Iterator[None]:
        """:meth:`plan` a slice of the index at a time (yields between slices); the
        number ordered is :attr:`ordered` at the end."""
        index, membership = self.index, self.index.membership
        self.ordered = 0
        seen = (frozenset(n.node_id for n in membership.alive_nodes()),
                frozenset(n.node_id for n in membership.healthy_nodes(now_ms)))
        if not (self._busy or index.repair_hint or seen != self._seen):
            return
        self._seen, index.repair_hint = seen, False
        found = in_flight = 0
        for start in range(0, index.table.native.positions(), SCAN_SLICE):
            short, flying = self.under_replicated(now_ms, start)
            found += len(short)
            in_flight += flying
            for slot, live in short:
                if self.ordered >= self.max_orders:
                    break
                self._order(slot, live, now_ms)
            if self.ordered >= self.max_orders:
                break                  # busy: the next round goes on
            yield
        self._busy = bool(found) or in_flight > 0

    def under_replicated(self, now_ms: int, start: int
                         ) -> tuple[list[tuple[int, list[int]]], int]:
        """Of the slice of :data:`SCAN_SLICE` positions from ``start``, the entries with
        fewer live replicas than wanted and no repair in flight, as (slot, live node
        numbers), and how many have a repair in flight; a repair past its deadline
        is given up. One native call (kvstore/native/entry_table.hpp, short_slice)."""
        index = self.index
        _, short, in_flight, timeouts = index.table.native.short_slice(
            start, SCAN_SLICE, now_ms, index._alive())
        index.counters[C.REPAIR_TIMEOUTS] += timeouts
        return short, in_flight

    def _order(self, slot: int, live: list[int], now_ms: int) -> None:
        """Order one copy of the entry at ``slot`` from ``live[0]`` (a node number) to the
        healthy node with the most free space that holds none (none fits: nothing
        ordered)."""
        table, membership = self.index.table, self.index.membership
        object_id, size_bytes, _ = table.native.head(slot)
        held = set(table.names(table.native.nodes(slot)))
        targets = [n for n in membership.healthy_nodes(now_ms)
                   if n.node_id not in held and fits(size_bytes, n.max_object_bytes)
                   and n.free_bytes >= size_bytes]
        if not targets:
            return
        target = max(targets, key=lambda n: (n.free_bytes, n.node_id))
        membership.order_copy(table.node_ids[live[0]],
                              CopyOrder(table.native.key(slot), object_id, target.address))
        membership.reserve(target.node_id, size_bytes)
        table.native.set_repair(slot, table.ix(target.node_id), now_ms + self.timeout_ms)
        self.index.counters[C.REPAIRS_ORDERED] += 1
        self.ordered += 1

    def done(self, result: CopyResult) -> None:
        """A node reports a repair copy done (its target's STORED made it a replica) or failed."""
        index, membership = self.index, self.index.membership
        native = index.table.native
        slot = native.find(result.key)
        object_id, size_bytes, _ = native.head(slot) if slot >= 0 else (0, 0, 0)
        membership.unreserve(result.target_node_id, size_bytes)
        if slot < 0 or object_id != result.object_id:
            return                    # removed or replaced meanwhile; the target refused it
        target = index.table.ix_of(result.target_node_id)
        if target is not None and native.repair(slot)[0] == target:
            native.set_repair(slot, -1, 0)
        index.repair_hint = True     # a failed copy is planned again; a done one may not suffice
        if result.error:
            index.counters[C.REPAIR_FAILURES] += 1
            log.warning("repair copy of %s to %s failed: %s", result.key,
                        result.target_node_id, result.error)
