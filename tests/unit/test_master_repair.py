"""Issue 5 on the master's pure parts: per-key Exists answers on a sharded
map, repair planning and results, quarantine, and the id floor of a new term.
No network: records and dataclasses in, time as ``now_ms``."""

from __future__ import annotations

from kvstore.errors import NotFound, WrongShard
from kvstore.keys import key_slot
from kvstore.master.index import ObjectIndex
from kvstore.master.membership import Membership
from kvstore.master.repair import RepairPlanner
from kvstore.shardmap import ShardMap
from kvstore.types import CopyResult, DropOrder, EventKind, InventoryItem, NodeEvent, TierKind
from test_master_index import T0, TTL_MS, heartbeat, register, start, stored


def three_nodes() -> ObjectIndex:
    m = Membership(node_ttl_ms=TTL_MS)
    for n in ("n0", "n1", "n2"):
        register(m, n)
    return ObjectIndex(m, ShardMap.single("127.0.0.1:1"))


def copy_landed(idx: ObjectIndex, key: str, target: str) -> NotFound | None:
    """The repair target reports the copy STORED, as any node reports a write."""
    entry = idx.entries.get(key)
    oid = entry.object_id if entry else 1
    return idx.node_event(target, NodeEvent(EventKind.STORED, key, oid, TierKind.DRAM,
                                            entry.size_bytes if entry else 100,
                                            entry.checksum if entry else 7))


def test_exists_answers_wrong_shard_never_false_for_a_key_it_does_not_own():
    smap = ShardMap.even([("a:1",), ("b:2",)])
    idx = ObjectIndex(Membership(), smap, shard_id=0)
    mine = next(f"k{i}" for i in range(100) if smap.shard_for_slot(key_slot(f"k{i}")).shard_id == 0)
    other = next(f"k{i}" for i in range(100) if smap.shard_for_slot(key_slot(f"k{i}")).shard_id == 1)
    exists, errors = idx.exists_checked([mine, other])
    assert exists == [False, False]
    assert errors[0] is None
    assert isinstance(errors[1], WrongShard) and errors[1].redirect == "b:2"


def test_dead_replica_is_repaired_once_and_counted():
    idx = three_nodes()
    repairs = RepairPlanner(idx)
    r = start(idx, "k", replica_num=2)
    holders = [t.node_id for t in r.targets]
    assert stored(idx, "k", r) == [None, None]
    spare = ({"n0", "n1", "n2"} - set(holders)).pop()
    now = T0 + TTL_MS + 1
    for n in (holders[1], spare):
        heartbeat(idx.membership, n, now)
    idx.membership.expire(now)                 # holders[0] is dead
    assert repairs.plan(now) == 1
    assert repairs.plan(now) == 0              # one copy in flight per object
    (order,) = idx.membership.take_copies(holders[1])
    assert order.key == "k" and order.target.node_id == spare
    assert copy_landed(idx, "k", spare) is None
    repairs.done(CopyResult("k", r.object_id, spare))
    (meta,) = idx.lookup(["k"], now)
    assert sorted(x.node.node_id for x in meta.replicas) == sorted([holders[1], spare])
    assert idx.counters["repairs"] == 1
    assert repairs.plan(now) == 0
    assert all(n.reserved_bytes == 0 for n in idx.membership.nodes.values())


def test_failed_copy_is_retried_and_a_copy_of_a_removed_key_is_dropped():
    idx = three_nodes()
    repairs = RepairPlanner(idx)
    r = start(idx, "k", replica_num=2)
    stored(idx, "k", r)
    holders = [t.node_id for t in r.targets]
    spare = ({"n0", "n1", "n2"} - set(holders)).pop()
    now = T0 + TTL_MS + 1
    for n in (holders[1], spare):
        heartbeat(idx.membership, n, now)
    idx.membership.expire(now)
    repairs.plan(now)
    repairs.done(CopyResult("k", r.object_id, spare, error="NoSpace: full"))
    assert idx.counters["repair_failures"] == 1
    assert repairs.plan(now) == 1
    idx.remove(["k"])
    assert isinstance(copy_landed(idx, "k", spare), NotFound)   # the copy of a removed key ...
    repairs.done(CopyResult("k", r.object_id, spare))
    assert DropOrder("k", r.object_id) in idx.membership.take_drops(spare)   # ... is dropped


