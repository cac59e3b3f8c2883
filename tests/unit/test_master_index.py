"""The master's ObjectIndex and Membership, driven without a network.

Requests are built as protobuf messages; time is passed in as ``now_ms``.
"""

from __future__ import annotations

import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.master.index import ObjectIndex
from kvstore.master.membership import Membership
from kvstore.shardmap import ShardMap

MiB = 1 << 20
T0 = 1_000_000           # an arbitrary start time, in ms
TTL_MS = 3000
PUT_TIMEOUT_MS = 30_000


def register(membership: Membership, node_id: str, capacity_bytes: int = 64 * MiB,
             now_ms: int = T0) -> None:
    membership.register(pb.RegisterNodeRequest(
        address=pb.NodeAddress(node_id=node_id, host="127.0.0.1", data_port=1000),
        tier=pb.DRAM, capacity_bytes=capacity_bytes, max_object_bytes=capacity_bytes), now_ms)


def heartbeat(membership: Membership, node_id: str, now_ms: int, used_bytes: int = 0,
              num_objects: int = 0) -> list[pb.DropOrder]:
    assert membership.heartbeat(pb.HeartbeatRequest(node_id=node_id, used_bytes=used_bytes,
                                                    num_objects=num_objects), now_ms)
    return membership.take_drops(node_id)


@pytest.fixture
def index() -> ObjectIndex:
    membership = Membership(node_ttl_ms=TTL_MS)
    register(membership, "n0")
    register(membership, "n1")
    return ObjectIndex(membership, ShardMap.single("127.0.0.1:1"), put_timeout_ms=PUT_TIMEOUT_MS)


def start(index: ObjectIndex, key: str, size_bytes: int = 100, checksum: int = 7,
          now_ms: int = T0, replica_num: int = 1) -> pb.PutStartResult:
    resp = index.put_start(pb.PutStartRequest(
        items=[pb.PutStartItem(key=key, size_bytes=size_bytes, checksum=checksum)],
        config=pb.PutConfig(replica_num=replica_num)), now_ms)
    (result,) = resp.results
    return result


def end(index: ObjectIndex, key: str, result: pb.PutStartResult, written: list[str] | None = None,
        now_ms: int = T0) -> pb.Status:
    if written is None:
        written = [t.node_id for t in result.targets]
    (status,) = index.put_end(pb.PutEndRequest(items=[pb.PutEndItem(
        key=key, object_id=result.object_id, written_node_ids=written)]), now_ms).statuses
    return status


def put(index: ObjectIndex, key: str, **kwargs) -> pb.PutStartResult:
    result = start(index, key, **kwargs)
    assert result.status.code == pb.OK and not result.already_present
    assert end(index, key, result, now_ms=kwargs.get("now_ms", T0)).code == pb.OK
    return result


def lookup_code(index: ObjectIndex, key: str, now_ms: int = T0) -> int:
    return index.lookup([key], now_ms).results[0].status.code


def all_drops(index: ObjectIndex) -> dict[str, list[tuple[str, int]]]:
    return {n: [(d.key, d.object_id) for d in index.membership.take_drops(n)]
            for n in index.membership.nodes}


# ---- put protocol ----

def test_put_start_end_makes_the_object_visible(index):
    r = start(index, "k", size_bytes=100, checksum=7)
    assert r.status.code == pb.OK and r.object_id > 0 and len(r.targets) == 1
    # PENDING: invisible everywhere.
    assert index.exists(["k"]) == [False]
    assert lookup_code(index, "k") == pb.NOT_FOUND
    assert index.list("", "", 0).objects == []
    assert index.stat().pending_puts == 1
    assert end(index, "k", r).code == pb.OK
    assert index.exists(["k"]) == [True]
    res = index.lookup(["k"], T0 + 5).results[0]
    assert res.status.code == pb.OK
    assert (res.meta.size_bytes, res.meta.checksum, res.meta.object_id) == (100, 7, r.object_id)
    assert [rep.node.node_id for rep in res.meta.replicas] == [r.targets[0].node_id]
    st = index.stat()
    assert (st.num_objects, st.total_bytes, st.pending_puts) == (1, 100, 0)


def test_put_end_with_fewer_written_nodes_drops_the_rest(index):
    r = start(index, "k", replica_num=2)
    assert {t.node_id for t in r.targets} == {"n0", "n1"}
    assert end(index, "k", r, written=["n1"]).code == pb.OK
    meta = index.lookup(["k"], T0).results[0].meta
    assert [rep.node.node_id for rep in meta.replicas] == ["n1"]
    assert all_drops(index) == {"n0": [("k", r.object_id)], "n1": []}


def test_put_end_without_any_written_node_is_refused(index):
    r = start(index, "k")
    assert end(index, "k", r, written=[]).code == pb.INVALID_ARGUMENT
    assert end(index, "k", r, written=["not-a-target"]).code == pb.INVALID_ARGUMENT
    assert index.exists(["k"]) == [False]


