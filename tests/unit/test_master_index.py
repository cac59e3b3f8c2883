"""The master's ObjectIndex and Membership, driven without a network.

Requests are kvstore.types records and index dataclasses (no protobuf);
time is passed in as ``now_ms``. A put is placed by a grant (the helper
``start``, as the SDK places it) and becomes visible when a node reports it
STORED (the helper ``stored``), as the nodes do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from kvstore.client.core import placement
from kvstore.errors import (AlreadyPresent, InvalidArgument, KeyConflict, KVStoreError, NodesLate,
                            NoLiveNode, NotFound, Unavailable)
from kvstore.master.index import ObjectIndex
from kvstore.master.membership import Membership, NodeHeartbeat, NodeRegistration
from kvstore.shardmap import ShardMap
from kvstore.types import (DropOrder, EventKind, NodeAddress, NodeEvent, ObjectId, ObjectMeta,
                           RemoveReason, TierKind)

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
    # stat() keeps its counts as entries change; after every test they equal a recount:
    # readable objects (a live replica) and the others apart.
    st = idx.stat()
    readable = [e for e in idx.entries.values() if idx._visible(e)]
    assert (st.num_objects, st.total_bytes) == (
        len(readable), sum(e.size_bytes for e in readable))
    assert st.num_objects + st.unavailable_objects == len(idx.entries)
    idx.table.check()


@dataclass(frozen=True)
class Plan:
    """A put as the SDK places it: an id of a fresh grant, the first nodes of its list."""

    object_id: ObjectId
    targets: tuple[NodeAddress, ...]
    size_bytes: int
    checksum: int
    now_ms: int


def start(index: ObjectIndex, key: str, size_bytes: int = 100, checksum: int = 7,
          now_ms: int = T0, replica_num: int = 1) -> Plan | KVStoreError:
    """A grant for one put of ``key``, its targets chosen as the SDK chooses them (the one
    placement policy: kvstore.client.core.placement.take over the granted nodes)."""
    try:
        grant, nodes = index.grant(replica_num, 1, now_ms, key)
        g = placement.Grant(grant.first_object_id, grant.first_object_id + grant.num_ids,
                            tuple(placement.GrantedNode(n.address, n.free_bytes,
                                                        n.max_object_bytes) for n in nodes),
                            time.monotonic(), 60.0)
        oid, targets = placement.take(g, key, size_bytes, replica_num, frozenset(), None)
    except KVStoreError as err:
        return err
    return Plan(oid, tuple(targets), size_bytes, checksum, now_ms)


def stored(index: ObjectIndex, key: str, plan: Plan, nodes: list[str] | None = None,
           size_bytes: int | None = None, checksum: int | None = None,
           now_ms: int | None = None) -> list[KVStoreError | None]:
    """The target nodes (default: all) report the put STORED; the master's answer per node.

    Size and checksum default to the value's (what the node verified).
    """
    size_bytes = plan.size_bytes if size_bytes is None else size_bytes
    checksum = plan.checksum if checksum is None else checksum
    nodes = [t.node_id for t in plan.targets] if nodes is None else nodes
    return [index.node_event(n, NodeEvent(EventKind.STORED, key, plan.object_id, TierKind.DRAM,
                                          size_bytes, checksum),
                             plan.now_ms if now_ms is None else now_ms) for n in nodes]


def put(index: ObjectIndex, key: str, **kwargs) -> Plan:
    result = start(index, key, **kwargs)
    assert isinstance(result, Plan)
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
    assert isinstance(r, Plan) and r.object_id > 0 and len(r.targets) == 1
    # Placed, not stored: nothing is held for it, nothing is visible.
    assert "k" not in index.entries and index.exists(["k"]) == [False]
    assert lookup_error(index, "k") is NotFound
    assert index.list("", "", 0) == ([], "")
    assert stored(index, "k", r) == [None]
    assert index.exists(["k"]) == [True]
    (meta,) = index.lookup(["k"], T0 + 5)
    assert isinstance(meta, ObjectMeta)
    assert (meta.size_bytes, meta.checksum, meta.object_id) == (100, 7, r.object_id)
    assert [rep.node.node_id for rep in meta.replicas] == [r.targets[0].node_id]
    assert meta.replicas[0].tier is TierKind.DRAM
    st = index.stat()
    assert (st.num_objects, st.total_bytes) == (1, 100)
    assert index.counters["puts"] == 1


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


def test_a_further_replica_is_taken_while_its_grant_lives(index):
    r = start(index, "k", replica_num=2)
    assert stored(index, "k", r, nodes=["n0"]) == [None]
    # n1 got the bytes only after the grant (and its grace) ran out: refused, dropped.
    late = T0 + index.grants.valid_ms + PUT_TIMEOUT_MS + 1
    (err,) = stored(index, "k", r, nodes=["n1"], now_ms=late)
    assert isinstance(err, NotFound)
    assert all_drops(index) == {"n0": [], "n1": [("k", r.object_id)]}
    (meta,) = index.lookup(["k"], late)
    assert [rep.node.node_id for rep in meta.replicas] == ["n0"]


def test_a_copy_with_other_bytes_than_the_first_is_refused(index):
    r = start(index, "k", size_bytes=100, checksum=7, replica_num=2)
    assert stored(index, "k", r, nodes=["n0"]) == [None]
    for size, checksum in ((100, 8), (99, 7)):
        (err,) = stored(index, "k", r, nodes=["n1"], size_bytes=size, checksum=checksum)
        assert isinstance(err, KeyConflict)
    (meta,) = index.lookup(["k"], T0)
    assert [rep.node.node_id for rep in meta.replicas] == ["n0"] and meta.checksum == 7


def test_a_report_with_an_id_no_grant_covers_changes_nothing(index):
    r = start(index, "k")
    bogus = Plan(ObjectId(r.object_id + 1), r.targets, 100, 7, T0)
    assert all(isinstance(e, NotFound) for e in stored(index, "k", bogus))
    assert "k" not in index.entries
    assert stored(index, "k", r) == [None]


def test_equal_bytes_already_present_different_bytes_conflict(index):
    first = put(index, "k", size_bytes=100, checksum=7)
    again = start(index, "k", size_bytes=100, checksum=7)
    (err,) = stored(index, "k", again)
    assert isinstance(err, AlreadyPresent)
    for size, checksum in ((100, 8), (101, 7)):
        (err,) = stored(index, "k", start(index, "k", size_bytes=size, checksum=checksum))
        assert isinstance(err, KeyConflict)
    # Never overwritten; the refused copies are dropped on their nodes.
    (meta,) = index.lookup(["k"], T0)
    assert (meta.size_bytes, meta.checksum, meta.object_id) == (100, 7, first.object_id)
    assert index.counters["puts_already_present"] == 1
    assert sum(len(d) for d in all_drops(index).values()) == 3


def test_a_writer_that_never_reports_holds_nothing_and_blocks_no_one(index):
    # A writer placed its value and died before its node reported it (a layer-wise
    # writer killed mid-put): no entry, nothing reserved, another writer goes ahead.
    dead = start(index, "k", checksum=1)
    assert "k" not in index.entries
    other = start(index, "k", checksum=2)
    assert other.object_id != dead.object_id
    assert stored(index, "k", other) == [None]
    assert index.lookup(["k"], T0)[0].checksum == 2
    assert all(n.reserved_bytes == 0 for n in index.membership.nodes.values())


def test_bad_keys_are_refused_at_the_grant_and_at_the_report(index):
    assert isinstance(start(index, "a\nb"), InvalidArgument)
    r = start(index, "ok")
    for key in ("", "a\nb"):
        (err,) = stored(index, key, r)
        assert isinstance(err, InvalidArgument)
    assert len(index.entries) == 0
    assert [type(r) for r in index.lookup(["", "ok", "missing"], T0)] == [
        InvalidArgument, NotFound, NotFound]


def test_no_live_node_is_unavailable(index):
    index.membership.expire(T0 + TTL_MS + 1)
    assert isinstance(start(index, "k", now_ms=T0 + TTL_MS + 1), Unavailable)
    assert "k" not in index.entries


def test_a_grant_lists_its_nodes_with_their_free_space_and_a_value_goes_where_it_fits(index):
    heartbeat(index.membership, "n0", T0, used_bytes=60 * MiB)
    heartbeat(index.membership, "n1", T0, used_bytes=0)
    _, nodes = index.grant(1, 1, T0)
    assert [(n.node_id, n.free_bytes) for n in nodes] == [("n0", 4 * MiB), ("n1", 64 * MiB)]
    assert {start(index, k, size_bytes=20 * MiB).targets[0].node_id for k in "abcdef"} == {"n1"}


def test_stored_bytes_count_against_free_space_before_the_next_heartbeat(index):
    # Two 64 MiB nodes, 40 MiB objects: without counting stored bytes until
    # the nodes report them, both puts would go to n0 and the second would not fit.
    first = put(index, "a", size_bytes=40 * MiB)
    second = start(index, "b", size_bytes=40 * MiB)
    assert second.targets[0].node_id != first.targets[0].node_id


# ---- time ----

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
    st = index.stat()          # still indexed (the node may come back), but not readable:
    assert (st.num_objects, st.unavailable_objects) == (0, 1)     # counted apart
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
        with pytest.raises(NodesLate):
            index.grant(1, 8, now)
        assert isinstance(start(index, "k", now_ms=now), NodesLate)
    with pytest.raises(NoLiveNode):
        index.grant(1, 8, dead_at + TTL_MS)
    assert isinstance(start(index, "k", now_ms=dead_at + TTL_MS), NoLiveNode)
    heartbeat(m, "n0", dead_at + TTL_MS + 5)          # back: places again
    assert isinstance(start(index, "k", now_ms=dead_at + TTL_MS + 6), Plan)


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
    assert isinstance(again, Plan) and again.targets[0].node_id == other
    assert stored(index, "k", again) == [None]
    assert index.lookup(["k"], later)[0].checksum == 2


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


def test_remove_of_a_put_not_yet_stored_is_not_found(index):
    r = start(index, "k")
    assert isinstance(index.remove(["k"])[0], NotFound)
    assert stored(index, "k", r) == [None]           # the put itself goes on


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
    start(index, "p/placed")    # never stored: never listed
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
    stats = lambda: (index.entries["k"].access_count,       # noqa: E731 (a fresh snapshot)
                     index.entries["k"].last_access_ms)
    assert stats() == (0, 0)
    for _ in range(3):
        assert index.exists(["k"]) == [True]
    index.list("", "", 0)
    assert stats() == (0, 0)
    index.lookup(["k"], T0 + 42)
    assert stats() == (1, T0 + 42)


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


# ---- the store-wide event log (kvstore.master.event_feed) ----

def test_the_event_log_hears_of_keys_stored_evicted_and_removed(index):
    from kvstore.master.event_feed import EventFeed, StoreEventKind as K

    feed = EventFeed(epoch=1, capacity=64)
    index.on_event = feed.record
    a = put(index, "a", replica_num=2)
    put(index, "b")
    c = put(index, "c")
    assert stored(index, "a", a) == [None, None]          # reported again: no new event
    holder = c.targets[0].node_id
    index.node_event(holder, NodeEvent(EventKind.EVICTED, "c", c.object_id), T0)
    first, second = (t.node_id for t in a.targets)
    index.node_event(first, NodeEvent(EventKind.EVICTED, "a", a.object_id), T0)  # one replica of 2
    index.remove(["b"], RemoveReason.REMOVE)
    index.remove(["a"], RemoveReason.EVICT)
    index.remove(["nope"], RemoveReason.REMOVE)           # NotFound: no event
    got = [(e.seq, e.kind, e.key) for e in feed.read(1).events]
    assert got == [(1, K.KEY_STORED, "a"), (2, K.KEY_STORED, "b"), (3, K.KEY_STORED, "c"),
                   (4, K.KEY_EVICTED, "c"), (5, K.KEY_REMOVED, "b"), (6, K.KEY_EVICTED, "a")]
    assert feed.read(4).events[0].node_id == holder and feed.read(1).events[0].size_bytes == 100
