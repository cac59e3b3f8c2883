"""The master's native entry table (kvstore/native/entry_table.hpp), against plain models."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore._native import EntryTable

ALIVE = b"\x01" * 8
HEX = "0123456789abcdef"


def hex_key(rng: random.Random) -> str:
    return "".join(rng.choice(HEX) for _ in range(32))


def test_keys_hex_packed_and_others_map_to_their_own_entries():
    t = EntryTable()
    keys = ["0" * 32, "f" * 32, "F" * 32, "0" * 31, "0" * 33, "é" * 10, "x", "a" * 512]
    slots = {k: t.insert(k, i, i, i + 1, 0, 1, 0, 2) for i, k in enumerate(keys)}
    assert len(t) == len(keys) and len(set(slots.values())) == len(keys)
    for i, k in enumerate(keys):
        assert t.find(k) == slots[k] and t.key(slots[k]) == k
        assert t.head(slots[k]) == (i + 1, i, i)
    assert t.find("a" * 513) == -1 and t.find("1" * 32) == -1
    t.check()


def test_random_inserts_and_removes_agree_with_a_dict():
    rng = random.Random(7)
    t, model = EntryTable(), {}
    for step in range(20_000):
        if model and rng.random() < 0.4:
            key = rng.choice(list(model)) if step % 100 == 0 else next(iter(model))
            t.remove(model.pop(key))
        else:
            key = hex_key(rng) if rng.random() < 0.9 else f"k/{rng.randrange(10**6)}"
            if key not in model:
                model[key] = t.insert(key, 64, step, step, 0, 1, rng.randrange(3), 2)
    assert len(t) == len(model)
    for key, slot in model.items():
        assert t.find(key) == slot
    t.check()


def test_replicas_past_three_and_repairs_live_in_the_overflow():
    t = EntryTable()
    s = t.insert("k", 10, 1, 1, 0, 5, 0, 2)
    for n in range(1, 6):
        t.add_replica(s, n, 3 if n % 2 else 2)
    assert t.replicas(s) == ((0, 2), (1, 3), (2, 2), (3, 3), (4, 2), (5, 3))
    assert t.remove_replica(s, 1) and not t.remove_replica(s, 1)
    assert t.nodes(s) == [0, 2, 3, 4, 5]
    t.set_repair(s, 7, 99)
    assert t.repair(s) == (7, 99)
    t.set_repair(s, -1, 0)
    assert t.repair(s) == (-1, 0)
    assert t.live_nodes(s, b"\x00\x00\x01\x00\x01") == [2, 4]
    assert t.unavailable(b"\x00") == (1, 10) and t.unavailable(b"\x00\x00\x01") == (0, 0)
    t.check()


def test_a_scan_sees_every_entry_that_lives_through_it_and_reuses_positions():
    t = EntryTable()
    slots = [t.insert(f"k{i}", 1, 1, i, 0, 1, 0, 2) for i in range(10)]
    assert slots == list(range(10))
    listed = bytearray(10)        # a sweep of node 0 over nothing listed forgets every entry
    seen = []
    for start in range(0, t.positions(), 3):
        before = {t.key(s) for s in range(start, min(start + 3, t.positions())) if t.find(
            f"k{s}") == s}
        seen += sorted(before)
        t.sweep_slice(start, 3, 0, listed)
        if start == 0:                     # between slices: one ahead goes
            t.remove(8)
    assert sorted(seen) == sorted(f"k{i}" for i in range(10) if i != 8)
    assert len(t) == 0
    assert t.insert("new", 1, 1, 99, 0, 1, 0, 2) == 9     # the last position freed


KEYS = st.text(alphabet="ab0f", min_size=1, max_size=3) | st.sampled_from(
    ["0" * 32, "f" * 32, "0" * 31 + "1", "a" * 32])


@settings(max_examples=200, deadline=None)
@given(st.sets(KEYS, max_size=40), st.sets(KEYS, max_size=10), st.text(alphabet="ab0", max_size=2),
       KEYS | st.just(""), st.integers(min_value=1, max_value=5))
def test_list_gives_visible_keys_with_the_prefix_after_the_cursor_in_order(
        keys, dead, prefix, after, limit):
    t = EntryTable()
    for k in keys:
        t.insert(k, 1, 1, 1, 0, 1, 1 if k in dead else 0, 2)
    alive = b"\x01\x00"
    got = [t.key(s) for s in t.list(prefix, after, limit, alive)]
    want = sorted(k for k in keys - dead if k.startswith(prefix) and (not after or k > after))
    assert got == want[:limit]