def test_put_revoke_leaves_nothing_and_orders_drops(index):
    r = start(index, "k", replica_num=2)
    (st,) = index.put_revoke(pb.PutRevokeRequest(items=[pb.PutRevokeItem(
        key="k", object_id=r.object_id)])).statuses
    assert st.code == pb.OK
    assert "k" not in index.entries
    assert index.exists(["k"]) == [False]
    assert all_drops(index) == {"n0": [("k", r.object_id)], "n1": [("k", r.object_id)]}
    assert all(n.reserved_bytes == 0 for n in index.membership.nodes.values())
    # PutEnd after the revoke: the put is gone.
    assert end(index, "k", r).code == pb.NOT_FOUND
    # The key is free again.
    put(index, "k")


def test_revoke_or_end_with_a_wrong_object_id_changes_nothing(index):
    r = start(index, "k")
    (st,) = index.put_revoke(pb.PutRevokeRequest(items=[pb.PutRevokeItem(
        key="k", object_id=r.object_id + 1)])).statuses
    assert st.code == pb.NOT_FOUND
    bogus = pb.PutStartResult(object_id=r.object_id + 1, targets=r.targets)
    assert end(index, "k", bogus).code == pb.NOT_FOUND
    assert end(index, "k", r).code == pb.OK


def test_equal_bytes_already_present_different_bytes_conflict(index):
    first = put(index, "k", size_bytes=100, checksum=7)
    again = start(index, "k", size_bytes=100, checksum=7)
    assert again.status.code == pb.OK and again.already_present
    assert again.object_id == first.object_id and not again.targets
    for size, checksum in ((100, 8), (101, 7)):
        r = start(index, "k", size_bytes=size, checksum=checksum)
        assert r.status.code == pb.KEY_CONFLICT and not r.already_present
    # Never overwritten.
    meta = index.lookup(["k"], T0).results[0].meta
    assert (meta.size_bytes, meta.checksum, meta.object_id) == (100, 7, first.object_id)
    assert index.stat().pending_puts == 0


def test_put_while_pending_is_put_in_progress(index):
    r = start(index, "k")
    for checksum in (7, 8):
        assert start(index, "k", checksum=checksum).status.code == pb.PUT_IN_PROGRESS
    assert end(index, "k", r).code == pb.OK
    assert start(index, "k").already_present


def test_too_large_leaves_nothing_behind(index):
    r = start(index, "big", size_bytes=64 * MiB + 1)
    assert r.status.code == pb.TOO_LARGE and not r.targets
    assert "big" not in index.entries
    assert index.exists(["big"]) == [False]
    assert lookup_code(index, "big") == pb.NOT_FOUND
    assert index.list("", "", 0).objects == []
    assert index.stat().pending_puts == 0
    assert all(n.reserved_bytes == 0 for n in index.membership.nodes.values())
    # Exactly the capacity fits.
    assert start(index, "fits", size_bytes=64 * MiB).status.code == pb.OK


def test_no_live_node_is_unavailable(index):
    index.membership.expire(T0 + TTL_MS + 1)
    r = start(index, "k", now_ms=T0 + TTL_MS + 1)
    assert r.status.code == pb.UNAVAILABLE
    assert "k" not in index.entries


def test_bad_keys_get_invalid_argument_per_item(index):
    resp = index.put_start(pb.PutStartRequest(items=[
        pb.PutStartItem(key="", size_bytes=1), pb.PutStartItem(key="ok", size_bytes=1),
        pb.PutStartItem(key="a\nb", size_bytes=1)]), T0)
    assert [r.status.code for r in resp.results] == [pb.INVALID_ARGUMENT, pb.OK, pb.INVALID_ARGUMENT]
    assert list(index.entries) == ["ok"]
    codes = [r.status.code for r in index.lookup(["", "ok", "missing"], T0).results]
    assert codes == [pb.INVALID_ARGUMENT, pb.NOT_FOUND, pb.NOT_FOUND]


def test_placement_prefers_free_space_and_reserves_it(index):
    heartbeat(index.membership, "n0", T0, used_bytes=10 * MiB)
    heartbeat(index.membership, "n1", T0, used_bytes=0)
    a = start(index, "a", size_bytes=20 * MiB)
    assert a.targets[0].node_id == "n1"
    # n1's free space now counts the pending 20 MiB: the next put goes to n0.
    b = start(index, "b", size_bytes=1 * MiB)
    assert b.targets[0].node_id == "n0"


def test_committed_bytes_count_against_free_space_before_the_next_heartbeat(index):
    # Two 64 MiB nodes, 40 MiB objects: without counting committed bytes until
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
    assert end(index, "k", r, now_ms=T0 + PUT_TIMEOUT_MS + 2).code == pb.NOT_FOUND


def test_put_start_revokes_a_timed_out_pending_put_of_the_same_key(index):
    old = start(index, "k", checksum=1, now_ms=T0)
    new = start(index, "k", checksum=2, now_ms=T0 + PUT_TIMEOUT_MS + 1)
    assert new.status.code == pb.OK and new.object_id != old.object_id
    drops = all_drops(index)
    assert ("k", old.object_id) in drops[old.targets[0].node_id]
    assert end(index, "k", old).code == pb.NOT_FOUND        # the late writer loses
    assert end(index, "k", new).code == pb.OK


