"""Streamed inventories and the warm-up, without a network: the entry table's scans, an
inventory applied in chunks and slices (kvstore.master.inventory, .registration), the
warm-up's rule (kvstore.master.warmup), the roster file, and a node's inventory read a
chunk at a time."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvstore.errors import InvalidArgument
from kvstore.master.index import ObjectIndex
from kvstore.master.inventory import InventorySync, sync_node_inventory
from kvstore.master.membership import Membership, NodeRegistration
from kvstore.master import registration as registration_module
from kvstore.master.registration import Registrations
from kvstore.master.roster import FileRoster, Roster
from kvstore.master.warmup import Warmup, WarmupState
from kvstore.shardmap import ShardMap
from kvstore.types import EventKind, InventoryItem, NodeAddress, NodeEvent, TierKind

T0 = 1_000_000
TTL_MS = 3000
MiB = 1 << 20


def registration(node_id: str) -> NodeRegistration:
    return NodeRegistration(NodeAddress(node_id, "127.0.0.1", 1000), 64 * MiB, 64 * MiB,
                            incarnation="i")


def make_index(*nodes: str) -> ObjectIndex:
    m = Membership(node_ttl_ms=TTL_MS)
    for n in nodes:
        m.register(registration(n), T0)
    return ObjectIndex(m, ShardMap.single("127.0.0.1:1"))


def item(key: str, object_id: int, tier: TierKind = TierKind.SSD, pending: bool = False):
    return InventoryItem(key, object_id, 100, 7, tier, pending=pending)


def stored(index: ObjectIndex, node: str, key: str) -> int:
    """A put of ``key`` through a grant, stored on ``node``; returns its object id."""
    grant, _ = index.grant(1, 1, T0)
    assert index.node_event(node, NodeEvent(EventKind.STORED, key, grant.first_object_id,
                                            TierKind.DRAM, 100, 7), T0) is None
    return grant.first_object_id


def state(index: ObjectIndex) -> dict:
    return {k: (e.object_id, sorted(e.replicas)) for k, e in index.entries.items()}


# ---- an inventory in chunks ----

def test_an_inventory_in_chunks_ends_where_the_whole_one_does():
    def build():
        idx = make_index("n0", "n1")
        for k in ("a", "b", "c"):
            stored(idx, "n0", k)
        stored(idx, "n1", "d")
        return idx

    inventory = [item("a", idx_id) for idx_id in (build().entries["a"].object_id,)] + [
        item("x", 500), item("y", 501, pending=True), item("z", 502)]
    whole = build()
    assert sync_node_inventory(whole, "n0", inventory, T0) == (2, 2)   # b, c lost; x, z new
    chunked = build()
    sync = InventorySync(chunked, "n0", sweep=True)
    for part in (inventory[:1], inventory[1:3], inventory[3:]):
        sync.apply(part, T0)
    assert state(chunked) != state(whole)          # the sweep has not run yet
    for _ in sync.sweep():
        pass
    assert state(chunked) == state(whole)
    assert (sync.lost, sync.indexed) == (2, 2)
    assert "b" not in chunked.entries and chunked.entries["d"].replicas == ["n1"]


def test_a_node_new_to_the_index_skips_the_sweep():
    idx = make_index("n0")
    stored(idx, "n0", "kept")
    sync = InventorySync(idx, "n9", sweep=False)
    sync.apply([item("fresh", 900)], T0)
    assert list(sync.sweep()) == []                # no scan of the index at all
    assert set(idx.entries) == {"kept", "fresh"}


def run(coro):
    return asyncio.run(coro)


def test_registrations_apply_chunks_in_order_once_and_the_node_serves_at_the_last():
    async def main():
        idx = make_index()
        warmup = Warmup({"n0"}, T0, TTL_MS)
        regs = Registrations(idx, warmup, Roster(), known={"n0"})
        sync_id = await regs.register(registration("n0"), T0)
        info = idx.membership.nodes["n0"]
        assert info.syncing and not info.alive and not warmup.whole(T0)
        chunk = lambda seq, items, last=False: regs.sync_chunk(   # noqa: E731
            "n0", sync_id, seq, items, last, lambda: T0, lambda x: x)
        assert await chunk(0, [item("a", 10), item("b", 11)]) == 2
        assert await chunk(0, [item("a", 10), item("b", 11)]) == 2    # a resend: not again
        assert await chunk(5, []) is None                             # a gap: start again
        assert await regs.sync_chunk("n0", sync_id + 1, 1, [], True, lambda: T0,
                                     lambda x: x) is None              # another registration
        assert not info.alive and warmup.nodes["n0"].items_applied == 2
        assert await chunk(1, [item("c", 12)], last=True) == 3
        assert info.alive and not info.syncing and warmup.whole(T0)
        assert set(idx.entries) == {"a", "b", "c"}
        assert await chunk(2, [], last=True) is None                   # done: not known
    run(main())


def test_a_chunk_one_ahead_waits_for_the_one_before_a_bounded_time(monkeypatch):
    """A node keeps two chunks in flight (kvstore.store.inventory): the second may be
    handled first; it waits for the first, and gives up (register again) if it never comes."""
    async def main():
        idx = make_index()
        regs = Registrations(idx, Warmup({"n0"}, T0, TTL_MS), Roster(), known={"n0"})
        sync_id = await regs.register(registration("n0"), T0)
        chunk = lambda seq, items, last=False: regs.sync_chunk(   # noqa: E731
            "n0", sync_id, seq, items, last, lambda: T0, lambda x: x)
        ahead = asyncio.ensure_future(chunk(1, [item("b", 11)]))
        await asyncio.sleep(0.01)
        assert not ahead.done()
        assert await chunk(0, [item("a", 10)]) == 1
        assert await ahead == 2
        monkeypatch.setattr(registration_module, "AHEAD_WAIT_S", 0.05)
        assert await chunk(3, [item("d", 13)]) is None          # seq 2 never came
        assert await chunk(4, [item("e", 14)]) is None          # two ahead: a gap at once
        assert set(idx.entries) == {"a", "b"}
    run(main())


def test_a_chunk_with_a_bad_item_is_refused_whole_and_a_new_registration_replaces_the_old():
    async def main():
        idx = make_index()
        regs = Registrations(idx, Warmup(set(), T0, TTL_MS), Roster())
        first = await regs.register(registration("n0"), T0)

        def read(x):
            if x.object_id == 0:
                raise InvalidArgument("object id 0")
            return x
        with pytest.raises(InvalidArgument):
            await regs.sync_chunk("n0", first, 0, [item("ok", 5), item("bad", 0)], True,
                                  lambda: T0, read)
        assert not idx.entries                                        # nothing applied
        second = await regs.register(registration("n0"), T0 + 1)
        assert await regs.sync_chunk("n0", first, 0, [], True, lambda: T0, read) is None
        assert await regs.sync_chunk("n0", second, 0, [item("ok", 5)], True, lambda: T0,
                                     read) == 1
        assert idx.membership.is_alive("n0")
    run(main())


def test_a_stalled_registration_is_given_up_with_its_node():
    async def main():
        idx = make_index()
        warmup = Warmup({"n0"}, T0, TTL_MS)
        regs = Registrations(idx, warmup, Roster(), known={"n0"})
        await regs.register(registration("n0"), T0)
        idx.membership.expire(T0 + TTL_MS + 1)                      # no chunk for a ttl
        regs.expire()
        assert warmup.nodes["n0"].state is WarmupState.GAVE_UP and warmup.whole(T0 + TTL_MS + 1)
        assert not idx.membership.is_alive("n0")
    run(main())


# ---- the warm-up's rule ----

def test_an_empty_roster_is_whole_at_once_and_a_known_node_is_waited_for():
    assert Warmup(set(), T0, TTL_MS).whole(T0)
    w = Warmup({"n0", "n1"}, T0, TTL_MS)
    assert not w.whole(T0) and "n0 (not registered)" in w.describe(T0)
    w.registered("n0")
    w.applied("n0", 4096)
    assert "n0 (inventory: 4096 applied)" in w.describe(T0 + 1)
    w.synced("n0")
    assert not w.whole(T0 + TTL_MS - 1)           # n1 may still come within its ttl
    assert w.whole(T0 + TTL_MS)                   # ... it did not: counted dead
    assert w.nodes["n1"].state is WarmupState.GAVE_UP and w.whole(T0)   # latched


def test_a_registration_under_way_is_waited_for_past_the_bound():
    w = Warmup({"n0"}, T0, TTL_MS)
    w.registered("n0")
    assert not w.whole(T0 + 10 * TTL_MS)          # its inventory is still arriving
    w.synced("n0")
    assert w.whole(T0 + 10 * TTL_MS) and w.left_ms(T0) == 0


def test_without_a_roster_the_bound_is_waited_then_the_registrations_under_way():
    w = Warmup(None, T0, TTL_MS)
    assert not w.whole(T0) and "no roster" in w.describe(T0)
    w.registered("n7")                           # not on any roster: waited for once begun
    assert not w.whole(T0 + TTL_MS)
    w.synced("n7")
    assert w.whole(T0 + TTL_MS)


# ---- the roster ----

def test_the_file_roster_keeps_nodes_across_processes_and_refuses_a_damaged_file(tmp_path):
    roster = FileRoster(str(tmp_path / "state"))
    assert roster.load() == set()
    roster.add("n0")
    roster.add("n1")
    roster.remove("n0")
    assert FileRoster(str(tmp_path / "state")).load() == {"n1"}
    roster.reserve_ids(1 << 24)
    assert json.loads((tmp_path / "state" / "nodes.json").read_text()) == {
        "nodes": ["n1"], "ids_below": 1 << 24}
    assert FileRoster(str(tmp_path / "state")).ids_below() == 1 << 24
    (tmp_path / "state" / "nodes.json").write_text("{not json")
    with pytest.raises(OSError, match="move it aside"):
        FileRoster(str(tmp_path / "state")).load()
    assert Roster().load() is None


# ---- versions a returning node brings back (issue 31, bug 3) ----

def test_a_version_replaced_while_its_node_was_away_never_comes_back():
    idx = make_index("a", "b")
    old = stored(idx, "a", "k")
    idx.membership.heartbeat(_beat("b"), T0 + TTL_MS)
    idx.membership.expire(T0 + TTL_MS + 1)              # a is dead, b alive
    new = stored(idx, "b", "k")                          # K=Y replaces the lost K=X
    assert idx.entries["k"].object_id == new > old
    assert sync_node_inventory(idx, "b", [], T0) == (1, 0)    # b restarts: Y is gone
    idx.membership.register(registration("a"), T0 + TTL_MS + 2)
    sync_node_inventory(idx, "a", [InventoryItem("k", old, 100, 7, TierKind.SSD)], T0)
    assert "k" not in idx.entries                        # X is refused, and dropped
    assert ("k", old) in {(d.key, d.object_id) for d in idx.membership.take_drops("a")}
    assert idx.counters["stale_replicas_dropped"] == 1
    idx.superseded.expire(T0 + idx.membership.forget_ms + 1)
    assert not idx.superseded.replaced("k", old)         # kept for as long as a node may return


def test_of_two_inventories_the_later_put_wins_whatever_their_order():
    for first, second in (("a", "b"), ("b", "a")):
        idx = make_index("a", "b")
        held = {"a": item("k", 10), "b": item("k", 20)}
        sync_node_inventory(idx, first, [held[first]], T0)
        sync_node_inventory(idx, second, [held[second]], T0)
        assert idx.entries["k"].object_id == 20 and idx.entries["k"].replicas == ["b"]
        assert ("k", 10) in {(d.key, d.object_id) for d in idx.membership.take_drops("a")}


def _beat(node_id: str):
    from kvstore.master.membership import NodeHeartbeat
    return NodeHeartbeat(node_id, 0, 0, incarnation="i")


# ---- one rule for counting objects (issue 31, bug 4) ----

def test_objects_on_dead_nodes_only_are_counted_apart_from_the_readable_ones():
    idx = make_index("a", "b")
    for k in ("x1", "x2"):
        stored(idx, "a", k)
    stored(idx, "b", "y")
    grant, _ = idx.grant(2, 1, T0)                       # one object on both nodes
    for n in ("a", "b"):
        idx.node_event(n, NodeEvent(EventKind.STORED, "both", grant.first_object_id,
                                    TierKind.DRAM, 100, 7), T0)
    idx.membership.heartbeat(_beat("b"), T0 + TTL_MS)
    idx.membership.expire(T0 + TTL_MS + 1)              # a is dead
    st = idx.stat()
    assert (st.num_objects, st.unavailable_objects) == (2, 2)      # y, both | x1, x2
    assert (st.total_bytes, st.unavailable_bytes) == (200, 200)
    assert sorted(m.key for m in idx.list("", "", 0)[0]) == ["both", "y"]   # the same rule
    idx.table.check()
