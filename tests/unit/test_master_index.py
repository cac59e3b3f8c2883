"""The master's ObjectIndex and Membership, driven without a network.

Requests are kvstore.types records and index dataclasses (no protobuf);
time is passed in as ``now_ms``. A put becomes visible when a target node
reports it STORED (the helper ``stored``), as the nodes do.
"""

from __future__ import annotations

import pytest

from kvstore.errors import (InvalidArgument, KeyConflict, KVStoreError, NotFound, PutInProgress,
                            TooLarge, Unavailable)
from kvstore.master.index import ObjectIndex, PutItem, PutPlan
from kvstore.master.membership import Membership, NodeHeartbeat, NodeRegistration
from kvstore.shardmap import ShardMap
from kvstore.types import (DropOrder, EventKind, NodeAddress, NodeEvent, ObjectMeta,
                           RemoveReason, ReplicaState, TierKind)

MiB = 1 << 20
T0 = 1_000_000           # an arbitrary start time, in ms
TTL_MS = 3000
PUT_TIMEOUT_MS = 30_000


def register(membership: Membership, node_id: str, capacity_bytes: int = 64 * MiB,
             now_ms: int = T0) -> None:
    membership.register(NodeRegistration(NodeAddress(node_id, "127.0.0.1", 1000),
                                         capacity_bytes, capacity_bytes), now_ms)


def heartbeat(membership: Membership, node_id: str, now_ms: int, used_bytes: int = 0,
              num_objects: int = 0) -> list[DropOrder]:
    assert membership.heartbeat(NodeHeartbeat(node_id, used_bytes, num_objects), now_ms)
    return membership.take_drops(node_id)


@pytest.fixture
def index():
    membership = Membership(node_ttl_ms=TTL_MS)
    register(membership, "n0")
    register(membership, "n1")
    idx = ObjectIndex(membership, ShardMap.single("127.0.0.1:1"), put_timeout_ms=PUT_TIMEOUT_MS)
    yield idx
    # stat() keeps its counts as entries change; after every test they equal a recount.
    complete = [e for e in idx.entries.values() if e.state is ReplicaState.COMPLETE]
    st = idx.stat()
    assert (st.num_objects, st.total_bytes, st.pending_puts) == (
        len(complete), sum(e.size_bytes for e in complete), len(idx.entries) - len(complete))


def start(index: ObjectIndex, key: str, size_bytes: int = 100, checksum: int = 7,
          now_ms: int = T0, replica_num: int = 1) -> PutPlan | KVStoreError:
    (result,) = index.put_start([PutItem(key, size_bytes, checksum)], now_ms, replica_num)
    return result


def stored(index: ObjectIndex, key: str, plan: PutPlan, nodes: list[str] | None = None,
           size_bytes: int | None = None, checksum: int | None = None) -> list[KVStoreError | None]:
    """The target nodes (default: all) report the put STORED; the master's answer per node.

    Size and checksum default to what the put announced (what the node verified).
    """
    entry = index.entries.get(key)
    size_bytes = size_bytes if size_bytes is not None else (entry.size_bytes if entry else 0)
    checksum = checksum if checksum is not None else (entry.checksum if entry else 0)
    nodes = [t.node_id for t in plan.targets] if nodes is None else nodes
    return [index.node_event(n, NodeEvent(EventKind.STORED, key, plan.object_id, TierKind.DRAM,
                                          size_bytes, checksum)) for n in nodes]


def put(index: ObjectIndex, key: str, **kwargs) -> PutPlan:
    result = start(index, key, **kwargs)
    assert isinstance(result, PutPlan) and not result.already_present
    assert stored(index, key, result) == [None] * len(result.targets)
    return result


def lookup_error(index: ObjectIndex, key: str, now_ms: int = T0) -> type | None:
    """The error class a lookup of ``key`` answers, None when it is found."""
    (r,) = index.lookup([key], now_ms)
    return type(r) if isinstance(r, KVStoreError) else None


