"""KeyOrder: the visible keys in order without a sort at every change (kvstore.master.key_order)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.master import key_order
from kvstore.master.key_order import KeyOrder

KEYS = st.text(alphabet="abc", min_size=1, max_size=3)
OPS = st.lists(st.tuples(st.booleans(), KEYS), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS, KEYS, st.booleans(), st.integers(min_value=1, max_value=4))
def test_reads_give_every_live_key_once_in_order(ops, start, after, rebuild_at):
    key_order.MIN_REBUILD, saved = rebuild_at, key_order.MIN_REBUILD
    try:
        order, live = KeyOrder(), set()
        for i, (add, key) in enumerate(ops):
            if add and key not in live:
                live.add(key)
                order.add(key)
            elif not add:
                live.discard(key)
            if i % 7 == 0:     # reads between the changes (and their rebuilds)
                got = [k for k in order.iterate("", False, lambda: live, len(live)) if k in live]
                assert got == sorted(live)
        got = [k for k in order.iterate(start, after, lambda: live, len(live)) if k in live]
        assert got == sorted(k for k in live if (k > start if after else k >= start))
    finally:
        key_order.MIN_REBUILD = saved


def test_a_scan_of_a_shard_being_written_sorts_rarely():
    order, live, rebuilds = KeyOrder(), [], []

    def every():
        rebuilds.append(len(live))
        return live

    for i in range(20_000):
        key = f"k{i:06d}"
        live.append(key)
        order.add(key)
        if i % 100 == 0:
            next(order.iterate("k", False, every, len(live)), None)
    # 200 reads between writes: a handful of rebuilds, not one per read.
    assert len(rebuilds) < 20
    assert list(order.iterate("k", False, every, len(live))) == live
