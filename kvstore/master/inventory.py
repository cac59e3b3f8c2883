"""A (re)registering node's inventory, made the truth about that node in the index.

A node sends what it holds in chunks (SyncInventory; a node may hold
millions of objects: no one message, no one stall), and the master applies
each chunk a slice at a time on its event loop::

    RegisterNode ---> node registered, SYNCING: not alive yet (its replicas are not
                      offered to readers, no put is placed on it), its events wait
    chunk 0..k   ---> apply(): each listed object indexed, or kept, or refused
    last chunk   ---> sweep(): its replicas no chunk listed are forgotten (a restart
                      loses DRAM); then it is alive and its events are delivered

The rules of what an inventory may and may not make visible: listed objects
the index does not know are indexed (a restart keeps the SSD; a new master
learns the cluster this way), wanting the largest ``replica_num`` any holder
announces (what the put asked for). Only objects a master confirmed are
indexed so: a ``pending`` item (stored, its STORED event not yet applied) is
not, and its replayed event decides, so bytes written straight to a node
never become visible through an inventory. Of two confirmed versions of a
key the later put wins (the larger object id: ids only grow, see
:mod:`kvstore.master.roster`): a listed version older than the index's is
ordered dropped, a newer one replaces it; so is one the shard replaced while
the node was away (:mod:`kvstore.master.superseded`), and one it already
ordered dropped (removed meanwhile) is not indexed again.

Split from :mod:`kvstore.master.index` (its one caller): the rules live here,
next to nothing else. A chunk decoded natively (the servicer's SyncInventory:
``kvstore._native.InventoryChunk``) is applied by :meth:`InventorySync.apply_native`:
the common cases in one native call (kvstore/native/entry_inventory.hpp, the
same rules for the items whose outcome needs nothing but the table), every other
item by :meth:`InventorySync.apply` at its place in the chunk's order.

Thread safety: as the index (the master's event loop); the servicer runs one
chunk of a registration at a time and yields between slices.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from kvstore import wire
from kvstore.errors import KVStoreError
from kvstore.keys import NUM_SLOTS
from kvstore.master.counters import MasterCounter as C
from kvstore.master.entries import SCAN_SLICE
from kvstore.types import InventoryItem, NodeId, TierKind

#: Inventory items applied per slice of the event loop (about 2-5 ms).
APPLY_SLICE = 512
#: Items of a natively decoded chunk applied per slice (about 0.5 ms: 0.2-0.6 µs each). Small
#: because a slice may also grow parts of the entry table (each rehashes 1/256 of it, about
#: 5 ms at 10M entries): 4096-item slices held the loop up to 33 ms at 10M.
NATIVE_SLICE = 1024


def owned_slots(index) -> bytes:
    """One byte per hash slot: 1 where ``index``'s shard owns it, 0 where another
    shard does, 2 where the map names none (its keys take the Python rules, which
    fail them as :meth:`ObjectIndex._check_key` does). Kept on the index (its map
    never changes)."""
    owned = getattr(index, "_owned_slots", None)
    if owned is None:
        marks = bytearray(NUM_SLOTS)
        for slot in range(NUM_SLOTS):
            try:
                marks[slot] = index.shard_map.shard_for_slot(slot).shard_id == index.shard_id
            except AssertionError:
                marks[slot] = 2
        owned = index._owned_slots = bytes(marks)
    return owned


class InventorySync:
    """One registration's inventory, applied as it arrives.

    Args:
        index: the shard's :class:`~kvstore.master.index.ObjectIndex`.
        node_id: the registering node.
        sweep: whether the index may hold replicas of this node already (it
            was registered before), so that the ones the inventory does not
            list must be looked for at the end; False for a node new to the
            index, which skips the scan of every entry.
    """

    def __init__(self, index, node_id: NodeId, sweep: bool = True):
        self.index = index
        self.node_id = node_id
        self.node = index.table.ix(node_id)   # its number in the entry table
        self.next_seq = 0              # the chunk expected next
        self.items_applied = 0
        self.indexed = 0               # entries created from the inventory
        self.lost = 0                  # entries that lost their last replica at the sweep
        self._ordered = index.membership.ordered_drops(node_id)
        self._ordered_keys: set | None = None      # their keys (_defer_mask)
        # Which entries the inventory listed this node's version of, by entry slot.
        self._listed = bytearray() if sweep else None

    def _mark(self, slot: int) -> None:
        if self._listed is None:
            return
        if slot >= len(self._listed):
            self._listed.extend(bytes(slot + 1 - len(self._listed) + 4096))
        self._listed[slot] = 1

    def apply(self, items: Sequence[InventoryItem], now_ms: int) -> None:
        """Apply a slice of the inventory (bounded by the caller; see APPLY_SLICE)."""
        index, node_id, node = self.index, self.node_id, self.node
        native = index.table.native
        for it in items:
            self.items_applied += 1
            if (it.key, it.object_id) in self._ordered:
                continue
            try:
                index._check_key(it.key)
            except KVStoreError:
                continue              # another shard's key (or garbage): not ours to index
            slot = native.find(it.key)
            if slot >= 0 and native.head(slot)[0] != it.object_id:
                self._forget(slot)    # the node holds another version than the one indexed
                slot = native.find(it.key)
            object_id = native.head(slot)[0] if slot >= 0 else 0
            if it.pending:
                # Not applied by a master yet: its STORED event, replayed after
                # the inventory, decides (a put the index never placed is refused).
                if slot >= 0 and object_id != it.object_id:
                    index.membership.order_drop(node_id, it.key, it.object_id)
                    index.counters[C.STALE_REPLICAS_DROPPED] += 1
                elif slot >= 0:
                    self._mark(slot)      # applied here, its answer lost: kept
                continue
            if index.superseded.replaced(it.key, it.object_id):
                # The shard acknowledged a later version since this node went away.
                index.membership.order_drop(node_id, it.key, it.object_id)
                index.counters[C.STALE_REPLICAS_DROPPED] += 1
                continue
            index._next_id = max(index._next_id, it.object_id + 1)
            if slot >= 0 and object_id < it.object_id:
                self._supersede(slot, it.key, it.object_id, now_ms)
                slot = -1
            if slot < 0:
                if len(index.table) >= index.max_objects:
                    index.counters[C.INVENTORY_OVER_LIMIT] += 1    # indexed all the same
                slot = native.insert(it.key, it.size_bytes, it.checksum, it.object_id, now_ms,
                                     max(1, it.replica_num), node, it.tier or TierKind.DRAM)
                index.complete_bytes += it.size_bytes
                self.indexed += 1
            elif object_id == it.object_id:
                native.add_replica(slot, node, it.tier or TierKind.DRAM)
                # A rebuilt index learns how many replicas were wanted from what the
                # nodes say their puts asked for, and at least as many as it finds.
                native.set_replica_num(slot, max(native.replica_num(slot),
                                                 len(native.nodes(slot)), it.replica_num))
            else:
                index.membership.order_drop(node_id, it.key, it.object_id)
                index.counters[C.STALE_REPLICAS_DROPPED] += 1
                continue
            self._mark(slot)

    def apply_native(self, chunk, start: int, end: int, now_ms: int) -> None:
        """Apply items [start, end) of a natively decoded chunk (every item checked
        already: ``first_invalid``), in order: runs of common items natively, each
        other item by :meth:`apply` (the full rules) at its place."""
        index = self.index
        native = index.table.native
        owned = owned_slots(index)
        defer = self._defer_mask(chunk, start, end)
        i = start
        while i < end:
            if self._listed is not None:
                need = native.positions() + (end - i)
                if len(self._listed) < need:
                    self._listed.extend(bytes(need - len(self._listed) + 4096))
            stop, inserted, inserted_bytes, over_limit, max_id = chunk.apply(
                native, i, end, self.node, now_ms, owned, defer, self._listed, index.max_objects)
            self.items_applied += stop - i
            self.indexed += inserted
            index.complete_bytes += inserted_bytes
            if over_limit:
                index.counters[C.INVENTORY_OVER_LIMIT] += over_limit
            if max_id:
                index._next_id = max(index._next_id, max_id + 1)
            if stop >= end:
                return
            self.apply([wire.inventory_row(chunk.item(stop))], now_ms)
            i = stop + 1

    def _defer_mask(self, chunk, start: int, end: int) -> bytearray | None:
        """A byte per item of ``chunk``, 1 for the items in [start, end) whose keys the
        native apply cannot judge: a superseded note or a drop ordered to this node names
        them. None when there are none (nearly always; after a master restart there are
        none). Keys that change state within the slice are caught natively (a key repeated
        in the chunk stops it)."""
        noted = self.index.superseded.keys()
        if not self._ordered and not noted:
            return None
        if self._ordered_keys is None:
            self._ordered_keys = {key for key, _ in self._ordered}
        ordered, mask = self._ordered_keys, bytearray(chunk.stored())
        for i in range(start, end):
            key = chunk.key(i)
            mask[i] = key in noted or key in ordered
        return mask

    def _supersede(self, slot: int, key: str, later_id: int, now_ms: int) -> None:
        """The node announces a later version of the key at ``slot`` (ids only grow: the
        larger id is the later put; e.g. two nodes re-registering with a restarted
        master): the indexed one goes, dropped by its live holders and noted
        against its dead ones (:mod:`kvstore.master.superseded`)."""
        index = self.index
        holders = index.table.names(index.table.native.nodes(slot))
        live = [n for n in holders if index.membership.is_alive(n)]
        if len(live) < len(holders):
            index.superseded.note(key, later_id, now_ms)
        index._delete(slot, live)
        index.counters[C.STALE_REPLICAS_DROPPED] += len(live)

    def _forget(self, slot: int) -> None:
        """This node does not hold the version at ``slot``: it is no longer a replica of
        it (an entry left with no replica is deleted)."""
        native = self.index.table.native
        if native.remove_replica(slot, self.node) and not native.nodes(slot):
            self.index._delete(slot, [])
            self.lost += 1

    def sweep(self) -> Iterator[None]:
        """After the last chunk: forget this node's replicas that no chunk listed, a
        slice of the index at a time (yields between slices)."""
        index = self.index
        index.repair_hint = True
        index.counters[C.REINDEXED] += self.indexed
        if self._listed is None:
            return
        native = index.table.native
        for start in range(0, native.positions(), SCAN_SLICE):
            _, lost, lost_bytes = native.sweep_slice(start, SCAN_SLICE, self.node, self._listed)
            index.complete_bytes -= lost_bytes
            self.lost += lost
            yield


def sync_node_inventory(index, node_id: NodeId, items: Sequence[InventoryItem],
                        now_ms: int) -> tuple[int, int]:
    """Apply a whole inventory at once (:class:`InventorySync` without yielding).

    Returns:
        (entries that lost their last replica, entries indexed from the inventory).
    """
    sync = InventorySync(index, node_id)
    sync.apply(items, now_ms)
    for _ in sync.sweep():
        pass
    return sync.lost, sync.indexed
