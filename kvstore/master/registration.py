"""Node registrations of one leader term: each node's inventory, applied as it streams in.

    RegisterNode(address, tiers)      --> membership: SYNCING; roster: kept; a sync id
    SyncInventory(sync id, seq 0)     --> applied a slice at a time (APPLY_SLICE items,
    SyncInventory(sync id, seq 1)         then the event loop serves others), one chunk
    ...                                   of a node at a time
    SyncInventory(sync id, seq k, last) -> the sweep (a slice at a time); the node is
                                          alive, the warm-up counts it SYNCED

A chunk sent again (its answer was lost) is acknowledged, not applied twice;
a chunk out of order, or of a registration that a newer one of the node
replaced (or that the master never made: it restarted), answers "not
known" and the node registers again from the start. A registration whose
chunks stop for a node ttl is given up with the node (membership.expire).

Thread safety: owned by the master's event loop. The coroutines yield
between slices; a per-node lock keeps one chunk of a node in flight.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

from kvstore import wire
from kvstore._native import InventoryChunk
from kvstore.errors import InvalidArgument, Unavailable
from kvstore.process import freeze_survivors
from kvstore.master.inventory import APPLY_SLICE, NATIVE_SLICE, InventorySync
from kvstore.master.limits import MAX_INVENTORY_CHUNK, MAX_INVENTORY_OBJECT_ID, check_inventory
from kvstore.rpc import MAX_REPLICAS
from kvstore.master.membership import NodeRegistration
from kvstore.master.roster import Roster
from kvstore.master.warmup import Warmup
from kvstore.types import InventoryItem, NodeId

log = logging.getLogger(__name__)


#: How long a chunk one ahead of the next expected waits for it (s): a node keeps two
#: chunks in flight (kvstore.store.inventory), and the second may be handled first.
AHEAD_WAIT_S = 10.0


@dataclass(slots=True)
class _Sync:
    sync_id: int
    inventory: InventorySync
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    applied: asyncio.Condition | None = None      # notified when next_seq moves (on lock)

    def __post_init__(self):
        self.applied = asyncio.Condition(self.lock)


class Registrations:
    """The registrations in progress on one leader term's index.

    Args:
        index: the term's :class:`~kvstore.master.index.ObjectIndex`.
        warmup: the term's warm-up, told of each node's progress.
        roster: where the shard's nodes are kept (a new node is added before
            its registration is answered).
        known: the roster's nodes as loaded (None: not loaded yet, or no roster).
    """

    def __init__(self, index, warmup: Warmup, roster: Roster,
                 known: set[NodeId] | None = None):
        self.index = index
        self.warmup = warmup
        self.roster = roster
        self.known = set(known) if known is not None else None
        self._syncs: dict[NodeId, _Sync] = {}

    async def register(self, reg: NodeRegistration, now_ms: int) -> int:
        """Register a node whose inventory follows; returns the sync id its chunks carry.

        Raises:
            InvalidArgument, PermissionDenied: as :meth:`Membership.register`.
            Unavailable: the roster could not keep a new node (the node retries).
        """
        membership = self.index.membership
        node_id = reg.address.node_id
        _, was_known = membership.register(reg, now_ms, syncing=True)
        sweep = was_known or node_id in self.index.forgetting
        sync = _Sync(secrets.randbits(63) or 1, InventorySync(self.index, node_id, sweep=sweep))
        self._syncs[node_id] = sync
        self.warmup.registered(node_id)
        if self.known is None or node_id not in self.known:
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.roster.add, node_id)
            except OSError as exc:
                raise Unavailable(f"the shard could not keep node {node_id} on its roster "
                                  f"({exc}); register again") from None
            if self.known is not None:
                self.known.add(node_id)
        return sync.sync_id

    async def sync_chunk(self, node_id: NodeId, sync_id: int, seq: int, raw_items: Sequence,
                         last: bool, now_ms, read: Callable[[Any], InventoryItem]) -> int | None:
        """Apply one chunk of a node's inventory (its identity was checked by the caller).

        Args:
            raw_items: the chunk's items as they came (read with ``read``, a slice
                at a time: every item is read and checked before any is applied),
                or the whole request decoded natively (``kvstore._native.InventoryChunk``:
                checked natively, applied by :meth:`InventorySync.apply_native`).
            now_ms: a callable giving the time (the apply spans many slices).
            read: one raw item as an :class:`InventoryItem` (raises InvalidArgument).

        Returns:
            The items of this registration applied so far, or None when the
            registration is not known (register again).

        Raises:
            InvalidArgument: more than MAX_INVENTORY_CHUNK items, or an item no
                node could hold (nothing of the chunk is applied).
        """
        if len(raw_items) > MAX_INVENTORY_CHUNK:
            raise InvalidArgument(f"{len(raw_items)} inventory items in one chunk; at most "
                                  f"{MAX_INVENTORY_CHUNK}")
        sync = self._syncs.get(node_id)
        if sync is None or sync.sync_id != sync_id:
            return None
        native = isinstance(raw_items, InventoryChunk)
        items: list[InventoryItem] = []
        if native:
            _check_native(raw_items)
        else:
            for start in range(0, len(raw_items), APPLY_SLICE):
                part = [read(it) for it in raw_items[start:start + APPLY_SLICE]]
                check_inventory(part)
                items.extend(part)
                await asyncio.sleep(0)
        async with sync.lock:
            if self._syncs.get(node_id) is not sync:
                return None           # replaced or given up while this chunk waited
            inv = sync.inventory
            if seq == inv.next_seq + 1:
                # The chunk before this one is still on its way (two in flight): wait for
                # it to be applied, a bounded time (it may have been lost).
                try:
                    await asyncio.wait_for(sync.applied.wait_for(
                        lambda: inv.next_seq >= seq or self._syncs.get(node_id) is not sync),
                        AHEAD_WAIT_S)
                except asyncio.TimeoutError:
                    return None
                if self._syncs.get(node_id) is not sync:
                    return None
            if seq < inv.next_seq:
                return inv.items_applied          # a resend: applied already
            if seq > inv.next_seq:
                return None                       # a gap: start again
            membership = self.index.membership
            count = len(raw_items) if native else len(items)
            step = NATIVE_SLICE if native else APPLY_SLICE
            for start in range(0, count, step):
                if self._syncs.get(node_id) is not sync:
                    return None
                end = min(count, start + step)
                if native:
                    inv.apply_native(raw_items, start, end, now_ms())
                else:
                    inv.apply(items[start:end], now_ms())
                membership.touch(node_id, now_ms())
                self.warmup.applied(node_id, end - start)
                await asyncio.sleep(0)
            inv.next_seq += 1
            sync.applied.notify_all()
            # A chunk's entries out of the full collections' reach now, not at the next
            # maintenance round: a full collection walks what was made since the last
            # freeze (at 100k entries a second, 0.2 s of them took 40 ms of the loop).
            freeze_survivors()
            if not last:
                return inv.items_applied
            for _ in inv.sweep():
                if self._syncs.get(node_id) is not sync:
                    return None
                membership.touch(node_id, now_ms())
                await asyncio.sleep(0)
            del self._syncs[node_id]
            membership.synced(node_id, now_ms())
            self.warmup.synced(node_id)
            log.info("node %s: inventory of %d object(s) applied: %d indexed, %d lost their "
                     "last replica", node_id, inv.items_applied, inv.indexed, inv.lost)
            return inv.items_applied

    def expire(self) -> None:
        """Give up the registrations of nodes membership no longer counts as syncing
        (no chunk for a node ttl, or re-registered under another process)."""
        for node_id in list(self._syncs):
            info = self.index.membership.nodes.get(node_id)
            if info is None or not info.syncing:
                del self._syncs[node_id]
                self.warmup.gave_up(node_id)

    def in_progress(self) -> Iterator[tuple[NodeId, int]]:
        """(node, items applied) of each registration under way."""
        for node_id, sync in self._syncs.items():
            yield node_id, sync.inventory.items_applied


def _check_native(chunk: InventoryChunk) -> None:
    """Refuse a natively decoded chunk no node could send, as the Python reading
    (:func:`kvstore.wire.inventory_item`, :func:`check_inventory`) refuses it.

    Raises:
        InvalidArgument: an item with an object id of 0 or past the limit, a
            replica_num past MAX_REPLICAS, or a tier that is none (nothing applied).
    """
    bad = chunk.first_invalid(MAX_INVENTORY_OBJECT_ID, MAX_REPLICAS)
    if bad >= 0:
        check_inventory([wire.inventory_row(chunk.item(bad))])      # raises its error
        raise InvalidArgument(f"inventory item {bad} cannot be held by a node")
