"""Object limits, refused with numbers before a process runs out of memory: the master's
``--max-objects`` (kvstore.master.limits) and the node's (kvstore.store.limits); and a
node's inventory read a chunk at a time while it changes."""

from __future__ import annotations

import pytest

from kvstore.errors import NoSpace
from kvstore.keys import value_checksum
from kvstore.master.index import ObjectIndex
from kvstore.master.limits import MASTER_BYTES_PER_OBJECT, default_max_objects
from kvstore.master.membership import Membership, NodeRegistration
from kvstore.shardmap import ShardMap
from kvstore.store.limits import NODE_BYTES_PER_OBJECT
from kvstore.store.node import StoreNode
from kvstore.store.stats import NodeCounter
from kvstore.store.tiers.dram import DramTier
from kvstore.types import EventKind, InventoryItem, NodeAddress, NodeEvent, TierKind

T0 = 1_000_000
MiB = 1 << 20


def test_the_master_refuses_a_new_key_past_its_limit_and_says_why():
    m = Membership(node_ttl_ms=3000)
    m.register(NodeRegistration(NodeAddress("n0", "127.0.0.1", 1000), 64 * MiB, 64 * MiB), T0)
    idx = ObjectIndex(m, ShardMap.single("127.0.0.1:1"), max_objects=2)
    grant, _ = idx.grant(1, 10, T0)

    def put(key, oid, checksum=7):
        return idx.node_event("n0", NodeEvent(EventKind.STORED, key, grant.first_object_id + oid,
                                              TierKind.DRAM, 100, checksum), T0)
    assert put("a", 0) is None and put("b", 1) is None
    err = put("c", 2)
    assert isinstance(err, NoSpace) and "2 objects, its limit (--max-objects 2" in err.message
    assert f"{MASTER_BYTES_PER_OBJECT} B each" in err.message and "c" not in idx.entries
    assert idx.counters["puts_over_limit"] == 1
    # What a node holds already is indexed all the same (counted).
    idx.sync_node_inventory("n0", [*(InventoryItem(k, idx.entries[k].object_id, 100, 7,
                                                   TierKind.DRAM) for k in "ab"),
                                   InventoryItem("d", 900, 100, 7, TierKind.SSD)], T0)
    assert "d" in idx.entries and idx.counters["inventory_over_limit"] == 1
    assert default_max_objects(8 << 30) == (4 << 30) // MASTER_BYTES_PER_OBJECT
    assert default_max_objects(0) == 2**63 - 1


def write(node: StoreNode, key: str, object_id: int, data: bytes = b"x" * 64) -> None:
    obj, present = node.begin_write(key, object_id, len(data), value_checksum(data))
    if not present:
        node.write_view(obj)[:] = data
        node.commit_write(obj)


@pytest.mark.parametrize("policy", ["none", "lru"])
def test_a_node_at_its_limit_evicts_the_coldest_or_refuses_with_numbers(policy):
    tier = DramTier(1 * MiB)
    try:
        node = StoreNode(tier, policy=policy, max_objects=3)
        for i in range(3):
            write(node, f"k{i}", i + 1)
        if policy == "none":
            with pytest.raises(NoSpace, match=r"holds 3 objects, its limit \(--max-objects 3") as err:
                write(node, "k3", 4)
            assert f"{NODE_BYTES_PER_OBJECT} B each" in err.value.message
            assert node.counters[NodeCounter.OVER_OBJECT_LIMIT] == 1
            assert sorted(k for k, *_ in node.inventory()) == ["k0", "k1", "k2"]
        else:
            write(node, "k3", 4)
            assert sorted(k for k, *_ in node.inventory()) == ["k1", "k2", "k3"]   # k0 coldest
            assert node.counters[NodeCounter.EVICTED_FOR_COUNT] == 1
        node.check_invariants(idle=True)
    finally:
        tier.close()


def test_an_inventory_read_in_chunks_lists_what_lives_through_it():
    tier = DramTier(1 * MiB)
    try:
        node = StoreNode(tier, policy="none")
        for i in range(10):
            write(node, f"k{i}", i + 1)
        seen = []
        for n, chunk in enumerate(node.inventory_chunks(chunk_items=4)):
            seen += [it.key for it in chunk]
            if n == 0:                     # between chunks: one listed goes, one ahead goes,
                node.drop("k1")            # a new one takes a freed position
                node.drop("k6")
                write(node, "new", 99)
        # k1 was listed before it went; k6 is gone before its chunk; "new" took k6's place.
        assert seen == ["k0", "k1", "k2", "k3", "k4", "k5", "new", "k7", "k8", "k9"]
        assert all(not it.pending for it in node.inventory_items())   # no master: confirmed
        owned = [it.key for chunk in node.inventory_chunks(4, owns=lambda k: k.endswith("9"))
                 for it in chunk]
        assert owned == ["k9"]
        node.check_invariants(idle=True)
    finally:
        tier.close()