def all_drops(index: ObjectIndex) -> dict[str, list[tuple[str, int]]]:
    return {n: [(d.key, d.object_id) for d in index.membership.take_drops(n)]
            for n in index.membership.nodes}


# ---- put protocol ----

def test_a_stored_report_makes_the_object_visible(index):
    r = start(index, "k", size_bytes=100, checksum=7)
    assert isinstance(r, PutPlan) and r.object_id > 0 and len(r.targets) == 1
    # PENDING: invisible everywhere.
    assert index.exists(["k"]) == [False]
    assert lookup_error(index, "k") is NotFound
    assert index.list("", "", 0) == ([], "")
    assert index.stat().pending_puts == 1
    assert stored(index, "k", r) == [None]
    assert index.exists(["k"]) == [True]
    (meta,) = index.lookup(["k"], T0 + 5)
    assert isinstance(meta, ObjectMeta)
    assert (meta.size_bytes, meta.checksum, meta.object_id) == (100, 7, r.object_id)
    assert [rep.node.node_id for rep in meta.replicas] == [r.targets[0].node_id]
    assert meta.replicas[0].tier is TierKind.DRAM
    st = index.stat()
    assert (st.num_objects, st.total_bytes, st.pending_puts) == (1, 100, 0)
    assert all(n.reserved_bytes == 0 for n in index.membership.nodes.values())


def test_each_target_that_reports_becomes_a_replica(index):
    r = start(index, "k", replica_num=2)
    assert {t.node_id for t in r.targets} == {"n0", "n1"}
    assert stored(index, "k", r, nodes=["n1"]) == [None]       # visible at the first report
    (meta,) = index.lookup(["k"], T0)
    assert [rep.node.node_id for rep in meta.replicas] == ["n1"]
    assert stored(index, "k", r, nodes=["n0"]) == [None]
    (meta,) = index.lookup(["k"], T0)
    assert sorted(rep.node.node_id for rep in meta.replicas) == ["n0", "n1"]
    assert stored(index, "k", r, nodes=["n0"]) == [None]       # delivered twice: no change
    assert index.counters["puts"] == 1 and all_drops(index) == {"n0": [], "n1": []}


def test_a_writer_gives_back_the_targets_that_failed(index):
    r = start(index, "k", replica_num=2)
    assert stored(index, "k", r, nodes=["n1"]) == [None]
    assert index.put_revoke([("k", r.object_id)]) == [None]   # n0 never acknowledged
    (meta,) = index.lookup(["k"], T0)
    assert [rep.node.node_id for rep in meta.replicas] == ["n1"]
    assert all_drops(index) == {"n0": [("k", r.object_id)], "n1": []}
    assert all(n.reserved_bytes == 0 for n in index.membership.nodes.values())
    # n0's report arriving after that is refused: it drops the object.
    (err,) = stored(index, "k", r, nodes=["n0"])
    assert isinstance(err, NotFound)


def test_a_report_from_a_node_that_is_not_a_target_is_refused(index):
    r = start(index, "k")
    other = "n1" if r.targets[0].node_id == "n0" else "n0"
    (err,) = stored(index, "k", r, nodes=[other])
    assert isinstance(err, NotFound) and index.exists(["k"]) == [False]
    assert ("k", r.object_id) in all_drops(index)[other]


def test_a_report_with_other_bytes_than_announced_is_refused(index):
    r = start(index, "k", size_bytes=100, checksum=7)
    for size, checksum in ((100, 8), (99, 7)):
        (err,) = stored(index, "k", r, size_bytes=size, checksum=checksum)
        assert isinstance(err, KeyConflict)
    assert index.exists(["k"]) == [False]
    assert stored(index, "k", r) == [None]


