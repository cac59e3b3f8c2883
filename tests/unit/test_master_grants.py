"""Placement grants (kvstore.master.grants) and the index's decision on a placed put's
STORED report, without a network: the first STORED applied decides; the rules hold
when two writers race through two nodes."""

from __future__ import annotations

import pytest

from kvstore.errors import AlreadyPresent, KeyConflict, NotFound, Unavailable
from kvstore.master.grants import MAX_GRANTS, Grants
from kvstore.master.index import ObjectIndex
from kvstore.master.membership import Membership, NodeRegistration
from kvstore.shardmap import ShardMap
from kvstore.types import EventKind, NodeAddress, NodeEvent, TierKind

T0 = 1_000_000
MiB = 1 << 20


@pytest.fixture
def index() -> ObjectIndex:
    m = Membership(node_ttl_ms=3000)
    for n in ("n0", "n1", "n2"):
        m.register(NodeRegistration(NodeAddress(n, "127.0.0.1", 1000), 64 * MiB, 64 * MiB), T0)
    return ObjectIndex(m, ShardMap.single("127.0.0.1:1"), put_timeout_ms=30_000)


def stored(index, node, key, oid, size=100, checksum=7, now_ms=T0):
    return index.node_event(node, NodeEvent(EventKind.STORED, key, oid, TierKind.DRAM, size,
                                            checksum), now_ms)


def test_a_grant_lists_healthy_nodes_and_fresh_ids(index):
    g1, nodes = index.grant(2, 100, T0)
    g2, _ = index.grant(2, 100, T0)
    assert [n.node_id for n in nodes] == ["n0", "n1", "n2"] and g1.replica_num == 2
    assert g2.first_object_id >= g1.first_object_id + 100
    assert not any(g1.covers(i) for i in range(g2.first_object_id, g2.first_object_id + 100))


def test_first_stored_makes_it_visible_and_more_replicas_join(index):
    g, _ = index.grant(2, 10, T0)
    oid = g.first_object_id
    assert stored(index, "n0", "k", oid) is None
    (meta,) = index.lookup(["k"], T0)
    assert meta.object_id == oid and [r.node.node_id for r in meta.replicas] == ["n0"]
    assert stored(index, "n1", "k", oid) is None
    assert stored(index, "n1", "k", oid) is None          # at-least-once delivery
    assert {r.node.node_id for r in index.lookup(["k"], T0)[0].replicas} == {"n0", "n1"}
    assert index.entries["k"].replica_num == 2


def test_racing_writers_on_two_nodes_first_applied_wins(index):
    g, _ = index.grant(1, 10, T0)
    a, b = g.first_object_id, g.first_object_id + 1
    assert stored(index, "n0", "k", a, checksum=1) is None
    err = stored(index, "n1", "k", b, checksum=2)
    assert isinstance(err, KeyConflict)
    assert isinstance(stored(index, "n2", "k", b + 1, checksum=1), AlreadyPresent)
    assert index.lookup(["k"], T0)[0].object_id == a
    # The refused copies are ordered dropped on their nodes.
    assert {(d.key, d.object_id) for d in index.membership.take_drops("n1")} == {("k", b)}


def test_a_value_written_part_by_part_is_decided_by_the_checksum_its_report_carries(index):
    """A layer-wise put learns its checksum at its end: the STORED report brings it."""
    g, _ = index.grant(1, 10, T0)
    oid = g.first_object_id
    assert stored(index, "n0", "k", oid + 1, checksum=0x5EED) is None  # oid: its writer died
    assert index.lookup(["k"], T0)[0].checksum == 0x5EED
    assert isinstance(stored(index, "n1", "k", oid + 2, checksum=0x5EED), AlreadyPresent)
    assert isinstance(stored(index, "n1", "k", oid + 3, checksum=0xBAD), KeyConflict)
    assert isinstance(stored(index, "n1", "k", oid + 4, size=99, checksum=0x5EED), KeyConflict)


def test_an_id_of_no_live_grant_is_refused(index):
    assert isinstance(stored(index, "n0", "k", 123_456), NotFound)
    g, _ = index.grant(1, 10, T0)
    late = T0 + index.grants.valid_ms + index.grants.grace_ms + 1
    assert isinstance(stored(index, "n0", "k", g.first_object_id, now_ms=late), NotFound)


def test_a_key_whose_replicas_all_died_is_free_again(index):
    g, _ = index.grant(1, 10, T0)
    assert stored(index, "n0", "k", g.first_object_id) is None
    index.membership.expire(T0 + 10_000)                  # every node dead
    for n in ("n1", "n2"):
        index.membership.nodes[n].alive = True
    assert stored(index, "n1", "k", g.first_object_id + 1, checksum=9) is None
    assert index.lookup(["k"], T0)[0].checksum == 9


def test_a_late_copy_never_brings_a_removed_key_back(index):
    """A put's second target that gets the bytes only after the key was removed
    (its link was cut mid-put) is refused: the put was decided by the first."""
    g, _ = index.grant(2, 10, T0)
    oid = g.first_object_id
    assert stored(index, "n0", "k", oid) is None
    index.remove(["k"])
    assert isinstance(stored(index, "n1", "k", oid, now_ms=T0 + 5000), NotFound)
    assert "k" not in index.entries
    # Also after a refusal: the put that was already present stays decided.
    assert stored(index, "n0", "j", oid + 1, checksum=5) is None
    assert isinstance(stored(index, "n1", "j", oid + 2, checksum=5), AlreadyPresent)
    index.remove(["j"])
    assert isinstance(stored(index, "n2", "j", oid + 2, checksum=5), NotFound)
    assert "j" not in index.entries


def test_no_live_node_no_grant(index):
    index.membership.expire(T0 + 10_000)
    with pytest.raises(Unavailable):
        index.grant(1, 10, T0 + 10_000)


def test_grants_are_bounded_and_expire():
    gs = Grants(valid_ms=100, grace_ms=100)
    for i in range(10):
        gs.issue(1 + i * 10, 10, 1, now_ms=i)
    assert gs.find(15, 5).first_object_id == 11 and gs.find(101, 5) is None
    assert gs.expire(now_ms=1000) == 10 and len(gs) == 0


def test_at_most_max_grants_are_kept_the_oldest_go_first():
    gs = Grants(valid_ms=100, grace_ms=100)
    for i in range(MAX_GRANTS + 10):
        gs.issue(1 + i * 2, 2, 1, now_ms=0)
    assert len(gs) == MAX_GRANTS
    assert gs.find(1, 0) is None and gs.find(1 + 10 * 2, 0) is not None
