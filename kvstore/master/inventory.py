"""A (re)registering node's inventory, made the truth about that node in the index.

Split from :mod:`kvstore.master.index` (its one caller): the rules of what an
inventory may and may not make visible live here, next to nothing else.

Thread safety: as the index (the master's event loop).
"""

from __future__ import annotations

from typing import Sequence

from kvstore.errors import KVStoreError
from kvstore.master.counters import MasterCounter as C
from kvstore.types import InventoryItem, NodeId
from kvstore.master.entry import Entry


def sync_node_inventory(index, node_id: NodeId, items: Sequence[InventoryItem],
                        now_ms: int) -> tuple[int, int]:
    """Make ``index`` (a :class:`~kvstore.master.index.ObjectIndex`) agree with what a
    (re)registering node holds.

    The node's replicas that its inventory does not list (same key and
    object_id) are forgotten -- a restart loses DRAM -- and listed
    objects the index does not know are indexed as COMPLETE (a restart
    keeps the SSD; a new master learns the cluster this way), wanting the
    largest ``replica_num`` any holder announces (what the put asked for). Only objects
    a master confirmed are indexed so: a ``pending`` item (stored, its
    STORED event not yet applied) is not, and its replayed event decides,
    so bytes written straight to a node never become visible through an
    inventory. A listed
    version that the index has replaced is ordered dropped; one it already
    ordered dropped (removed while the node was away) is not indexed again.

    Returns:
        (entries that lost their last replica, entries indexed from the inventory).
    """
    ordered = index.membership.ordered_drops(node_id)
    items = [it for it in items if (it.key, it.object_id) not in ordered]
    held = {it.key: it for it in items}
    lost = 0
    for entry in list(index.entries.values()):
        it = held.get(entry.key)
        same = it is not None and it.object_id == entry.object_id
        if node_id in entry.replicas and not same:
            entry.replicas.remove(node_id)
            entry.tiers.pop(node_id, None)
            if not entry.replicas:
                index._delete(entry, [])
                lost += 1
    indexed = 0
    for it in items:
        try:
            index._check_key(it.key)
        except KVStoreError:
            continue                  # another shard's key (or garbage): not ours to index
        if it.pending:
            # Not applied by a master yet: its STORED event, replayed after
            # the inventory, decides (a put the index never placed is refused).
            entry = index.entries.get(it.key)
            if entry is not None and entry.object_id != it.object_id:
                index.membership.order_drop(node_id, it.key, it.object_id)
                index.counters[C.STALE_REPLICAS_DROPPED] += 1
            continue
        index._next_id = max(index._next_id, it.object_id + 1)
        entry = index.entries.get(it.key)
        if entry is None:
            index.entries[it.key] = Entry(
                key=it.key, size_bytes=it.size_bytes, checksum=it.checksum,
                object_id=it.object_id, replicas=[node_id], created_ms=now_ms,
                tiers={node_id: it.tier}, replica_num=max(1, it.replica_num))
            index.key_order.add(it.key)
            index.complete_bytes += it.size_bytes
            indexed += 1
        elif entry.object_id == it.object_id:
            if node_id not in entry.replicas:
                entry.replicas.append(node_id)
            # A rebuilt index learns how many replicas were wanted from what the
            # nodes say their puts asked for, and at least as many as it finds.
            entry.replica_num = max(entry.replica_num, len(entry.replicas), it.replica_num)
            entry.tiers[node_id] = it.tier
        else:
            index.membership.order_drop(node_id, it.key, it.object_id)
            index.counters[C.STALE_REPLICAS_DROPPED] += 1
    index.counters[C.REINDEXED] += indexed
    return lost, indexed