def test_put_revoke_leaves_nothing_and_orders_drops(index):
    r = start(index, "k", replica_num=2)
    assert index.put_revoke([("k", r.object_id)]) == [None]
    assert "k" not in index.entries
    assert index.exists(["k"]) == [False]
    assert all_drops(index) == {"n0": [("k", r.object_id)], "n1": [("k", r.object_id)]}
    assert all(n.reserved_bytes == 0 for n in index.membership.nodes.values())
    # A report after the revoke: the put is gone, the node drops its copy.
    assert all(isinstance(e, NotFound) for e in stored(index, "k", r))
    # The key is free again.
    put(index, "k")


def test_revoke_or_report_with_a_wrong_object_id_changes_nothing(index):
    r = start(index, "k")
    (err,) = index.put_revoke([("k", r.object_id + 1)])
    assert isinstance(err, NotFound)
    bogus = PutPlan(r.object_id + 1, r.targets)
    assert all(isinstance(e, NotFound) for e in stored(index, "k", bogus))
    assert stored(index, "k", r) == [None]


def test_equal_bytes_already_present_different_bytes_conflict(index):
    first = put(index, "k", size_bytes=100, checksum=7)
    again = start(index, "k", size_bytes=100, checksum=7)
    assert isinstance(again, PutPlan) and again.already_present
    assert again.object_id == first.object_id and not again.targets
    for size, checksum in ((100, 8), (101, 7)):
        assert isinstance(start(index, "k", size_bytes=size, checksum=checksum), KeyConflict)
    # Never overwritten.
    (meta,) = index.lookup(["k"], T0)
    assert (meta.size_bytes, meta.checksum, meta.object_id) == (100, 7, first.object_id)
    assert index.stat().pending_puts == 0


def test_checksum_at_end_takes_the_checksum_of_the_stored_report(index):
    (r,) = index.put_start([PutItem("k", 100, 0, checksum_at_end=True)], T0)
    assert stored(index, "k", r, checksum=0x5EED) == [None]
    (meta,) = index.lookup(["k"], T0)
    assert meta.checksum == 0x5EED
    # Equal size, bytes not known yet: already present (compared by the writer later).
    (again,) = index.put_start([PutItem("k", 100, 0, checksum_at_end=True)], T0)
    assert again.already_present


def test_put_while_pending_is_put_in_progress(index):
    r = start(index, "k")
    for checksum in (7, 8):
        assert isinstance(start(index, "k", checksum=checksum), PutInProgress)
    assert stored(index, "k", r) == [None]
    assert start(index, "k").already_present


def test_too_large_leaves_nothing_behind(index):
    assert isinstance(start(index, "big", size_bytes=64 * MiB + 1), TooLarge)
    assert "big" not in index.entries
    assert index.exists(["big"]) == [False]
    assert lookup_error(index, "big") is NotFound
    assert index.list("", "", 0) == ([], "")
    assert index.stat().pending_puts == 0
    assert all(n.reserved_bytes == 0 for n in index.membership.nodes.values())
    # Exactly the capacity fits.
    assert isinstance(start(index, "fits", size_bytes=64 * MiB), PutPlan)


def test_no_live_node_is_unavailable(index):
    index.membership.expire(T0 + TTL_MS + 1)
    assert isinstance(start(index, "k", now_ms=T0 + TTL_MS + 1), Unavailable)
    assert "k" not in index.entries


def test_bad_keys_get_invalid_argument_per_item(index):
    results = index.put_start([PutItem("", 1), PutItem("ok", 1), PutItem("a\nb", 1)], T0)
    assert [type(r) for r in results] == [InvalidArgument, PutPlan, InvalidArgument]
    assert list(index.entries) == ["ok"]
    assert [type(r) for r in index.lookup(["", "ok", "missing"], T0)] == [
        InvalidArgument, NotFound, NotFound]


