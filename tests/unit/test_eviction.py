"""Tests for kvstore.store.eviction: order semantics, vetoes, registry, bookkeeping."""

from __future__ import annotations

import random

import pytest

from kvstore.store.eviction import (
    POLICIES,
    DefaultPolicy,
    EvictionPolicy,
    LfuPolicy,
    LruPolicy,
    make_policy,
    register_policy,
)


def evict_all(policy: EvictionPolicy, **kw) -> list:
    """Runs the store's side of the loop: evict each proposed key, then ask for the next."""
    out = []
    for key in policy.victims(**kw):
        out.append(key)
        policy.on_remove(key)
    policy.check_invariants()
    return out


# ---------------------------------------------------------------- registry


def test_registry_names_and_classes():
    assert {"lru", "lfu", "default"} <= set(POLICIES)
    assert isinstance(make_policy("lru"), LruPolicy)
    assert isinstance(make_policy("lfu"), LfuPolicy)
    assert isinstance(make_policy("default"), DefaultPolicy)
    assert make_policy("default", protect_s=5.0).protect_s == 5.0
    assert make_policy("lru").name == "lru"


def test_unknown_policy_lists_known_ones():
    with pytest.raises(KeyError, match="lru"):
        make_policy("no-such-policy")


def test_register_rejects_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        @register_policy("lru")
        class Other(LruPolicy):
            pass
    assert POLICIES["lru"] is LruPolicy


def test_default_rejects_bad_arguments():
    with pytest.raises(ValueError):
        DefaultPolicy(protect_s=-1)
    with pytest.raises(ValueError):
        DefaultPolicy(retention_weight=0)


# ---------------------------------------------------------------- order semantics


def test_lru_evicts_oldest_access_first():
    p = make_policy("lru")
    for t, k in enumerate("abc"):
        p.on_insert(k, 1, now=float(t))
    p.on_access("a", now=3.0)
    assert evict_all(p) == ["b", "c", "a"]
    assert len(p) == 0 and p.used_bytes == 0


def test_lru_breaks_clock_ties_by_event_order():
    p = make_policy("lru")
    for k in "xyz":
        p.on_insert(k, 1, now=7.0)
    assert evict_all(p) == ["x", "y", "z"]


def test_lru_ignores_prefix_chains():
    p = make_policy("lru")
    p.on_insert("head", 1, 0.0)
    p.on_insert("mid", 1, 0.0, parent="head")
    p.on_insert("tail", 1, 0.0, parent="mid")
    assert evict_all(p) == ["head", "mid", "tail"]


def test_lfu_fewest_uses_first_then_oldest():
    p = make_policy("lfu")
    for t, k in enumerate("abcd"):
        p.on_insert(k, 1, now=float(t))
    p.on_access("a", 10.0)
    p.on_access("a", 11.0)
    p.on_access("c", 12.0)
    # b and d used once (b older), c twice, a three times.
    assert evict_all(p) == ["b", "d", "c", "a"]


def test_default_evicts_chain_tail_before_head():
    p = make_policy("default")
    p.on_insert("a", 1, 0.0)
    p.on_insert("b", 1, 0.0, parent="a")
    p.on_insert("c", 1, 0.0, parent="b")
    p.on_insert("other", 1, 1.0)
    assert evict_all(p) == ["c", "b", "a", "other"]


def test_default_never_proposes_a_block_with_cached_children():
    p = make_policy("default", protect_s=0.0)
    p.on_insert("a", 1, 0.0)
    p.on_insert("b", 1, 10.0, parent="a")  # a is the oldest, but an inner node
    p.on_insert("x", 1, 5.0)
    # Without removals only the leaves are offered.
    assert list(p.victims()) == ["x", "b"]
    assert len(p) == 3
    # With removals, a follows once its child is gone.
    assert evict_all(p) == ["x", "b", "a"]


def test_default_frequency_protection_is_a_time_credit():
    p = make_policy("default", protect_s=100.0)
    p.on_insert("hot", 1, 0.0)
    p.on_access("hot", 1.0)  # used twice: protected until ~101 in recency terms
    p.on_insert("new", 1, 50.0)
    p.on_insert("newer", 1, 150.0)
    assert evict_all(p) == ["new", "hot", "newer"]
    q = make_policy("default", protect_s=0.0)  # leaf-first LRU
    q.on_insert("hot", 1, 0.0)
    q.on_access("hot", 1.0)
    q.on_insert("new", 1, 50.0)
    assert evict_all(q) == ["hot", "new"]


