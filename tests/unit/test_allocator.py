"""Tests for kvstore.store.allocator.OffsetAllocator."""

from __future__ import annotations

import random
import time

import pytest

from kvstore.store.allocator import Allocation, OffsetAllocator


def test_fresh_allocator():
    a = OffsetAllocator(1 << 20)
    assert (a.capacity_bytes, a.used_bytes, a.free_bytes) == (1 << 20, 0, 1 << 20)
    assert a.largest_free_bytes == 1 << 20
    assert (a.num_allocations, a.num_free_extents) == (0, 1)
    a.check_invariants()


def test_alignment_and_rounding():
    a = OffsetAllocator(4096, alignment=64)
    x = a.allocate(1)
    y = a.allocate(64)
    z = a.allocate(65)
    assert x == Allocation(offset=0, size_bytes=1, reserved_bytes=64)
    assert y == Allocation(offset=64, size_bytes=64, reserved_bytes=64)
    assert z == Allocation(offset=128, size_bytes=65, reserved_bytes=128)
    assert z.end == 256
    assert a.used_bytes == 256
    assert a.used_bytes + a.free_bytes == a.capacity_bytes
    b = OffsetAllocator(1 << 16, alignment=4096)
    offsets = [b.allocate(s).offset for s in (1, 5000, 4096, 3)]
    assert offsets == [0, 4096, 12288, 16384]
    a.check_invariants()
    b.check_invariants()


def test_zero_byte_allocation_reserves_one_unit():
    a = OffsetAllocator(256, alignment=64)
    z1, z2 = a.allocate(0), a.allocate(0)
    assert z1.size_bytes == 0 and z1.reserved_bytes == 64
    assert z1.offset != z2.offset
    assert a.used_bytes == 128
    a.free(z1)
    a.free(z2)
    assert a.used_bytes == 0
    with pytest.raises(ValueError):
        a.free(z1)
    a.check_invariants()


def test_bad_arguments():
    with pytest.raises(ValueError):
        OffsetAllocator(-1)
    with pytest.raises(ValueError):
        OffsetAllocator(1024, alignment=48)
    with pytest.raises(ValueError):
        OffsetAllocator(1024).allocate(-1)


def test_out_of_space_is_none():
    a = OffsetAllocator(1024)
    assert a.allocate(1025) is None
    full = a.allocate(1024)
    assert full is not None and a.free_bytes == 0 and a.largest_free_bytes == 0
    assert a.allocate(1) is None
    assert a.allocate(0) is None
    assert OffsetAllocator(0).allocate(0) is None


def test_double_free_and_foreign_free_raise():
    a = OffsetAllocator(1024)
    x = a.allocate(100)
    a.free(x)
    with pytest.raises(ValueError, match="double free"):
        a.free(x)
    b = OffsetAllocator(1024)
    y = b.allocate(100)
    a.allocate(200)  # offset 0 is live in `a`, with another size
    with pytest.raises(ValueError):
        a.free(y)
    with pytest.raises(ValueError):
        a.free(Allocation(offset=512, size_bytes=64, reserved_bytes=64))
    a.check_invariants()


def test_fragmentation_returns_none_though_free_bytes_suffice():
    a = OffsetAllocator(64 * 10, alignment=64)
    blocks = [a.allocate(64) for _ in range(10)]
    for blk in blocks[::2]:
        a.free(blk)
    assert a.free_bytes == 320
    assert a.largest_free_bytes == 64
    assert a.num_free_extents == 5
    assert a.allocate(128) is None
    a.check_invariants()
    # Freeing one neighbour coalesces three extents into one of 192 bytes.
    a.free(blocks[1])
    assert a.largest_free_bytes == 192
    assert a.allocate(128).offset == 0
    a.check_invariants()


def test_best_fit_picks_smallest_sufficient_extent():
    a = OffsetAllocator(64 * 16, alignment=64)
    blocks = [a.allocate(64 * n) for n in (4, 1, 2, 1, 1, 1, 6)]
    a.free(blocks[0])  # 256-byte hole at 0
    a.free(blocks[2])  # 128-byte hole at 320
    a.free(blocks[4])  # 64-byte hole at 512
    assert a.allocate(100).offset == 320  # 128 fits best
    assert a.allocate(10).offset == 512
    assert a.allocate(200).offset == 0
    a.check_invariants()


