"""StoreNode's object table over a small DramTier (a real shm segment, no network)."""

from __future__ import annotations

import json

import pytest

from kvstore.errors import ChecksumMismatch, InvalidArgument, NoSpace, NotFound, TooLarge
from kvstore.keys import value_checksum
from kvstore.store.node import ObjectState, StoreNode
from kvstore.store.stats import NodeCounter
from kvstore.store.tiers.dram import DramTier
from waits import wait_until

KiB = 1024
CAPACITY = 64 * KiB


@pytest.fixture
def node():
    tier = DramTier(CAPACITY)
    try:
        # No eviction: these tests pin down what a full node does (NoSpace).
        yield StoreNode(tier, policy="none")
    finally:
        tier.close()


def check_invariants(node: StoreNode) -> None:
    st = node.stats()
    assert st.used_bytes + st.free_bytes == st.capacity_bytes == CAPACITY
    node.tier.allocator.check_invariants()


def write(node: StoreNode, key: str, data: bytes, object_id: int = 1, checksum: int | None = None):
    obj, present = node.begin_write(key, object_id, len(data),
                                    value_checksum(data) if checksum is None else checksum)
    if present:
        return obj
    node.write_view(obj)[:] = data
    node.commit_write(obj)
    return obj


def read(node: StoreNode, key: str, object_id: int = 0) -> bytes:
    obj = node.acquire(key, object_id)
    try:
        return bytes(node.read_view(obj))
    finally:
        node.release(obj)


def test_write_commit_read(node):
    data = bytes(range(256)) * 16
    obj = write(node, "k", data, object_id=5)
    assert obj.state is ObjectState.COMPLETE and obj.refs == 0
    assert read(node, "k") == data
    assert read(node, "k", object_id=5) == data
    with pytest.raises(NotFound):
        node.acquire("k", object_id=6)
    assert node.inventory() == [("k", 5, len(data), value_checksum(data))]
    st = node.stats()
    assert (st.num_objects, st.num_writing, st.used_bytes) == (1, 0, len(data))
    check_invariants(node)


def test_the_inventory_says_how_many_replicas_the_put_asked_for(node):
    obj, _ = node.begin_write("k", 5, 3, value_checksum(b"abc"), None, replica_num=3)
    node.write_view(obj)[:] = b"abc"
    node.commit_write(obj)
    write(node, "j", b"xyz", object_id=6)             # a writer that did not say
    items = {it.key: it for it in node.inventory_items()}
    assert (items["k"].replica_num, items["j"].replica_num) == (3, 0)


def test_zero_byte_object(node):
    write(node, "empty", b"")
    assert read(node, "empty") == b""
    assert node.stats().used_bytes == 64     # one alignment unit: its own offset
    assert node.drop("empty")
    assert node.stats().used_bytes == 0
    check_invariants(node)


def test_writing_object_is_not_readable(node):
    obj, present = node.begin_write("k", 1, 100, value_checksum(b"x" * 100))
    assert not present and obj.state is ObjectState.WRITING
    with pytest.raises(NotFound):
        node.acquire("k")
    assert node.stats().num_writing == 1
    node.abort_write(obj)
    assert node.stats().used_bytes == 0
    assert node.inventory() == []
    check_invariants(node)


def test_checksum_mismatch_frees_the_space(node):
    obj, _ = node.begin_write("k", 1, 1000, checksum=value_checksum(b"a" * 1000))
    node.write_view(obj)[:] = b"b" * 1000
    with pytest.raises(ChecksumMismatch):
        node.commit_write(obj)
    st = node.stats()
    assert (st.used_bytes, st.num_objects, st.num_writing, st.num_doomed) == (0, 0, 0, 0)
    with pytest.raises(NotFound):
        node.acquire("k")
    assert node.counters["checksum_errors"] == 1
    check_invariants(node)
    # The key can be written correctly afterwards.
    write(node, "k", b"a" * 1000, object_id=2)
    assert read(node, "k") == b"a" * 1000


def test_same_version_again_is_already_present(node):
    data = b"v" * 300
    write(node, "k", data, object_id=3)
    used = node.stats().used_bytes
    obj, present = node.begin_write("k", 3, len(data), value_checksum(data))
    assert present and obj.state is ObjectState.COMPLETE
    assert node.stats().used_bytes == used
    check_invariants(node)


