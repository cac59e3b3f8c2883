"""Issue 5 on the master's pure parts: per-key Exists statuses on a sharded
map, repair planning and results, quarantine, and the id floor of a new term.
No network: requests are protobuf messages, time is ``now_ms``."""

from __future__ import annotations

from kvstore._proto import kvstore_pb2 as pb
from kvstore.keys import key_slot
from kvstore.master.index import ObjectIndex
from kvstore.master.membership import Membership
from kvstore.shardmap import ShardMap
from test_master_index import T0, TTL_MS, end, heartbeat, register, start


def three_nodes() -> ObjectIndex:
    m = Membership(node_ttl_ms=TTL_MS)
    for n in ("n0", "n1", "n2"):
        register(m, n)
    return ObjectIndex(m, ShardMap.single("127.0.0.1:1"))


def test_exists_answers_wrong_shard_never_false_for_a_key_it_does_not_own():
    smap = ShardMap.even([("a:1",), ("b:2",)])
    idx = ObjectIndex(Membership(), smap, shard_id=0)
    mine = next(f"k{i}" for i in range(100) if smap.shard_for_slot(key_slot(f"k{i}")).shard_id == 0)
    other = next(f"k{i}" for i in range(100) if smap.shard_for_slot(key_slot(f"k{i}")).shard_id == 1)
    exists, statuses = idx.exists_checked([mine, other])
    assert exists == [False, False]
    assert statuses[0].code == pb.OK
    assert statuses[1].code == pb.WRONG_SHARD and statuses[1].redirect == "b:2"


def test_dead_replica_is_repaired_once_and_counted():
    idx = three_nodes()
    r = start(idx, "k", replica_num=2)
    holders = [t.node_id for t in r.targets]
    assert end(idx, "k", r).code == pb.OK
    spare = ({"n0", "n1", "n2"} - set(holders)).pop()
    now = T0 + TTL_MS + 1
    for n in (holders[1], spare):
        heartbeat(idx.membership, n, now)
    idx.membership.expire(now)                 # holders[0] is dead
    assert idx.plan_repairs(now) == 1
    assert idx.plan_repairs(now) == 0          # one copy in flight per object
    (order,) = idx.membership.take_copies(holders[1])
    assert order.key == "k" and order.target.node_id == spare
    idx.copy_done(pb.CopyResult(key="k", object_id=r.object_id, target_node_id=spare,
                                status=pb.Status(code=pb.OK)))
    meta = idx.lookup(["k"], now).results[0].meta
    assert sorted(x.node.node_id for x in meta.replicas) == sorted([holders[1], spare])
    assert idx.counters["repairs"] == 1
    assert idx.plan_repairs(now) == 0


def test_failed_copy_is_retried_and_a_copy_of_a_removed_key_is_dropped():
    idx = three_nodes()
    r = start(idx, "k", replica_num=2)
    end(idx, "k", r)
    holders = [t.node_id for t in r.targets]
    spare = ({"n0", "n1", "n2"} - set(holders)).pop()
    now = T0 + TTL_MS + 1
    for n in (holders[1], spare):
        heartbeat(idx.membership, n, now)
    idx.membership.expire(now)
    idx.plan_repairs(now)
    idx.copy_done(pb.CopyResult(key="k", object_id=r.object_id, target_node_id=spare,
                                status=pb.Status(code=pb.NO_SPACE)))
    assert idx.counters["repair_failures"] == 1
    assert idx.plan_repairs(now) == 1
    idx.remove(["k"], "remove")
    idx.copy_done(pb.CopyResult(key="k", object_id=r.object_id, target_node_id=spare,
                                status=pb.Status(code=pb.OK)))
    assert pb.DropOrder(key="k", object_id=r.object_id) in idx.membership.take_drops(spare)


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
    idx.sync_node_inventory("n0", [pb.InventoryItem(key="old", object_id=41, size_bytes=1,
                                                    checksum=1, tier=pb.DRAM)], T0)
    assert start(idx, "new").object_id > 41