def test_quiet_rounds_skip_the_scan_and_an_unanswered_copy_is_still_planned_again():
    idx = three_nodes()
    repairs = RepairPlanner(idx, timeout_ms=1000)
    r = start(idx, "k", replica_num=2)
    stored(idx, "k", r)
    scans = []
    scan = repairs.under_replicated
    repairs.under_replicated = lambda now_ms, entries: scans.append(now_ms) or scan(now_ms, entries)
    assert repairs.plan(T0) == 0 and repairs.plan(T0) == 0 and repairs.plan(T0) == 0
    assert len(scans) == 1                     # nothing changed after the first round
    holders = [t.node_id for t in r.targets]
    spare = ({"n0", "n1", "n2"} - set(holders)).pop()
    now = T0 + TTL_MS + 1
    for n in (holders[1], spare):
        heartbeat(idx.membership, n, now)
    idx.membership.expire(now)                 # membership changed: scanned again
    assert repairs.plan(now) == 1
    assert repairs.plan(now + 500) == 0        # in flight: still scanned, nothing ordered
    assert repairs.plan(now + 1001) == 1       # never answered: given up, ordered again
    assert idx.counters["repair_timeouts"] == 1


def test_quarantined_node_gets_no_new_puts():
    idx = three_nodes()
    for i in range(idx.membership.failures_to_quarantine):
        idx.membership.report_failure("n0", T0 + i)
    assert idx.membership.is_quarantined("n0", T0 + 10)
    for i in range(20):
        r = start(idx, f"q{i}", replica_num=2, now_ms=T0 + 10)
        assert "n0" not in [t.node_id for t in r.targets]
    later = T0 + 10 + idx.membership.quarantine_ms + 1
    assert not idx.membership.is_quarantined("n0", later)


def test_ids_after_a_rebuild_start_above_every_inventory_id():
    idx = three_nodes()
    idx.sync_node_inventory("n0", [InventoryItem("old", 41, 1, 1, TierKind.DRAM)], T0)
    assert start(idx, "new").object_id > 41


def test_a_new_term_starts_ids_above_its_floor():
    idx = three_nodes()
    idx.start_term(7 << 32)
    assert start(idx, "k").object_id >= 7 << 32


def test_a_rebuilt_index_repairs_to_the_replica_num_the_put_asked_for():
    # A put for 2 replicas that one node holds when a fresh master rebuilds its index
    # (the other replica was lost, repair had not run): the node's inventory says
    # 2 were asked for, so the rebuilt entry is repaired to 2, not content with 1.
    idx = three_nodes()
    idx.sync_node_inventory("n0", [InventoryItem("k", 5, 100, 7, TierKind.DRAM,
                                                 replica_num=2)], T0)
    assert idx.entries["k"].replica_num == 2
    assert RepairPlanner(idx).plan(T0) == 1
    # An older node that does not say (0) still counts what it finds.
    idx.sync_node_inventory("n1", [InventoryItem("j", 6, 100, 7, TierKind.DRAM)], T0)
    idx.sync_node_inventory("n2", [InventoryItem("j", 6, 100, 7, TierKind.DRAM)], T0)
    assert idx.entries["j"].replica_num == 2


def test_an_inventory_asking_for_more_replicas_than_a_put_may_is_refused():
    import pytest
    from kvstore.errors import InvalidArgument
    from kvstore.master.limits import check_inventory
    from kvstore.rpc import MAX_REPLICAS
    check_inventory([InventoryItem("k", 5, 1, 1, TierKind.DRAM, replica_num=MAX_REPLICAS)])
    with pytest.raises(InvalidArgument, match="replica_num"):
        check_inventory([InventoryItem("k", 5, 1, 1, TierKind.DRAM,
                                       replica_num=MAX_REPLICAS + 1)])
