"""A store node's eviction by tenants' guaranteed shares (kvstore.store.tenant_shares):
a tenant within its share keeps its objects while another tenant's pressure evicts,
and loses them only once no tenant is above its share."""

from __future__ import annotations

import pytest

from kvstore.keys import value_checksum
from kvstore.store.node import StoreNode
from kvstore.store.tiers.dram import DramTier
from kvstore.tenants import Quota
from kvstore.types import EventKind

KiB = 1024
CAPACITY = 256 * KiB


@pytest.fixture(params=["lru", "lfu", "default"])
def node(request):
    tier = DramTier(CAPACITY)
    try:
        yield StoreNode(tier, policy=request.param, high_watermark=0.9, low_watermark=0.7)
    finally:
        tier.close()


def write(node, key, data, object_id):
    obj, _ = node.begin_write(key, object_id, len(data), value_checksum(data), None)
    node.write_view(obj)[:] = data
    node.commit_write(obj)
    node.confirm(key, object_id)


def evicted(node) -> set[str]:
    return {e.key for e in node.take_events() if e.kind is EventKind.EVICTED}


def test_a_tenant_within_its_share_is_not_evicted_by_anothers_pressure(node):
    node.tenants.configure({"alpha": Quota(share_fraction=0.4)})
    alpha = [f"@alpha/{i}" for i in range(8)]                    # 64 KiB: within 40 %
    for i, key in enumerate(alpha):
        write(node, key, b"a" * (8 * KiB), i + 1)
    for i in range(100):                                          # 800 KiB of beta's
        write(node, f"@beta/{i}", b"b" * (8 * KiB), 100 + i)
    gone = evicted(node)
    assert gone and not any(k.startswith("@alpha/") for k in gone)
    assert all(node.acquire(k) for k in alpha)
    assert node.tenants.snapshot()["alpha"] == (64 * KiB, int(0.4 * CAPACITY))
    node.check_invariants()


def test_without_shares_the_policy_order_holds(node):
    for i in range(8):
        write(node, f"@alpha/{i}", b"a" * (8 * KiB), i + 1)
    for i in range(100):
        write(node, f"@beta/{i}", b"b" * (8 * KiB), 100 + i)
    assert any(k.startswith("@alpha/") for k in evicted(node))   # the oldest went first
    assert node.tenants.snapshot() == {}


def test_above_its_share_a_tenant_is_evicted_and_a_reload_changes_the_share(node):
    node.tenants.configure({"alpha": Quota(share_bytes=32 * KiB)})
    for i in range(8):                                            # 64 KiB: above 32 KiB
        write(node, f"@alpha/{i}", b"a" * (8 * KiB), i + 1)
    for i in range(100):
        write(node, f"@beta/{i}", b"b" * (8 * KiB), 100 + i)
    gone = evicted(node)
    assert any(k.startswith("@alpha/") for k in gone)             # down to its share ...
    assert node.tenants.snapshot()["alpha"][0] >= 32 * KiB - 8 * KiB  # ... not below it
    node.tenants.configure({})                                    # shares gone: policy order
    assert node.tenants.snapshot() == {}


def test_only_tenants_within_their_share_left_then_they_are_evicted(node):
    node.tenants.configure({"alpha": Quota(share_fraction=1.0)})
    for i in range(60):                                           # 480 KiB: alpha only
        write(node, f"@alpha/{i}", b"a" * (8 * KiB), i + 1)
    assert evicted(node)                                          # the node still makes room