def test_placement_prefers_free_space_and_reserves_it(index):
    heartbeat(index.membership, "n0", T0, used_bytes=10 * MiB)
    heartbeat(index.membership, "n1", T0, used_bytes=0)
    a = start(index, "a", size_bytes=20 * MiB)
    assert a.targets[0].node_id == "n1"
    # n1's free space now counts the pending 20 MiB: the next put goes to n0.
    b = start(index, "b", size_bytes=1 * MiB)
    assert b.targets[0].node_id == "n0"


def test_stored_bytes_count_against_free_space_before_the_next_heartbeat(index):
    # Two 64 MiB nodes, 40 MiB objects: without counting stored bytes until
    # the nodes report them, both puts would go to n0 and the second would not fit.
    first = put(index, "a", size_bytes=40 * MiB)
    second = start(index, "b", size_bytes=40 * MiB)
    assert second.targets[0].node_id != first.targets[0].node_id


# ---- time ----

def test_timed_out_put_is_revoked_with_drop_orders(index):
    r = start(index, "k", replica_num=2, now_ms=T0)
    assert index.expire_puts(T0 + PUT_TIMEOUT_MS) == 0          # not yet
    assert index.expire_puts(T0 + PUT_TIMEOUT_MS + 1) == 1
    assert "k" not in index.entries
    assert all_drops(index) == {"n0": [("k", r.object_id)], "n1": [("k", r.object_id)]}
    assert index.stat().counters["puts_expired"] == 1
    assert all(isinstance(e, NotFound) for e in stored(index, "k", r))


def test_a_target_that_never_reports_is_released_at_the_deadline(index):
    r = start(index, "k", replica_num=2, now_ms=T0)
    assert stored(index, "k", r, nodes=["n0"]) == [None]
    assert index.expire_puts(T0 + PUT_TIMEOUT_MS + 1) == 0      # stored: not revoked ...
    assert all_drops(index) == {"n0": [], "n1": [("k", r.object_id)]}   # ... n1 released
    assert index.exists(["k"]) == [True]
    assert all(n.reserved_bytes == 0 for n in index.membership.nodes.values())


def test_put_start_revokes_a_timed_out_pending_put_of_the_same_key(index):
    old = start(index, "k", checksum=1, now_ms=T0)
    new = start(index, "k", checksum=2, now_ms=T0 + PUT_TIMEOUT_MS + 1)
    assert isinstance(new, PutPlan) and new.object_id != old.object_id
    drops = all_drops(index)
    assert ("k", old.object_id) in drops[old.targets[0].node_id]
    assert all(isinstance(e, NotFound) for e in stored(index, "k", old))   # the late writer loses
    assert stored(index, "k", new) == [None]


def test_drop_orders_travel_with_heartbeats(index):
    r = put(index, "k")
    node = r.targets[0].node_id
    index.remove(["k"])
    assert [(d.key, d.object_id) for d in heartbeat(index.membership, node, T0 + 1)] == [
        ("k", r.object_id)]
    assert heartbeat(index.membership, node, T0 + 2) == []   # handed out once


# ---- membership ----

def test_dead_node_hides_its_replicas(index):
    r = put(index, "k")
    node = r.targets[0].node_id
    other = "n1" if node == "n0" else "n0"
    later = T0 + TTL_MS + 1
    heartbeat(index.membership, other, later)
    assert index.membership.expire(later) == [node]
    assert not index.membership.is_alive(node)
    assert index.exists(["k"]) == [False]
    assert lookup_error(index, "k", later) is NotFound
    assert index.list("", "", 0) == ([], "")
    assert index.stat().num_objects == 1   # still indexed: the node may come back
    # It comes back: visible again.
    heartbeat(index.membership, node, later + 1)
    assert index.exists(["k"]) == [True]