def test_coalesces_back_to_one_extent():
    a = OffsetAllocator(1 << 20)
    allocs = [a.allocate(100 + 37 * i) for i in range(200)]
    assert all(x is not None for x in allocs)
    random.Random(7).shuffle(allocs)
    for x in allocs:
        a.free(x)
    assert a.num_free_extents == 1
    assert a.largest_free_bytes == a.free_bytes == 1 << 20
    assert a.used_bytes == 0 and a.num_allocations == 0
    a.check_invariants()


def test_unaligned_capacity_tail_is_usable():
    a = OffsetAllocator(1000, alignment=64)
    big = a.allocate(900)
    assert big.reserved_bytes == 960
    assert a.largest_free_bytes == 40
    tail = a.allocate(40)  # does not round up to 64: clipped at capacity
    assert tail == Allocation(offset=960, size_bytes=40, reserved_bytes=40)
    assert a.free_bytes == 0
    a.free(tail)
    assert a.allocate(41) is None
    zero = a.allocate(0)
    assert zero.reserved_bytes == 40
    a.free(zero)
    a.free(big)
    assert a.allocate(1000).reserved_bytes == 1000
    a.check_invariants()


def test_largest_free_bytes_is_always_allocatable():
    rng = random.Random(3)
    a = OffsetAllocator(100_000, alignment=64)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            x = a.allocate(rng.randrange(0, 3000))
            if x is not None:
                live.append(x)
        largest = a.largest_free_bytes
        if largest:
            probe = a.allocate(largest)
            assert probe is not None
            a.free(probe)
            assert a.allocate(largest + 1) is None
    a.check_invariants()


def test_randomized_invariants_20k_ops():
    rng = random.Random(20240611)
    capacity = 8 << 20
    a = OffsetAllocator(capacity, alignment=64)
    live: dict[int, Allocation] = {}
    failures = 0
    for step in range(20_000):
        if live and rng.random() < 0.48:
            off = rng.choice(list(live)) if len(live) < 64 else next(iter(live))
            a.free(live.pop(off))
        else:
            size = rng.choice((0, rng.randrange(1, 256), rng.randrange(256, 64 << 10), rng.randrange(1, 512 << 10)))
            x = a.allocate(size)
            if x is None:
                failures += 1
                assert a.largest_free_bytes < -(-max(size, 1) // 64) * 64
            else:
                assert x.offset % 64 == 0
                assert x.offset + x.size_bytes <= capacity
                assert x.offset not in live
                live[x.offset] = x
        assert a.used_bytes + a.free_bytes == capacity
        assert a.num_allocations == len(live)
        if step % 1000 == 0:
            a.check_invariants()
    a.check_invariants()
    for x in list(live.values()):
        a.free(x)
    assert a.num_free_extents == 1 and a.free_bytes == capacity
    a.check_invariants()


def test_micro_timing_printout(capsys):
    """Not asserted: prints allocate/free cost for a loaded allocator."""
    rng = random.Random(1)
    a = OffsetAllocator(1 << 34)  # 16 GiB segment
    live = [a.allocate(rng.randrange(1, 1 << 20)) for _ in range(20_000)]
    for x in live[::2]:
        a.free(x)  # ~10k free extents
    n = 20_000
    sizes = [rng.randrange(1, 1 << 20) for _ in range(n)]
    t0 = time.perf_counter()
    got = [a.allocate(s) for s in sizes]
    t1 = time.perf_counter()
    for x in got:
        if x is not None:
            a.free(x)
    t2 = time.perf_counter()
    with capsys.disabled():
        print(
            f"\n[allocator] {a.num_free_extents} free extents: "
            f"allocate {1e6 * (t1 - t0) / n:.2f} us, free {1e6 * (t2 - t1) / n:.2f} us per call"
        )
