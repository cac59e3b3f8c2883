"""Tenants' usage, hard limits and counters on a master shard (kvstore.master.tenant_book),
without a network: usage follows every path that adds or deletes an entry, a put past a
hard limit is NoSpace naming the tenant and its figures, quotas change at run time."""

from __future__ import annotations

import pytest

from kvstore.errors import NoSpace
from kvstore.master.index import ObjectIndex
from kvstore.master.membership import Membership, NodeRegistration
from kvstore.master.tenant_book import TenantBook
from kvstore.shardmap import ShardMap
from kvstore.tenants import Quota
from kvstore.types import EventKind, InventoryItem, NodeAddress, NodeEvent, TierKind

T0 = 1_000_000
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def index() -> ObjectIndex:
    m = Membership(node_ttl_ms=3000)
    for n in ("n0", "n1"):
        m.register(NodeRegistration(NodeAddress(n, "127.0.0.1", 1000), 64 * MiB, 64 * MiB), T0)
    return ObjectIndex(m, ShardMap.single("127.0.0.1:1"), put_timeout_ms=30_000)


def put(index, key, size, node="n0"):
    g, _ = index.grant(1, 1, T0)
    return index.node_event(node, NodeEvent(EventKind.STORED, key, g.first_object_id,
                                            TierKind.DRAM, size, 7), T0)


def usage(index, tenant):
    return TenantBook.usage(index, tenant)


def test_usage_by_tenant_follows_puts_removes_evictions_and_forgotten_nodes(index):
    assert put(index, "@a/1", 100) is None and put(index, "@a/2", 50) is None
    assert put(index, "@b/1", 7, node="n1") is None
    assert put(index, "0" * 32, 1000) is None and put(index, "plain", 1) is None
    assert usage(index, "a") == (2, 150) and usage(index, "b") == (1, 7)
    assert usage(index, "default") == (2, 1001)
    index.remove(["@a/1"])
    assert usage(index, "a") == (1, 50)
    oid = index.entries["@a/2"].object_id
    index.node_event("n0", NodeEvent(EventKind.EVICTED, "@a/2", oid, None, 50, 7), T0)
    assert usage(index, "a") == (0, 0)
    index.membership.nodes["n1"].alive = False
    index.membership.forget_ms = 0
    index.forget_nodes(T0 + 10_000_000)
    for _ in index.forget_steps():
        pass
    assert usage(index, "b") == (0, 0) and usage(index, "default") == (2, 1001)
    figures = {f.tenant: f for f in index.tenants.figures(index)}
    assert figures["a"].counters["evictions"] == 1 and figures["a"].counters["puts"] == 2
    assert figures["default"].counters["puts"] == 2
    index.table.check()


def test_inventory_applied_counts_by_tenant(index):
    items = [InventoryItem(key=f"@inv/{i}", object_id=100 + i, size_bytes=10, checksum=1,
                           tier=TierKind.DRAM) for i in range(5)]
    index.sync_node_inventory("n0", items, T0)
    assert usage(index, "inv") == (5, 50)
    index.sync_node_inventory("n0", items[:2], T0)        # the node lost three
    assert usage(index, "inv") == (2, 20)


def test_a_put_over_the_hard_limit_is_nospace_naming_the_tenant(index):
    index.tenants.set_quotas({"beta": Quota(max_bytes=100 * KiB)})
    for i in range(3):
        assert put(index, f"@beta/{i}", 32 * KiB) is None
    err = put(index, "@beta/3", 64 * KiB)
    assert isinstance(err, NoSpace)
    assert "tenant beta: 96.0 KiB of 100.0 KiB used, put of 64.0 KiB refused" in err.message
    assert "@beta/3" not in index.entries                  # nothing half-created
    assert ("@beta/3", ) == tuple(d.key for d in index.membership.take_drops("n0"))
    assert put(index, "@alpha/0", 64 * KiB) is None        # other tenants are not limited
    assert put(index, "@beta/4", 4 * KiB) is None          # what fits still fits
    with pytest.raises(NoSpace, match="tenant beta: 100.0 KiB of 100.0 KiB used, no put fits"):
        index.grant(1, 1, T0, key="@beta/5")
    figures = {f.tenant: f for f in index.tenants.figures(index)}
    assert figures["beta"].counters["refusals"] == 2 and figures["beta"].max_bytes == 100 * KiB
    assert figures["beta"].bytes == 100 * KiB and figures["beta"].objects == 4


def test_object_limit_and_quotas_changed_at_run_time(index):
    index.tenants.set_quotas({"default": Quota(max_objects=2)})
    assert put(index, "k1", 1) is None and put(index, "k2", 1) is None
    err = put(index, "k3", 1)
    assert isinstance(err, NoSpace) and "tenant default: 2 of 2 objects stored" in err.message
    index.tenants.set_quotas({"default": Quota(max_objects=3)})     # a reload
    assert put(index, "k3", 1) is None
    index.tenants.set_quotas({})
    assert put(index, "k4", 1) is None


def test_a_shard_enforces_its_part_of_the_limit():
    m = Membership(node_ttl_ms=3000)
    m.register(NodeRegistration(NodeAddress("n0", "127.0.0.1", 1000), 64 * MiB, 64 * MiB), T0)
    shard_map = ShardMap.even([("127.0.0.1:1",), ("127.0.0.1:2",)])
    idx = ObjectIndex(m, shard_map, shard_id=1)
    idx.tenants.set_quotas({"t": Quota(max_bytes=100 * KiB)})
    assert idx.tenants.fraction == 0.5
    key = next(f"@t/{i}" for i in range(1000) if _owned(idx, f"@t/{i}"))
    err = put(idx, key, 60 * KiB)
    assert isinstance(err, NoSpace) and "50.0 KiB" in err.message and "0.5 of the slots" in err.message


def _owned(idx, key):
    try:
        idx._check_key(key)
    except Exception:
        return False
    return True


def test_lookup_hits_and_misses_by_tenant(index):
    put(index, "@a/1", 10)
    put(index, "d1", 10)
    index.lookup(["@a/1", "@a/2", "d1", "d2", "d3"], T0)
    figures = {f.tenant: f.counters for f in index.tenants.figures(index)}
    assert (figures["a"]["hits"], figures["a"]["misses"]) == (1, 1)
    assert (figures["default"]["hits"], figures["default"]["misses"]) == (1, 2)