def test_default_ghost_history_restores_use_counts():
    p = make_policy("default")
    p.on_insert("k", 1, 0.0)
    p.on_access("k", 1.0)
    p.on_access("k", 2.0)
    assert evict_all(p, count=1) == ["k"]
    p.on_insert("k", 1, 3.0)
    assert p.entry("k").freq == 4  # 3 remembered + this insert
    nog = make_policy("default", ghost_factor=0)
    nog.on_insert("k", 1, 0.0)
    nog.on_access("k", 1.0)
    evict_all(nog)
    nog.on_insert("k", 1, 3.0)
    assert nog.entry("k").freq == 1


def test_default_credit_fades_with_long_retention():
    p = DefaultPolicy(protect_s=100.0, fade_ratio=1.5, retention_weight=1.0)
    assert p.credit_s == 100.0
    # Evict a probationary key 600 s after its last use: retention becomes 600.
    p.on_insert("old", 1, 0.0)
    p.on_insert("now", 1, 600.0)
    assert evict_all(p, count=1) == ["old"]
    assert p.retention_s == pytest.approx(600.0)
    assert p.credit_s == pytest.approx(100.0 * 150.0 / 600.0)


def test_prefetch_hint_refreshes_recency_only_for_default():
    for name, first in (("lru", "a"), ("default", "b")):
        p = make_policy(name)
        p.on_insert("a", 1, 0.0)
        p.on_insert("b", 1, 1.0)
        p.on_prefetch("a", 2.0)
        assert evict_all(p, count=1) == [first], name
    d = make_policy("default")
    d.on_insert("a", 1, 0.0)
    d.on_prefetch("a", 2.0)
    assert d.entry("a").freq == 1  # a hint is not a use


# ---------------------------------------------------------------- the loop's contract


@pytest.mark.parametrize("name", ["lru", "lfu", "default"])
def test_vetoed_keys_are_skipped_and_keep_their_place(name):
    p = make_policy(name)
    for t, k in enumerate("abcd"):
        p.on_insert(k, 1, float(t))
    assert evict_all(p, count=2, can_evict=lambda k: k not in {"a", "c"}) == ["b", "d"]
    assert list(p.victims(count=1)) == ["a"]
    assert evict_all(p, can_evict=lambda k: False) == []
    assert len(p) == 2


@pytest.mark.parametrize("name", ["lru", "lfu", "default"])
def test_proposed_but_kept_keys_stay_first(name):
    p = make_policy(name)
    for t, k in enumerate("abc"):
        p.on_insert(k, 1, float(t))
    assert list(p.victims(count=2)) == ["a", "b"]  # the store kept both
    assert list(p.victims(count=3)) == ["a", "b", "c"]
    p.check_invariants()


def test_victims_stop_at_the_byte_target():
    p = make_policy("lru")
    for t, (k, size) in enumerate([("a", 10), ("b", 20), ("c", 30)]):
        p.on_insert(k, size, float(t))
    assert p.used_bytes == 60
    assert evict_all(p, n_bytes_needed=25) == ["a", "b"]
    assert p.used_bytes == 30
    assert evict_all(p, n_bytes_needed=0) == []


def test_remove_of_an_inner_block_orphans_its_children():
    p = make_policy("default")
    p.on_insert("a", 1, 0.0)
    p.on_insert("b", 1, 0.0, parent="a")
    p.on_remove("a")  # an explicit delete, not an eviction
    p.on_remove("missing")  # untracked: ignored
    p.check_invariants()
    p.on_insert("a", 1, 1.0)  # a new "a" is not b's parent
    assert evict_all(p) == ["b", "a"]


def test_reinserting_a_tracked_key_counts_as_an_access():
    p = make_policy("lfu")
    p.on_insert("a", 1, 0.0)
    p.on_insert("a", 1, 1.0)
    assert p.entry("a").freq == 2 and len(p) == 1 and p.used_bytes == 1


@pytest.mark.parametrize("name", ["lru", "lfu", "default"])
def test_random_workload_keeps_invariants_and_a_bounded_heap(name):
    rng = random.Random(7)
    p = make_policy(name)
    resident: list[str] = []
    now = 0.0
    for step in range(5000):
        now += rng.random()
        op = rng.random()
        if op < 0.4 or not resident:
            key = f"k{step}"
            parent = rng.choice(resident) if resident and rng.random() < 0.5 else None
            p.on_insert(key, rng.randint(1, 4), now, parent=parent)
            resident.append(key)
        elif op < 0.8:
            p.on_access(rng.choice(resident), now)
        elif op < 0.9:
            p.on_prefetch(rng.choice(resident), now)
        else:
            pinned = set(rng.sample(resident, min(3, len(resident))))
            for key in p.victims(n_bytes_needed=rng.randint(1, 8), can_evict=lambda k: k not in pinned):
                assert key not in pinned
                p.on_remove(key)
                resident.remove(key)
        if step % 500 == 0:
            p.check_invariants()
    p.check_invariants()
    assert len(p._heap) <= 2 * len(p) + 64
    evict_all(p)
    assert len(p) == 0 and p.used_bytes == 0