def test_no_live_node_is_final_only_a_node_ttl_after_the_last_node_was_lost(index):
    # A node whose heartbeats were late (a starved process) may be back any moment:
    # within a ttl of the last loss the shard's answer is one the SDKs retry.
    m = index.membership
    dead_at = T0 + TTL_MS + 1
    assert sorted(m.expire(dead_at)) == ["n0", "n1"]
    for now in (dead_at, dead_at + TTL_MS - 1):
        with pytest.raises(Unavailable, match="missed its heartbeats just now"):
            index.grant(1, 8, now)
        err = start(index, "k", now_ms=now)
        assert isinstance(err, Unavailable) and "missed its heartbeats" in err.message
    with pytest.raises(Unavailable, match="^no live store node"):
        index.grant(1, 8, dead_at + TTL_MS)
    err = start(index, "k", now_ms=dead_at + TTL_MS)
    assert isinstance(err, Unavailable) and err.message.startswith("no live store node")
    heartbeat(m, "n0", dead_at + TTL_MS + 5)          # back: places again
    assert isinstance(start(index, "k", now_ms=dead_at + TTL_MS + 6), PutPlan)


def test_a_report_keeps_a_node_alive_as_a_heartbeat_does(index):
    m = index.membership
    m.touch("n0", T0 + TTL_MS - 10)            # its events arrived; its beat is late
    assert m.expire(T0 + TTL_MS + 1) == ["n1"]
    m.touch("n1", T0 + TTL_MS + 2)             # a dead node is revived only by a heartbeat
    assert not m.is_alive("n1")
    m.touch("unknown", T0)                     # no error for a node the shard forgot


def test_replica_on_a_dead_node_is_hidden_but_others_serve(index):
    r = put(index, "k", replica_num=2)
    assert len(r.targets) == 2
    later = T0 + TTL_MS + 1
    heartbeat(index.membership, "n1", later)
    index.membership.expire(later)
    (meta,) = index.lookup(["k"], later)
    assert [rep.node.node_id for rep in meta.replicas] == ["n1"]


def test_key_lost_with_its_only_node_can_be_put_again(index):
    r = put(index, "k", checksum=1)
    node = r.targets[0].node_id
    other = "n1" if node == "n0" else "n0"
    later = T0 + TTL_MS + 1
    heartbeat(index.membership, other, later)
    index.membership.expire(later)
    again = start(index, "k", checksum=2, now_ms=later)
    assert isinstance(again, PutPlan) and again.targets[0].node_id == other


def test_node_restarted_empty_forgets_its_objects(index):
    r = put(index, "k")
    node = r.targets[0].node_id
    assert index.sync_node_inventory(node, [], T0) == (1, 0)
    assert "k" not in index.entries and index.exists(["k"]) == [False]


def test_unknown_node_heartbeat_is_not_known():
    m = Membership()
    assert m.heartbeat(NodeHeartbeat("ghost", 0, 0), T0) is None
    assert not m.is_known("ghost")


# ---- read side ----

def test_remove_and_evict(index):
    r = put(index, "a")
    put(index, "b")
    results = index.remove(["a", "missing", ""], RemoveReason.REMOVE)
    assert [type(x) for x in results] == [ObjectMeta, NotFound, InvalidArgument]
    assert results[0].object_id == r.object_id and results[0].replicas  # where to drop it
    assert index.exists(["a", "b"]) == [False, True]
    assert ("a", r.object_id) in all_drops(index)[r.targets[0].node_id]
    assert [m.key for m in index.remove(["b"], RemoveReason.EVICT)] == ["b"]
    counters = index.stat().counters
    assert (counters["removes"], counters["evicts"]) == (1, 1)
    # A removed key can be put again with other bytes.
    put(index, "a", checksum=99)


def test_remove_of_a_pending_put_is_not_found(index):
    start(index, "k")
    assert isinstance(index.remove(["k"])[0], NotFound)
    assert "k" in index.entries


def test_batch_lookup_answers_in_input_order(index):
    put(index, "a", size_bytes=1)
    put(index, "c", size_bytes=3)
    res = index.lookup(["c", "b", "a", "c"], T0)
    assert [type(r) for r in res] == [ObjectMeta, NotFound, ObjectMeta, ObjectMeta]
    assert [r.size_bytes for r in res if isinstance(r, ObjectMeta)] == [3, 1, 3]
    assert index.exists(["c", "b", "a"]) == [True, False, True]


