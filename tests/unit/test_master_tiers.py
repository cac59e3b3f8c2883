"""The master's view of node tiers: replica tiers from events, inventories at registration.

Driven without a network, like test_master_index (whose helpers it uses).
"""

from __future__ import annotations

import pytest

from kvstore.errors import NotFound
from kvstore.master.index import ObjectIndex
from kvstore.master.membership import Membership, NodeHeartbeat
from kvstore.shardmap import ShardMap
from kvstore.types import EventKind, InventoryItem, NodeEvent, TierKind, TierStats
from test_master_index import T0, all_drops, lookup_error, put, register, start, stored


@pytest.fixture
def index() -> ObjectIndex:
    membership = Membership()
    register(membership, "n0")
    register(membership, "n1")
    return ObjectIndex(membership, ShardMap.single("127.0.0.1:1"))


def event(kind: EventKind, key: str, object_id: int, tier: TierKind | None = None) -> NodeEvent:
    return NodeEvent(kind, key, object_id, tier)


def tiers(index, key: str) -> dict[str, TierKind]:
    (meta,) = index.lookup([key], T0)
    return {r.node.node_id: r.tier for r in meta.replicas}


def item(key: str, object_id: int, tier: TierKind = TierKind.SSD, size: int = 100,
         checksum: int = 7) -> InventoryItem:
    return InventoryItem(key, object_id, size, checksum, tier)


def test_events_move_the_replica_tier(index):
    r = put(index, "k")
    node = r.targets[0].node_id
    assert tiers(index, "k") == {node: TierKind.DRAM}
    index.node_event(node, event(EventKind.DEMOTED, "k", r.object_id, TierKind.SSD))
    assert tiers(index, "k") == {node: TierKind.SSD}
    assert index.list("", "", 10)[0][0].replicas[0].tier is TierKind.SSD
    index.node_event(node, event(EventKind.PROMOTED, "k", r.object_id, TierKind.DRAM))
    assert tiers(index, "k") == {node: TierKind.DRAM}
    index.node_event(node, event(EventKind.DEMOTED, "k", r.object_id + 1, TierKind.SSD))  # another version
    assert tiers(index, "k") == {node: TierKind.DRAM}
    index.node_event(node, event(EventKind.EVICTED, "k", r.object_id))
    assert lookup_error(index, "k") is NotFound and index.exists(["k"]) == [False]
    assert (index.counters["replicas_demoted"], index.counters["replicas_promoted"],
            index.counters["replicas_evicted"]) == (1, 1, 1)


def test_a_demotion_right_after_the_store_is_kept(index):
    r = start(index, "k")
    node = r.targets[0].node_id
    assert stored(index, "k", r) == [None]
    index.node_event(node, event(EventKind.DEMOTED, "k", r.object_id, TierKind.SSD))
    assert tiers(index, "k") == {node: TierKind.SSD}


def test_inventory_forgets_dram_and_keeps_ssd(index):
    placed = {k: put(index, k) for k in (f"k{i}" for i in range(12))}   # rendezvous-placed
    on_n0 = [k for k, r in placed.items() if r.targets[0].node_id == "n0"]
    a, c = on_n0[:2]
    b = next(k for k, r in placed.items() if r.targets[0].node_id == "n1")
    # n0 restarts: only a survived (on its SSD); c and n0's others were only in DRAM.
    lost, indexed = index.sync_node_inventory("n0", [item(a, placed[a].object_id)], T0)
    assert (lost, indexed) == (len(on_n0) - 1, 0)
    assert tiers(index, a) == {"n0": TierKind.SSD}
    assert lookup_error(index, c) is NotFound and index.exists([a, b, c]) == [True, True, False]
    assert index.sync_node_inventory("n0", [], T0) == (1, 0)      # and now nothing at all
    assert lookup_error(index, a) is NotFound


def test_inventory_indexes_unknown_objects_and_bumps_ids(index):
    lost, indexed = index.sync_node_inventory(
        "n0", [item("x", 500), item("y", 7, TierKind.DRAM)], T0)
    assert (lost, indexed) == (0, 2) and index.counters["reindexed"] == 2
    assert tiers(index, "x") == {"n0": TierKind.SSD} and tiers(index, "y") == {"n0": TierKind.DRAM}
    (meta,) = index.lookup(["x"], T0)
    assert (meta.object_id, meta.size_bytes, meta.checksum) == (500, 100, 7)
    assert put(index, "z").object_id > 500                 # never reuses an announced id
    # The same object announced by a second node: one more replica.
    index.sync_node_inventory("n1", [item("x", 500)], T0)
    assert tiers(index, "x") == {"n0": TierKind.SSD, "n1": TierKind.SSD}


def test_an_unapplied_put_in_an_inventory_waits_for_its_replayed_report(index):
    r = start(index, "k")
    node = r.targets[0].node_id
    # The node re-registers before its STORED event was applied: the inventory lists
    # it as pending, which makes nothing visible; the replayed event decides.
    pending = InventoryItem("k", r.object_id, 100, 7, TierKind.DRAM, pending=True)
    assert index.sync_node_inventory(node, [pending], T0) == (0, 0)
    assert "k" not in index.entries
    assert stored(index, "k", r) == [None]
    assert tiers(index, "k") == {node: TierKind.DRAM} and index.counters["puts"] == 1


def test_inventory_of_a_replaced_or_removed_version_is_dropped(index):
    index.start_term(100)                  # ids only grow: an older version has a smaller one
    new = put(index, "k", checksum=9)
    all_drops(index)
    other = "n1" if new.targets[0].node_id == "n0" else "n0"     # away when "k" was put
    stale = item("k", new.object_id - 1, checksum=1)
    index.sync_node_inventory(other, [stale], T0)
    assert ("k", stale.object_id) in all_drops(index)[other]
    assert index.counters["stale_replicas_dropped"] == 1
    # Removed while its node was away: the drop order stands, the object stays gone.
    r = put(index, "gone")
    node = r.targets[0].node_id
    assert [m.key for m in index.remove(["gone"])] == ["gone"]
    register(index.membership, node)                       # the node comes back ...
    index.sync_node_inventory(node, [item("gone", r.object_id)], T0)   # ... with it on SSD
    assert lookup_error(index, "gone") is NotFound
    assert ("gone", r.object_id) in all_drops(index)[node]


def test_stat_carries_tiers_and_node_counters(index):
    index.membership.heartbeat(NodeHeartbeat(
        "n0", used_bytes=5, num_objects=0,
        tiers=(TierStats(TierKind.DRAM, 10, 5, 5), TierStats(TierKind.SSD, 40, 0, 40)),
        counters={"demotions": 3}), T0)
    by_id = {n.address.node_id: n for n in index.stat().nodes}
    assert [t.kind for t in by_id["n0"].tiers] == [TierKind.DRAM, TierKind.SSD]
    assert by_id["n0"].counters["demotions"] == 3