def test_same_version_while_writing_is_refused(node):
    obj, _ = node.begin_write("k", 3, 10, 0)
    with pytest.raises(InvalidArgument):
        node.begin_write("k", 3, 10, 0)
    node.abort_write(obj)
    check_invariants(node)


def test_new_version_replaces_the_old_one(node):
    write(node, "k", b"old" * 10, object_id=1)
    write(node, "k", b"new" * 20, object_id=2)
    assert read(node, "k") == b"new" * 20
    # A late drop order for the old version does not touch the new one.
    assert not node.drop("k", object_id=1)
    assert read(node, "k") == b"new" * 20
    assert node.stats().used_bytes == 64
    check_invariants(node)


def test_reference_held_during_read_prevents_free(node):
    data = b"\xab" * (16 * KiB)
    write(node, "k", data)
    obj = node.acquire("k")
    offset = obj.alloc.offset
    assert node.drop("k")
    # Out of service, but its memory is pinned by the reader.
    with pytest.raises(NotFound):
        node.acquire("k")
    st = node.stats()
    assert (st.num_objects, st.num_doomed, st.used_bytes) == (0, 1, len(data))
    # New writes fill the rest of the node without touching the pinned bytes.
    fillers = []
    for i in range(CAPACITY // (16 * KiB)):
        try:
            fillers.append(write(node, f"f{i}", bytes([i]) * (16 * KiB), object_id=10 + i))
        except NoSpace:
            break
    assert len(fillers) == 3
    assert all(f.alloc.offset != offset for f in fillers)
    assert bytes(node.read_view(obj)) == data
    check_invariants(node)
    # The last release frees it.
    node.release(obj)
    st = node.stats()
    assert (st.num_doomed, st.used_bytes) == (0, 3 * 16 * KiB)
    check_invariants(node)
    reused = write(node, "again", b"z" * (16 * KiB), object_id=99)
    assert reused.alloc.offset == offset


def test_drop_during_write_frees_at_commit(node):
    data = b"q" * 512
    obj, _ = node.begin_write("k", 1, len(data), value_checksum(data))
    assert node.drop("k", 1)
    assert node.stats().used_bytes == 512      # the writer still holds it
    node.write_view(obj)[:] = data
    with pytest.raises(NotFound):
        node.commit_write(obj)
    assert node.stats().used_bytes == 0
    check_invariants(node)


def test_many_readers_free_at_the_last_release(node):
    write(node, "k", b"r" * 100)
    a, b = node.acquire("k"), node.acquire("k")
    node.drop("k")
    node.release(a)
    assert node.stats().used_bytes == 128
    node.release(b)
    assert node.stats().used_bytes == 0
    with pytest.raises(AssertionError):
        node.release(b)                        # a release without a reference is a bug


def test_drop_of_missing_key_or_other_version(node):
    assert not node.drop("missing")
    write(node, "k", b"x", object_id=4)
    assert not node.drop("k", object_id=5)
    assert node.drop("k", object_id=4)
    assert not node.drop("k", object_id=4)
    assert node.counters["drops"] == 1


def test_counters_leave_the_node_by_plain_name(node):
    write(node, "k", b"x")
    node.release(node.acquire("k"))
    assert node.counters[NodeCounter.PUTS] == node.counters["puts"] == 1
    for counters in (node.stats().counters, node.refresh_usage(node.stats()).counters):
        assert all(type(name) is str for name in counters)       # the wire's keys, not the enum
        assert list(counters) == [c.value for c in NodeCounter]
        assert (counters["puts"], counters["gets"]) == (1, 1)
    assert json.loads(json.dumps(node.stats().to_dict()))["counters"] == node.stats().counters


def test_no_space_and_too_large(node):
    with pytest.raises(TooLarge):
        node.begin_write("big", 1, CAPACITY + 1, 0)
    write(node, "a", b"a" * (40 * KiB))
    with pytest.raises(NoSpace) as exc:
        node.begin_write("b", 2, 30 * KiB, 0)
    assert "30720 B" in str(exc.value)           # numbers in the message
    with pytest.raises(InvalidArgument):
        node.begin_write("neg", 3, -1, 0)
    # Nothing half-created by the refusals.
    assert [k for k, *_ in node.inventory()] == ["a"]
    st = node.stats()
    assert (st.num_writing, st.used_bytes) == (0, 40 * KiB)
    check_invariants(node)
    # Exactly what is left still fits.
    write(node, "c", b"c" * (24 * KiB), object_id=4)
    assert node.stats().free_bytes == 0
    check_invariants(node)


def test_used_plus_free_is_capacity_through_a_workload(node):
    import random

    rng = random.Random(1234)
    live: dict[str, bytes] = {}
    for step in range(400):
        if live and rng.random() < 0.45:
            key = rng.choice(sorted(live))
            assert node.drop(key)
            del live[key]
        else:
            key = f"k{step}"
            data = bytes([step % 256]) * rng.randrange(0, 6 * KiB)
            try:
                write(node, key, data, object_id=step + 1)
                live[key] = data
            except NoSpace:
                pass
        check_invariants(node)
    for key, data in live.items():
        assert read(node, key) == data


def test_pins_and_prefetches_from_the_wire_are_bounded():
    from kvstore.store.node import MAX_PREFETCH_MS, MAX_SOFT_PIN_MS

    tier = DramTier(1 << 20)
    node = StoreNode(tier)
    try:
        obj, _ = node.begin_write("k", 1, 1, value_checksum(b"x"))
        node.write_view(obj)[:] = b"x"
        node.commit_write(obj)
        node.pin("k", 1, MAX_SOFT_PIN_MS)
        node.prefetch("k", 1, MAX_PREFETCH_MS)
        for bad in (MAX_SOFT_PIN_MS + 1, 2**64 - 1):
            with pytest.raises(InvalidArgument):
                node.pin("k", 1, bad)
        for bad in (0, MAX_PREFETCH_MS + 1, 2**64 - 1):
            with pytest.raises(InvalidArgument):
                node.prefetch("k", 1, bad)
    finally:
        node.close()


def test_full_stats_recount_at_most_every_interval_and_refresh_usage_between(node):
    write(node, "a", b"x" * 1000, object_id=1)
    first = node.full_stats(3600.0)
    assert first.num_objects == 1 and first.tiers[0].num_reading == 0
    held = node.acquire("a")
    write(node, "b", b"y" * 2000, object_id=2)
    cached = node.full_stats(3600.0)
    # Within the interval: usage and counters are current, the per-object count is not.
    assert cached.used_bytes == node.stats().used_bytes > first.used_bytes
    assert cached.counters["puts"] == 2 and cached.num_objects == 2
    assert cached.tiers[0].num_reading == 0
    # With no interval the count is due again once 50 x the last count's time has
    # passed; it runs on a thread of its own and a later call sees its result.
    wait_until(lambda: node.full_stats(0.0).tiers[0].num_reading == 1, interval_s=0.01,
               what="a recount that sees the held read")
    assert node.full_stats(3600.0).num_referenced == 1
    node.release(held)


def test_stats_count_outside_the_lock_and_agree_with_a_locked_count(node):
    for i in range(20):
        write(node, f"k{i}", bytes([i]) * 100, object_id=i + 1)
    held = node.acquire("k3")
    st = node.stats()
    with node._table.cond:
        objs = list(node._table.objects.values())
    assert st.num_objects == len(objs) == 20 and st.num_referenced == 1
    assert st.tiers[0].num_reading == 1 and st.tiers[0].num_objects == 20
    node.release(held)
    assert node.stats().tiers[0].num_reading == 0


def test_a_value_above_the_high_watermark_of_an_evicting_tier_is_too_large():
    # Stored, it would be evicted at once (and everything else with it).
    tier = DramTier(CAPACITY)
    try:
        node = StoreNode(tier, policy="default", high_watermark=0.75, low_watermark=0.5)
        assert node.max_object_bytes() == 48 * KiB
        with pytest.raises(TooLarge) as exc:
            node.begin_write("big", 2, 48 * KiB + 1, 0)
        assert "high watermark" in str(exc.value)
        write(node, "fits", b"f" * (48 * KiB), object_id=3)     # alone, it stays
        assert read(node, "fits") == b"f" * (48 * KiB)
    finally:
        tier.close()


def test_a_tier_that_never_evicts_keeps_values_up_to_its_capacity(node):
    assert node.max_object_bytes() == CAPACITY
