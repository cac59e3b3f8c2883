"""StoreNode over DRAM + SSD (real shm segment, real lmdb): demotion, promotion, pins,
lookahead protection, blocked eviction, failed copies, restart. No network.

Most tests drive the mover by hand (``start_mover=False`` + ``settle()``) so every
step is deterministic; one runs the real mover thread with writers waiting on it.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from kvstore.errors import NoSpace, NotFound
from kvstore.keys import value_checksum
from kvstore.types import EventKind
from kvstore.store.node import StoreNode
from kvstore.types import TierKind
from kvstore.store.tiers.dram import DramTier
from kvstore.store.tiers.ssd import SsdTier
from waits import wait_until

KiB, MiB = 1024, 1024 * 1024
DRAM = 64 * KiB
OBJ = 4 * KiB


def make_node(path, ssd_bytes=1 * MiB, policy="lru", start_mover=False, map_size=None,
              room_wait_s=2.0) -> StoreNode:
    return StoreNode([DramTier(DRAM), SsdTier(str(path), ssd_bytes, map_size)], policy,
                     high_watermark=0.75, low_watermark=0.5, room_wait_s=room_wait_s,
                     start_mover=start_mover)


@pytest.fixture
def node(tmp_path):
    n = make_node(tmp_path / "ssd")
    try:
        yield n
    finally:
        n.close()


def value(i: int, size: int = OBJ) -> bytes:
    return bytes([i % 251]) * 8 + os.urandom(size - 8) if size >= 8 else bytes([i % 251]) * size


def write(node: StoreNode, key: str, data: bytes, object_id: int, settle: bool = True) -> None:
    obj, present = node.begin_write(key, object_id, len(data), value_checksum(data))
    if not present:
        node.write_view(obj)[:] = data
        node.commit_write(obj)
    if settle and node.mover is not None and not node.mover.running:
        node.mover.settle()


def read(node: StoreNode, key: str) -> bytes:
    if node.mover is not None and not node.mover.running:
        node.mover.settle()                           # room for a promotion, as the thread would
    obj = node.acquire(key)
    try:
        return bytes(node.read_view(obj))
    finally:
        node.release(obj)


def tier_of(node: StoreNode, key: str) -> TierKind:
    return {k: t for k, _, _, _, t in node.holdings()}[key]


def check(node: StoreNode) -> None:
    node.check_invariants(idle=True)
    for t in node.stats().tiers:
        assert t.used_bytes + t.free_bytes == t.capacity_bytes


def fill(node: StoreNode, n: int, start: int = 0, prefix: str = "k") -> dict[str, bytes]:
    out = {}
    for i in range(start, start + n):
        out[f"{prefix}{i}"] = value(i)
        write(node, f"{prefix}{i}", out[f"{prefix}{i}"], object_id=i + 1)
    return out


def test_dram_victims_are_demoted_then_promoted_on_read(node):
    values = fill(node, 40)
    st = node.stats()
    dram, ssd = st.tiers
    assert dram.used_bytes <= 0.75 * DRAM and ssd.num_objects > 0
    events = [e for e in node.take_events() if e.kind is not EventKind.STORED]
    assert events and all(e.kind is EventKind.DEMOTED and e.tier is TierKind.SSD for e in events)
    assert st.counters["demotions"] == ssd.num_objects and st.counters["evictions"] == 0
    check(node)
    on_ssd = [k for k in values if tier_of(node, k) is TierKind.SSD]
    for k in on_ssd:                                  # an SSD hit promotes to DRAM
        assert read(node, k) == values[k]
        node.mover.settle()
    promoted = [e for e in node.take_events() if e.kind is EventKind.PROMOTED]
    assert {e.key for e in promoted} == set(on_ssd)
    assert all(e.tier is TierKind.DRAM for e in promoted)
    assert all(read(node, k) == v for k, v in values.items())   # nothing lost: SSD had room
    check(node)


def test_a_promoted_object_keeps_its_ssd_copy(node):
    values = fill(node, 40)
    key = next(k for k in values if tier_of(node, k) is TierKind.SSD)
    assert read(node, key) == values[key]             # promoted; the SSD copy stays
    demotions = node.counters["demotions"]
    node.take_events()
    fill(node, 20, start=100)                         # push it out of DRAM again
    assert tier_of(node, key) is TierKind.SSD
    assert any(e.key == key and e.kind is EventKind.DEMOTED for e in node.take_events())
    ssd_writes_for_new = node.counters["demotions"] - demotions
    assert ssd_writes_for_new <= 20                   # the old object needed no new copy
    assert read(node, key) == values[key]
    check(node)


def test_an_object_being_read_stays_in_dram(node):
    values = fill(node, 4)
    obj = node.acquire("k0")                          # a reader holds it
    fill(node, 60, start=10)
    assert obj.alloc is not None and bytes(node.read_view(obj)) == values["k0"]
    assert tier_of(node, "k0") is TierKind.DRAM
    node.release(obj)
    fill(node, 20, start=100)
    assert tier_of(node, "k0") is TierKind.SSD        # released: it may go now
    check(node)


def test_hard_pins_stay_soft_pins_go_last(node):
    fill(node, 1)
    node.pin("k0", ttl_ms=60_000)                     # soft, and the LRU victim
    fill(node, 12, start=1)                           # 52 KiB > 48: reclaim 20 KiB
    assert tier_of(node, "k0") is TierKind.DRAM       # unpinned victims were enough
    assert tier_of(node, "k1") is TierKind.SSD
    dram_keys = [k for k, t in {k: tier_of(node, k) for k in
                                (f"k{i}" for i in range(13))}.items() if t is TierKind.DRAM]
    fill(node, 4, start=13)                           # back to 48 KiB: no reclaim
    for k in dram_keys + [f"k{i}" for i in range(13, 17)]:
        if k != "k0":
            node.pin(k)                               # hard
    fill(node, 1, start=17)                           # 52 KiB: only k17 and k0 may go
    assert tier_of(node, "k17") is TierKind.SSD
    assert tier_of(node, "k0") is TierKind.SSD        # the soft pin made it last, not never
    assert all(tier_of(node, f"k{i}") is TierKind.DRAM for i in range(13, 17))
    assert node.unpin("k13") is True and node.unpin("k13") is False
    fill(node, 20, start=100)
    assert tier_of(node, "k13") is TierKind.SSD
    assert tier_of(node, "k14") is TierKind.DRAM
    check(node)


def test_nothing_evictable_says_why(node):
    fill(node, 12)                                    # 48 KiB: at the high watermark
    for i in range(12):
        node.pin(f"k{i}")
    write(node, "k12", value(12), object_id=13, settle=False)   # above it now, all pinned
    write(node, "k13", value(13), object_id=14, settle=False)
    node.pin("k12")
    node.pin("k13")
    node.mover.settle()
    dram = node.stats().tiers[0]
    assert dram.evictable_bytes == 0 and dram.num_pinned == 14
    assert "hard-pinned" in dram.eviction_blocked and "14 hard-pinned" in dram.eviction_blocked
    for i in range(14, 30):                            # fill what is left, then one more
        try:
            write(node, f"k{i}", value(i), object_id=i + 1, settle=False)
            node.pin(f"k{i}")
        except NoSpace as exc:
            assert "nothing evictable" in str(exc) and "hard-pinned" in str(exc)
            break
    else:
        pytest.fail("a node full of hard-pinned objects accepted every write")


def test_prefetch_promotes_protects_and_counts(node):
    values = fill(node, 40)
    cold = [k for k in values if tier_of(node, k) is TierKind.SSD]
    key, late = cold[0], cold[1]
    assert node.prefetch(key, deadline_ms=60_000) is False      # not in DRAM yet
    node.mover.settle()                                          # the mover promotes it
    assert tier_of(node, key) is TierKind.DRAM
    fill(node, 40, start=200)                                    # pressure: it is protected
    assert tier_of(node, key) is TierKind.DRAM
    assert node.stats().tiers[0].num_protected == 1
    assert read(node, key) == values[key]                        # first read: used
    assert node.counters["prefetch_used"] == 1
    fill(node, 40, start=300)
    assert tier_of(node, key) is TierKind.SSD                    # no longer protected
    node.prefetch(late, deadline_ms=30)
    time.sleep(0.06)                  # on purpose: the prefetch's 30 ms deadline passes unread
    node.mover.settle()
    assert node.counters["prefetch_wasted"] == 1 and node.counters["prefetches"] == 2
    with pytest.raises(NotFound):
        node.prefetch("missing", deadline_ms=100)
    check(node)


def test_a_failed_demotion_is_an_eviction(tmp_path):
    # The SSD's accounting admits more than its lmdb map holds: commits fail.
    node = make_node(tmp_path / "tiny", ssd_bytes=256 * KiB, map_size=256 * KiB)
    try:
        values = fill(node, 80)
        events = node.take_events()
        evicted = {e.key for e in events if e.kind is EventKind.EVICTED}
        assert node.counters["demotion_failures"] > 0 and evicted
        for k, v in values.items():
            try:
                assert read(node, k) == v
            except NotFound:
                evicted |= {e.key for e in node.take_events() if e.kind is EventKind.EVICTED}
                assert k in evicted                   # gone only where an event said so
        check(node)
    finally:
        node.close()


def test_restart_keeps_ssd_forgets_dram(tmp_path):
    path = tmp_path / "ssd"
    node = make_node(path)
    values = fill(node, 40)
    placed = {k: t for k, _, _, _, t in node.holdings()}
    node.close()
    again = make_node(path)
    try:
        held = {k: t for k, _, _, _, t in again.holdings()}
        assert set(held) == {k for k, t in placed.items() if t is TierKind.SSD}
        assert set(held.values()) == {TierKind.SSD}
        assert again.counters["recovered"] == len(held)
        for k in placed:
            if k in held:
                assert read(again, k) == values[k]    # promoted from the recovered SSD copy
            else:
                with pytest.raises(NotFound):
                    again.acquire(k)
        again.mover.settle()
        check(again)
    finally:
        again.close()


def test_writers_wait_for_the_mover_thread(tmp_path):
    # The wait is generous: the mover's SSD commits are fsyncs, which a busy CI disk
    # can hold for seconds; what is checked is that writers wait instead of failing.
    node = make_node(tmp_path / "ssd", ssd_bytes=4 * MiB, start_mover=True, room_wait_s=30.0)
    try:
        values: dict[str, bytes] = {}

        def writer(base: int) -> None:
            for i in range(base, base + 60):
                values[f"w{i}"] = value(i, 8 * KiB)
                write(node, f"w{i}", values[f"w{i}"], object_id=i + 1)

        threads = [threading.Thread(target=writer, args=(b,)) for b in (0, 1000)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(values) == 120                         # 960 KiB through 64 KiB of DRAM
        assert all(read(node, k) == v for k, v in values.items())
        assert node.counters["evictions"] == 0
        node.check_invariants()
    finally:
        node.close()


def test_gpu_tier_code_path_on_a_cpu_device(tmp_path):
    """DRAM -> GPU -> SSD with the GPU tier's own code on torch's CPU device (no CUDA here;
    tests/gpu runs it on a real device): victims fall through both tiers and come back."""
    from kvstore.store.tiers.gpu import GpuTier

    gpu = GpuTier(32 * KiB, device="cpu")
    node = StoreNode([DramTier(DRAM), gpu, SsdTier(str(tmp_path / "ssd"), 1 * MiB)], "lru",
                     high_watermark=0.75, low_watermark=0.5, start_mover=False)
    try:
        assert [lv.tier.kind for lv in node.levels] == [TierKind.DRAM, TierKind.GPU, TierKind.SSD]
        values = fill(node, 60)
        placed = {k: t for k, _, _, _, t in node.holdings()}
        assert set(placed.values()) == {TierKind.DRAM, TierKind.GPU, TierKind.SSD}
        assert node.counters["evictions"] == 0
        check(node)
        for k, v in values.items():                   # GPU and SSD hits promote to DRAM
            assert read(node, k) == v
        kinds = {e.tier for e in node.take_events() if e.kind is EventKind.DEMOTED}
        assert kinds == {TierKind.GPU, TierKind.SSD}
        node.mover.settle()
        check(node)
    finally:
        node.close()


@pytest.mark.parametrize("policy", ["default", "lru"])
def test_concurrent_mix_never_returns_wrong_bytes(tmp_path, policy):
    """Threads write, read (DRAM or not), hold, drop, pin and prefetch at random over a small
    DRAM + SSD with the real mover thread: no wrong bytes, no broken accounting, no error
    other than the expected NoSpace / NotFound."""
    import random

    node = StoreNode([DramTier(256 * KiB), SsdTier(str(tmp_path / "ssd"), 1 * MiB)], policy,
                     high_watermark=0.8, low_watermark=0.5, room_wait_s=0.5)
    pool = os.urandom(64 * KiB)

    def val(i: int, oid: int) -> bytes:
        size = (i * 37 % 23 + 1) * KiB + oid % 7
        off = (i * 131 + oid) % (len(pool) - size)
        return pool[off:off + size]

    errors: list = []
    stop = time.monotonic() + 3.0

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        held = []
        oid = seed * 1_000_000
        while time.monotonic() < stop:
            i = rng.randrange(100)
            k = f"k{i}"
            op = rng.random()
            try:
                if op < 0.35:
                    oid += 1
                    data = val(i, oid)
                    obj, present = node.begin_write(k, oid, len(data), value_checksum(data),
                                                    f"k{i - 1}" if rng.random() < 0.5 else None)
                    if not present:
                        node.write_view(obj)[:] = data
                        node.commit_write(obj)
                elif op < 0.7:
                    obj = node.acquire(k, require_dram=rng.random() < 0.5)
                    try:
                        if obj.alloc is not None:
                            got = bytes(node.read_view(obj))
                        else:
                            buf = memoryview(bytearray(obj.size_bytes))
                            node.read_into(obj, buf)
                            got = bytes(buf)
                        if got != val(i, obj.object_id):
                            errors.append(("wrong bytes", k, obj.object_id))
                        if rng.random() < 0.2:
                            held.append(obj)
                            obj = None
                    finally:
                        if obj is not None:
                            node.release(obj)
                elif op < 0.78:
                    node.drop(k)
                elif op < 0.85:
                    node.pin(k, ttl_ms=rng.choice([0, 50]))
                    if rng.random() < 0.9:
                        node.unpin(k)
                elif op < 0.92:
                    node.prefetch(k, deadline_ms=rng.choice([20, 200]))
                else:
                    node.take_events()
                if held and rng.random() < 0.3:
                    node.release(held.pop(0))
            except (NoSpace, NotFound):
                pass
            except Exception as exc:   # anything else is a bug
                errors.append(repr(exc))
        for obj in held:
            node.release(obj)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert node.counters["puts"] > 100 and node.counters["demotions"] > 0
        assert node.counters["promotions"] > 0
        def settled() -> bool:        # the mover finished what it started
            node.mover.wake()
            st = node.stats()
            return st.num_referenced == 0 and st.num_doomed == 0
        wait_until(settled, interval_s=0.02, what="the mover to finish its moves")
        node.check_invariants()
        st = node.stats()
        for t in st.tiers:
            assert t.used_bytes + t.free_bytes == t.capacity_bytes
    finally:
        node.close()


def test_a_mover_round_plans_a_bounded_batch(tmp_path, monkeypatch):
    # Rounds plan at most MOVE_BATCH_OBJECTS demotions each (lock holds stay short
    # with small objects); rounds go on until DRAM is under its low mark.
    from kvstore.store import tiering
    from kvstore.store.mover import run_moves

    monkeypatch.setattr(tiering, "MOVE_BATCH_OBJECTS", 3)
    n = make_node(tmp_path / "ssd")
    try:
        values = [value(i) for i in range(14)]          # 56 KiB: past the high mark (48)
        for i, v in enumerate(values):
            write(n, f"k{i}", v, object_id=i + 1, settle=False)
        work, sizes = n._tiering, []
        while moves := work.plan_reclaim():
            sizes.append(len(moves))
            run_moves(work.tiers, moves)
            work.finish_moves(moves)
        assert max(sizes) == 3 and len(sizes) >= 2      # several bounded rounds ...
        assert n.levels[0].tier.used_bytes <= 0.5 * DRAM    # ... down to the low mark
        assert [read(n, f"k{i}") for i in range(14)] == values
    finally:
        n.close()