def test_drop_orders_travel_with_heartbeats(index):
    r = put(index, "k")
    node = r.targets[0].node_id
    index.remove(["k"], "remove")
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
    assert lookup_code(index, "k", later) == pb.NOT_FOUND
    assert index.list("", "", 0).objects == []
    assert index.stat().num_objects == 1   # still indexed: the node may come back
    # It comes back: visible again.
    heartbeat(index.membership, node, later + 1)
    assert index.exists(["k"]) == [True]


def test_replica_on_a_dead_node_is_hidden_but_others_serve(index):
    r = put(index, "k", replica_num=2)
    assert len(r.targets) == 2
    later = T0 + TTL_MS + 1
    heartbeat(index.membership, "n1", later)
    index.membership.expire(later)
    meta = index.lookup(["k"], later).results[0].meta
    assert [rep.node.node_id for rep in meta.replicas] == ["n1"]


def test_key_lost_with_its_only_node_can_be_put_again(index):
    r = put(index, "k", checksum=1)
    node = r.targets[0].node_id
    other = "n1" if node == "n0" else "n0"
    later = T0 + TTL_MS + 1
    heartbeat(index.membership, other, later)
    index.membership.expire(later)
    again = start(index, "k", checksum=2, now_ms=later)
    assert again.status.code == pb.OK and again.targets[0].node_id == other


def test_node_restarted_empty_forgets_its_objects(index):
    r = put(index, "k")
    node = r.targets[0].node_id
    assert index.forget_node_objects(node) == 1
    assert "k" not in index.entries and index.exists(["k"]) == [False]


def test_unknown_node_heartbeat_is_not_known():
    m = Membership()
    assert m.heartbeat(pb.HeartbeatRequest(node_id="ghost"), T0) is None


# ---- read side ----

def test_remove_and_evict(index):
    r = put(index, "a")
    put(index, "b")
    statuses = index.remove(["a", "missing", ""], "remove").statuses
    assert [s.code for s in statuses] == [pb.OK, pb.NOT_FOUND, pb.INVALID_ARGUMENT]
    assert index.exists(["a", "b"]) == [False, True]
    assert ("a", r.object_id) in all_drops(index)[r.targets[0].node_id]
    assert index.remove(["b"], "evict").statuses[0].code == pb.OK
    counters = index.stat().counters
    assert (counters["removes"], counters["evicts"]) == (1, 1)
    # A removed key can be put again with other bytes.
    put(index, "a", checksum=99)


def test_remove_of_a_pending_put_is_not_found(index):
    start(index, "k")
    assert index.remove(["k"], "remove").statuses[0].code == pb.NOT_FOUND
    assert "k" in index.entries


def test_batch_lookup_answers_in_input_order(index):
    put(index, "a", size_bytes=1)
    put(index, "c", size_bytes=3)
    res = index.lookup(["c", "b", "a", "c"], T0).results
    assert [r.status.code for r in res] == [pb.OK, pb.NOT_FOUND, pb.OK, pb.OK]
    assert [r.meta.size_bytes for r in res] == [3, 0, 1, 3]
    assert index.exists(["c", "b", "a"]) == [True, False, True]


def test_list_pages_with_prefix(index):
    keys = [f"p/{i:03d}" for i in range(25)]
    for k in keys + ["o/x", "q/y", "p"]:
        put(index, k)
    start(index, "p/pending")   # never listed
    seen, cursor, pages = [], "", 0
    while True:
        resp = index.list("p/", cursor, 10)
        assert len(resp.objects) <= 10
        seen += [o.key for o in resp.objects]
        pages += 1
        if not resp.next_cursor:
            break
        cursor = resp.next_cursor
    assert seen == keys and pages == 3
    assert [o.key for o in index.list("", "", 0).objects] == sorted(keys + ["o/x", "q/y", "p"])
    assert [o.key for o in index.list("p", "", 0).objects] == ["p"] + keys
    assert index.list("zzz", "", 0).objects == []
    # A page that ends exactly at the last matching key has no cursor.
    resp = index.list("p/", keys[14], 10)
    assert [o.key for o in resp.objects] == keys[15:] and resp.next_cursor == ""


def test_list_skips_dead_replicas_and_removed_keys(index):
    put(index, "p/a")
    put(index, "p/b")
    index.remove(["p/a"], "remove")
    assert [o.key for o in index.list("p/", "", 0).objects] == ["p/b"]


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


def test_eviction_event_before_put_end_leaves_nothing_visible(index):
    r = start(index, "k")
    node = r.targets[0].node_id
    index.node_removed(node, "k", r.object_id)     # the node evicted it at once
    assert end(index, "k", r).code == pb.OK        # the put itself succeeded
    assert lookup_code(index, "k") == pb.NOT_FOUND
    assert index.exists(["k"]) == [False]
    assert index.counters["evicted_before_visible"] == 1


def test_eviction_event_after_put_end_removes_the_replica(index):
    r = put(index, "k")
    index.node_removed(r.targets[0].node_id, "k", r.object_id)
    assert index.exists(["k"]) == [False]
    assert index.counters["replicas_evicted"] == 1
