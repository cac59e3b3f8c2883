"""A store node's eviction by tenants' guaranteed shares (kvstore.store.tenant_shares):
a tenant within its share keeps its objects while another tenant's pressure evicts,
and loses them only once no tenant is above its share."""

from __future__ import annotations

import pytest

from kvstore.errors import NoSpace
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


# ---- room made for a put (issue 35 F1): a tenant within its share keeps its objects
# unless the put's own tenant is within its share too.

def fill_alpha(node, count=40, size=4 * KiB):
    keys = [f"@alpha/{i}" for i in range(count)]
    for i, key in enumerate(keys):
        write(node, key, b"a" * size, i + 1)
    assert not evicted(node)
    return keys


def all_held(node, keys) -> bool:
    for key in keys:
        node.release(node.acquire(key))       # NotFound when gone; no reference kept
    return True


def put_refused(node, key, size, object_id=999):
    with pytest.raises(NoSpace) as err:
        node.begin_write(key, object_id, size, 1, None)
    return err.value.message


def test_a_put_over_its_tenants_share_evicts_nobody_within_theirs(node):
    node.tenants.configure({"alpha": Quota(share_fraction=0.75)})
    alpha = fill_alpha(node)                                      # 160 KiB: within 192 KiB
    message = put_refused(node, "@beta/big", 200 * KiB)           # 96 KiB free: needs alpha's
    assert message.startswith("tenant beta: ") and "nothing was evicted" in message
    assert not evicted(node)
    assert all_held(node, alpha)
    put_refused(node, "plain-key", 200 * KiB)                     # the default tenant: the same
    assert not evicted(node)
    node.check_invariants()


def test_a_put_within_its_tenants_share_may_still_evict_as_before(node):
    node.tenants.configure({"alpha": Quota(share_fraction=0.75), "beta": Quota(share_fraction=0.9)})
    fill_alpha(node)
    write(node, "@beta/big", b"b" * (200 * KiB), 999)             # beta within its 90 %
    assert evicted(node)


def test_a_put_over_its_share_takes_tenants_above_theirs_down_to_their_share(node):
    node.tenants.configure({"alpha": Quota(share_fraction=0.1)})  # 25.6 KiB: alpha is above
    fill_alpha(node)
    write(node, "@beta/big", b"b" * (120 * KiB), 999)             # 96 KiB free: alpha's too
    gone = evicted(node)
    assert gone and all(k.startswith("@alpha/") for k in gone)
    held, share = node.tenants.snapshot()["alpha"]
    assert share - 4 * KiB < held                                 # not below its share
    node.check_invariants()


def test_a_value_over_its_tenants_hard_limit_is_refused_before_any_eviction(node):
    # The reproduction: alpha above its share, beta's quota far under its put.
    node.tenants.configure({"alpha": Quota(share_fraction=0.1), "beta": Quota(max_bytes=16 * KiB)})
    alpha = fill_alpha(node)
    message = put_refused(node, "@beta/big", 200 * KiB)
    assert message.startswith("tenant beta: put of 200.0 KiB refused") and "16.0 KiB" in message
    assert not evicted(node)
    assert all_held(node, alpha)
    write(node, "@beta/small", b"b" * (8 * KiB), 1000)            # within the limit: as usual


def test_the_object_limit_evicts_nobody_within_their_share_for_a_put_over_its_share():
    tier = DramTier(CAPACITY)
    try:
        node = StoreNode(tier, policy="lru", max_objects=8)
        node.tenants.configure({"alpha": Quota(share_fraction=0.5)})
        alpha = fill_alpha(node, count=8)
        message = put_refused(node, "@beta/0", 4 * KiB)
        assert "none may be evicted" in message
        assert not evicted(node) and all_held(node, alpha)
        write(node, "@alpha/8", b"a" * (4 * KiB), 100)            # alpha within: its own order
        assert evicted(node) == {"@alpha/0"}
    finally:
        tier.close()
