"""The native slot policies (kvstore.store.eviction.slotted) against the Python ones.

The Python policies over keys are the specification. Each test replays one
random sequence of events through both -- the native one names objects by
slots that are reused as the node's table reuses them -- and asks for the
same victims, in the same order, with the same bookkeeping.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.store.eviction import SlotPolicy, make_policy, make_slot_policy

NAMES = ["lru", "lfu", "default", "none"]


class Pair:
    """A Python policy and its native twin, fed the same events."""

    def __init__(self, name: str, **params):
        self.py = make_policy(name, **params)
        self.nat = make_slot_policy(name, **params)
        self.slot: dict[str, int] = {}     # resident key -> slot
        self.key: dict[int, str] = {}
        self.free: list[int] = []
        self.next = 0

    def insert(self, key, size, now, parent):
        self.py.on_insert(key, size, now, parent=parent)
        if key not in self.slot:
            slot = self.free.pop() if self.free else self.next
            self.next = max(self.next, slot + 1)
            self.slot[key], self.key[slot] = slot, key
        self.nat.on_insert(self.slot[key], size, now, self.slot.get(parent, -1), key)

    def access(self, key, now):
        self.py.on_access(key, now)
        self.nat.on_access(self.slot[key], now)

    def prefetch(self, key, now):
        self.py.on_prefetch(key, now)
        self.nat.on_prefetch(self.slot[key], now)

    def remove(self, key):
        self.py.on_remove(key)
        slot = self.slot.pop(key)
        del self.key[slot]
        self.nat.on_remove(slot, key)
        self.free.append(slot)

    def evict(self, n_bytes, pinned, keep_every=0):
        """Both loops, in step: each proposed victim is evicted (or, every
        keep_every-th, kept) in both; returns the keys proposed."""
        gen_py = self.py.victims(n_bytes, can_evict=lambda k: k not in pinned)
        gen_nat = self.nat.victims(n_bytes, can_evict=lambda s: self.key[s] not in pinned)
        out = []
        for i, (k, s) in enumerate(zip(gen_py, gen_nat)):
            assert self.key[s] == k, (out, k, self.key[s])
            out.append(k)
            if not keep_every or i % keep_every:
                self.remove(k)
        assert next(gen_py, None) is None and next(gen_nat, None) is None
        return out

    def agree(self):
        assert len(self.py) == len(self.nat)
        assert self.py.used_bytes == self.nat.used_bytes
        if self.py.name != "none":
            for key, slot in self.slot.items():
                assert self.py.entry(key).freq == self.nat.freq(slot), key
        if self.py.name == "default":
            assert self.py.retention_s == pytest.approx(self.nat.retention_s)
        self.py.check_invariants()
        self.nat.check_invariants()


def replay(name: str, seed: int, steps: int, **params) -> Pair:
    rng = random.Random(seed)
    pair = Pair(name, **params)
    now = 0.0
    names = [f"k{i}" for i in range(steps // 3 + 4)]    # keys come back: ghosts, slot reuse
    for _ in range(steps):
        now += rng.choice((0.0, rng.random() * 50))
        op = rng.random()
        resident = list(pair.slot)
        if op < 0.45 or not resident:
            key = rng.choice(names)
            parent = rng.choice(resident) if resident and rng.random() < 0.6 else None
            pair.insert(key, rng.randint(0, 9), now, parent)
        elif op < 0.7:
            pair.access(rng.choice(resident), now)
        elif op < 0.8:
            pair.prefetch(rng.choice(resident), now - rng.random() * 3)
        elif op < 0.88:
            pair.remove(rng.choice(resident))
        else:
            pinned = set(rng.sample(resident, min(len(resident), rng.randint(0, 3))))
            pair.evict(rng.randint(1, 20), pinned, keep_every=rng.choice((0, 0, 3)))
        pair.agree()
    pair.evict(None, set())
    pair.agree()
    return pair


@pytest.mark.parametrize("name", NAMES)
def test_native_matches_the_python_policy_on_a_long_random_run(name):
    pair = replay(name, seed=33, steps=3000, **({"protect_s": 40.0, "ghost_factor": 0.5}
                                                if name == "default" else {}))
    assert len(pair.nat) == (len(pair.slot) if name == "none" else 0)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(NAMES), seed=st.integers(0, 2**32), steps=st.integers(1, 150),
       protect_s=st.sampled_from([0.0, 5.0, 60.0]), ghost_factor=st.sampled_from([0.0, 0.1, 4.0]))
def test_native_matches_the_python_policy(name, seed, steps, protect_s, ghost_factor):
    params = {"protect_s": protect_s, "ghost_factor": ghost_factor, "fade_ratio": 0.5,
              "retention_weight": 0.25} if name == "default" else {}
    replay(name, seed, steps, **params)


def test_slot_policy_carries_the_registered_name_and_checks_parameters():
    p = make_slot_policy("default", protect_s=5.0)
    assert isinstance(p, SlotPolicy) and p.name == "default" and p.evicts
    assert not make_slot_policy("none").evicts
    with pytest.raises(ValueError):
        make_slot_policy("default", protect_s=-1.0)
    with pytest.raises(KeyError):
        make_slot_policy("nosuch")
    with pytest.raises(ValueError, match="slot out of range"):
        p.on_insert(-1, 1, 0.0)


def test_a_reused_parent_slot_is_not_the_old_parent():
    p = make_slot_policy("default", protect_s=0.0)
    p.on_insert(0, 1, 1.0)                 # parent
    p.on_insert(1, 1, 2.0, parent=0)       # child: 0 is inner
    p.on_remove(0)                         # explicit delete of the parent
    p.on_insert(0, 1, 3.0)                 # slot 0 reused by an unrelated object
    p.check_invariants()
    assert list(p.victims(count=2)) == [1, 0]    # 0 is a leaf: not the child's parent


def test_native_bytes_per_object_are_small():
    p = make_slot_policy("default")
    for slot in range(100_000):
        p.on_insert(slot, 64, float(slot))
    assert p.native_bytes / 100_000 < 72      # 56 B entry + 4 B heap (+ growth)
    n = make_slot_policy("none")
    for slot in range(100_000):
        n.on_insert(slot, 64, 0.0)
    assert n.native_bytes / 100_000 < 17


def test_objects_removed_without_a_key_stay_out_of_the_ghost_history():
    p = make_slot_policy("default", ghost_factor=4.0)
    for round_ in range(3):
        for slot in range(200):
            p.on_insert(slot, 1, float(round_ * 1000 + slot))
            p.on_access(slot, float(round_ * 1000 + slot) + 0.5)
        for slot in p.victims():
            p.on_remove(slot)
        p.check_invariants()
    assert p._core.ghosts == 0 and len(p) == 0
    p.on_insert(0, 1, 5000.0, key="k")
    p.on_remove(0, "k")                 # the key comes with the remove: a slot keeps none
    assert p._core.ghosts == 1
    p.on_insert(7, 1, 5001.0, key="k")
    assert p.freq(7) == 2 and p._core.ghosts == 0


def test_a_full_tiers_ghost_history_costs_under_40_bytes_a_ghost():
    """A tier that evicts all the time remembers ghost_factor (4) removed keys for each
    object it holds: their cost is part of every object's (58 B a ghost before the ring)."""
    p = make_slot_policy("default", ghost_factor=4.0)
    n = 20_000
    for slot in range(n):
        p.on_insert(slot, 64, float(slot), key=f"k{slot}")
    before, clock = p.native_bytes, float(n)
    for i in range(6 * n):                     # churn: every removal becomes a ghost
        slot = i % n
        p.on_remove(slot, f"k{i}")
        clock += 1
        # every third insert is a key that was removed before: a ghost taken back
        p.on_insert(slot, 64, clock, key=f"k{i - n}" if i % 3 == 0 else f"k{i + n}")
    p.check_invariants()
    assert p._core.ghosts == 4 * (n - 1)       # 4x what it held at each removal
    assert (p.native_bytes - before) / p._core.ghosts < 40