def test_list_pages_with_prefix(index):
    keys = [f"p/{i:03d}" for i in range(25)]
    for k in keys + ["o/x", "q/y", "p"]:
        put(index, k)
    start(index, "p/pending")   # never listed
    seen, cursor, pages = [], "", 0
    while True:
        page, cursor = index.list("p/", cursor, 10)
        assert len(page) <= 10
        seen += [o.key for o in page]
        pages += 1
        if not cursor:
            break
    assert seen == keys and pages == 3
    assert [o.key for o in index.list("", "", 0)[0]] == sorted(keys + ["o/x", "q/y", "p"])
    assert [o.key for o in index.list("p", "", 0)[0]] == ["p"] + keys
    assert index.list("zzz", "", 0) == ([], "")
    # A page that ends exactly at the last matching key has no cursor.
    page, cursor = index.list("p/", keys[14], 10)
    assert [o.key for o in page] == keys[15:] and cursor == ""


def test_list_pages_through_keys_put_and_removed_meanwhile(index):
    keys = [f"p/{i:03d}" for i in range(0, 60, 2)]
    for k in keys:
        put(index, k)
    seen, cursor = [], ""
    while True:
        page, cursor = index.list("p/", cursor, 7)
        seen += [o.key for o in page]
        # Between pages: a key behind the cursor, one ahead of it, and a removal ahead.
        n = len(seen)
        put(index, f"p/{2 * n - 1:03d}x")
        put(index, f"p/{2 * n + 9:03d}x")
        ahead = [k for k in keys if k > seen[-1]] if seen else []
        if ahead:
            index.remove([ahead[-1]])
            keys.remove(ahead[-1])
        if not cursor:
            break
    assert seen == sorted(set(seen))                       # in order, each once
    assert set(keys) <= set(seen)                          # every key kept is listed
    assert not any(k not in index.entries for k in seen)   # nothing removed before its page


def test_list_skips_dead_replicas_and_removed_keys(index):
    put(index, "p/a")
    put(index, "p/b")
    index.remove(["p/a"])
    assert [o.key for o in index.list("p/", "", 0)[0]] == ["p/b"]


def test_exists_never_changes_access_stats_lookup_does(index):
    put(index, "k")
    entry = index.entries["k"]
    assert (entry.access_count, entry.last_access_ms) == (0, 0)
    for _ in range(3):
        assert index.exists(["k"]) == [True]
    index.list("", "", 0)
    assert (entry.access_count, entry.last_access_ms) == (0, 0)
    index.lookup(["k"], T0 + 42)
    assert (entry.access_count, entry.last_access_ms) == (1, T0 + 42)


def test_stat_reports_nodes_and_counters(index):
    heartbeat(index.membership, "n0", T0, used_bytes=5, num_objects=1)
    put(index, "k", size_bytes=5)
    index.lookup(["k", "nope"], T0)
    st = index.stat()
    by_id = {n.address.node_id: n for n in st.nodes}
    assert set(by_id) == {"n0", "n1"}
    assert by_id["n0"].alive and by_id["n0"].capacity_bytes == 64 * MiB
    assert (st.counters["puts"], st.counters["lookup_hits"], st.counters["lookup_misses"]) == (1, 1, 1)


def test_an_eviction_right_after_storing_leaves_nothing_visible(index):
    r = start(index, "k")
    node = r.targets[0].node_id
    # The node's events, in its order: stored, then evicted at once.
    assert stored(index, "k", r) == [None]                  # the put itself succeeded
    index.node_event(node, NodeEvent(EventKind.EVICTED, "k", r.object_id))
    assert lookup_error(index, "k") is NotFound
    assert index.exists(["k"]) == [False] and "k" not in index.entries
    assert index.counters["replicas_evicted"] == 1
