"""The master's view of node tiers: replica tiers from events, inventories at registration.

Driven without a network, like test_master_index (whose helpers it uses).
"""

from __future__ import annotations

import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.master.index import ObjectIndex
from kvstore.master.membership import Membership
from kvstore.shardmap import ShardMap
from test_master_index import T0, all_drops, end, lookup_code, put, register, start


@pytest.fixture
def index() -> ObjectIndex:
    membership = Membership()
    register(membership, "n0")
    register(membership, "n1")
    return ObjectIndex(membership, ShardMap.single("127.0.0.1:1"))


def event(kind: int, key: str, object_id: int, tier: int = pb.TIER_UNSPECIFIED) -> pb.ReplicaEvent:
    return pb.ReplicaEvent(kind=kind, key=key, object_id=object_id, tier=tier)


def tiers(index, key: str) -> dict[str, int]:
    (res,) = index.lookup([key], T0).results
    return {r.node.node_id: r.tier for r in res.meta.replicas}


def item(key: str, object_id: int, tier: int = pb.SSD, size: int = 100,
         checksum: int = 7) -> pb.InventoryItem:
    return pb.InventoryItem(key=key, object_id=object_id, size_bytes=size, checksum=checksum,
                            tier=tier)


def test_events_move_the_replica_tier(index):
    r = put(index, "k")
    node = r.targets[0].node_id
    assert tiers(index, "k") == {node: pb.DRAM}
    index.node_event(node, event(pb.DEMOTED, "k", r.object_id, pb.SSD))
    assert tiers(index, "k") == {node: pb.SSD}
    assert index.list("", "", 10).objects[0].replicas[0].tier == pb.SSD
    index.node_event(node, event(pb.PROMOTED, "k", r.object_id, pb.DRAM))
    assert tiers(index, "k") == {node: pb.DRAM}
    index.node_event(node, event(pb.DEMOTED, "k", r.object_id + 1, pb.SSD))   # another version
    assert tiers(index, "k") == {node: pb.DRAM}
    index.node_event(node, event(pb.EVICTED, "k", r.object_id))
    assert lookup_code(index, "k") == pb.NOT_FOUND and index.exists(["k"]) == [False]
    assert (index.counters["replicas_demoted"], index.counters["replicas_promoted"],
            index.counters["replicas_evicted"]) == (1, 1, 1)


def test_a_demotion_that_overtakes_put_end_is_kept(index):
    r = start(index, "k")
    node = r.targets[0].node_id
    index.node_event(node, event(pb.DEMOTED, "k", r.object_id, pb.SSD))
    assert end(index, "k", r).code == pb.OK
    assert tiers(index, "k") == {node: pb.SSD}


def test_inventory_forgets_dram_and_keeps_ssd(index):
    a, b, c = put(index, "a"), put(index, "b"), put(index, "c")   # placed n0, n1, n0
    assert [r.targets[0].node_id for r in (a, b, c)] == ["n0", "n1", "n0"]
    # n0 restarts: only "a" survived (on its SSD); "c" was only in DRAM.
    lost, indexed = index.sync_node_inventory("n0", [item("a", a.object_id)], T0)
    assert (lost, indexed) == (1, 0)
    assert tiers(index, "a") == {"n0": pb.SSD}
    assert lookup_code(index, "c") == pb.NOT_FOUND and index.exists(["a", "b", "c"]) == [
        True, True, False]
    assert index.sync_node_inventory("n0", [], T0) == (1, 0)      # and now nothing at all
    assert lookup_code(index, "a") == pb.NOT_FOUND


def test_inventory_indexes_unknown_objects_and_bumps_ids(index):
    lost, indexed = index.sync_node_inventory("n0", [item("x", 500), item("y", 7, pb.DRAM)], T0)
    assert (lost, indexed) == (0, 2) and index.counters["reindexed"] == 2
    assert tiers(index, "x") == {"n0": pb.SSD} and tiers(index, "y") == {"n0": pb.DRAM}
    (res,) = index.lookup(["x"], T0).results
    assert (res.meta.object_id, res.meta.size_bytes, res.meta.checksum) == (500, 100, 7)
    assert put(index, "z").object_id > 500                 # never reuses an announced id
    # The same object announced by a second node: one more replica.
    index.sync_node_inventory("n1", [item("x", 500)], T0)
    assert tiers(index, "x") == {"n0": pb.SSD, "n1": pb.SSD}


def test_inventory_of_a_replaced_or_removed_version_is_dropped(index):
    new = put(index, "k", checksum=9)
    all_drops(index)
    stale = item("k", new.object_id - 1 if new.object_id > 1 else 99, checksum=1)
    index.sync_node_inventory("n1", [stale], T0)
    assert ("k", stale.object_id) in all_drops(index)["n1"]
    assert index.counters["stale_replicas_dropped"] == 1
    # Removed while its node was away: the drop order stands, the object stays gone.
    r = put(index, "gone")
    node = r.targets[0].node_id
    assert index.remove(["gone"], "remove").statuses[0].code == pb.OK
    register(index.membership, node)                       # the node comes back ...
    index.sync_node_inventory(node, [item("gone", r.object_id)], T0)   # ... with it on SSD
    assert lookup_code(index, "gone") == pb.NOT_FOUND
    assert ("gone", r.object_id) in all_drops(index)[node]


def test_stat_carries_tiers_and_node_counters(index):
    index.membership.heartbeat(pb.HeartbeatRequest(
        node_id="n0", used_bytes=5, tiers=[pb.TierStat(tier=pb.DRAM, capacity_bytes=10,
                                                       used_bytes=5, free_bytes=5),
                                           pb.TierStat(tier=pb.SSD, capacity_bytes=40,
                                                       used_bytes=0, free_bytes=40)],
        counters={"demotions": 3}), T0)
    by_id = {n.address.node_id: n for n in index.stat().nodes}
    assert [t.tier for t in by_id["n0"].tiers] == [pb.DRAM, pb.SSD]
    assert by_id["n0"].counters["demotions"] == 3
