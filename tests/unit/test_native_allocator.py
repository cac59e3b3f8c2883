"""The native offset allocator (kvstore._native.OffsetAllocatorCore) against a naive model.

The model is the allocator's contract written the slow, obvious way: a plain
list of free extents scanned in full for the best fit, merged with its
neighbours by a scan. Hypothesis drives both with the same random allocate /
free / stale-free sequence; every answer and every accounting figure must agree.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvstore._native import Allocation, OffsetAllocatorCore


class ModelAllocator:
    """Best fit by scanning a list of (start, length) free extents; O(n) everything."""

    def __init__(self, capacity: int, alignment: int):
        self.capacity, self.alignment = capacity, alignment
        self.free = [(0, capacity)] if capacity else []
        self.live: dict[int, tuple[int, int]] = {}   # offset -> (serial, reserved)

    def allocate(self, size: int, serial: int):
        need = max(size, 1)
        want = -(-need // self.alignment) * self.alignment
        fits = [(length, start) for start, length in self.free if length >= want]
        if fits:
            length, start = min(fits)
            reserved = want
        else:
            tail = [(s, n) for s, n in self.free if s + n == self.capacity]
            if not tail or tail[0][0] + need > self.capacity:
                return None
            start, length = tail[0]
            reserved = min(want, length)
        self.free.remove((start, length))
        if length > reserved:
            self.free.append((start + reserved, length - reserved))
        self.live[start] = (serial, reserved)
        return start, reserved

    def release(self, offset: int, serial: int, reserved: int) -> bool:
        if self.live.get(offset) != (serial, reserved):
            return False
        del self.live[offset]
        start, end = offset, offset + reserved
        for s, n in list(self.free):
            if s + n == start:
                self.free.remove((s, n))
                start = s
            elif s == end:
                self.free.remove((s, n))
                end = s + n
        self.free.append((start, end - start))
        return True

    @property
    def used(self) -> int:
        return sum(r for _, r in self.live.values())


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.core = None
        self.model = None
        self.handed: list[Allocation] = []   # every handle ever given out

    @precondition(lambda self: self.core is None)
    @rule(units=st.integers(0, 64), extra=st.integers(0, 63),
          alignment=st.sampled_from([1, 8, 64, 4096]))
    def start(self, units, extra, alignment):
        capacity = units * 64 + extra
        self.core = OffsetAllocatorCore(capacity, alignment)
        self.model = ModelAllocator(capacity, alignment)

    @precondition(lambda self: self.core is not None)
    @rule(size=st.one_of(st.just(0), st.integers(1, 200), st.integers(200, 5000)))
    def allocate(self, size):
        got = self.core.allocate(size)
        want = self.model.allocate(size, got.serial if got is not None else 0)
        if got is None:
            assert want is None
        else:
            assert (got.offset, got.reserved_bytes) == want and got.size_bytes == size
            assert not self.handed or got.serial > self.handed[-1].serial   # unique, increasing
            self.handed.append(got)

    @precondition(lambda self: self.core is not None and self.handed)
    @rule(data=st.data())
    def free(self, data):
        # Any handle ever given out: live ones free, the rest are double frees.
        handle = data.draw(st.sampled_from(self.handed))
        ok = self.model.release(handle.offset, handle.serial, handle.reserved_bytes)
        if ok:
            self.core.free(handle)
        else:
            with pytest.raises(ValueError, match="double free"):
                self.core.free(handle)

    @invariant()
    def agree(self):
        if self.core is None:
            return
        m = self.model
        assert self.core.used == m.used
        assert self.core.used + self.core.free_bytes == m.capacity
        assert self.core.num_allocations == len(m.live)
        assert self.core.num_free_extents == len(m.free)
        assert self.core.largest_free == max((n for _, n in m.free), default=0)
        assert self.core.check() == ""


TestAllocatorModel = AllocatorMachine.TestCase
TestAllocatorModel.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)


def test_bad_alignment_raises_value_error():
    with pytest.raises(ValueError, match="power of two"):
        OffsetAllocatorCore(1024, 48)


def test_a_capacity_of_2_40_units_or_more_is_refused():
    with pytest.raises(ValueError, match="2\\*\\*40"):
        OffsetAllocatorCore(1 << 46, 64)        # the live table keeps offsets in 40 bits


def test_offsets_past_32_bits_of_units_and_stray_offsets():
    core = OffsetAllocatorCore((1 << 46) - (1 << 20), 64)    # 2**40 - 2**14 units
    far = [core.allocate(1 << 40) for _ in range(63)]         # offsets up to 62 TiB
    assert far[-1].offset == 62 << 40 and core.check() == ""
    near = core.allocate(100)
    with pytest.raises(ValueError, match="not live here"):
        core.free(Allocation(near.offset + 1, 100, 128, near.serial))   # unaligned
    for h in [near, *far]:
        core.free(h)
    assert core.used == 0 and core.num_free_extents == 1 and core.check() == ""


def test_huge_request_is_no_room_not_an_overflow():
    core = OffsetAllocatorCore(1 << 20, 64)
    assert core.allocate((1 << 64) - 1) is None
    assert core.allocate((1 << 64) - 64) is None
    assert core.check() == ""


def test_live_table_grows_and_shrinks_back_to_one_extent():
    core = OffsetAllocatorCore(64 * 100_000, 64)
    handles = [core.allocate(64) for _ in range(100_000)]
    assert core.free_bytes == 0 and core.num_allocations == 100_000
    assert core.live_table_bytes <= 32 * 100_000     # 12-byte slots, at least 3/8 full
    assert core.check() == ""
    for handle in handles[::2] + handles[1::2]:
        core.free(handle)
    assert core.num_free_extents == 1 and core.num_allocations == 0
    assert core.check() == ""


def test_allocation_handle_is_small_immutable_and_compares_by_range():
    import gc
    import sys

    a = Allocation(64, 10, 64, serial=3)
    assert (a.offset, a.size_bytes, a.reserved_bytes, a.serial, a.end) == (64, 10, 64, 3, 128)
    assert a == Allocation(offset=64, size_bytes=10, reserved_bytes=64)   # serial not compared
    assert a != Allocation(64, 11, 64) and hash(a) == hash(Allocation(64, 10, 64, 9))
    assert repr(a) == "Allocation(offset=64, size_bytes=10, reserved_bytes=64, serial=3)"
    with pytest.raises(AttributeError):
        a.offset = 0
    with pytest.raises(ValueError):
        Allocation(-1, 1, 64)
    assert sys.getsizeof(a) == 48 and not gc.is_tracked(a)
    with pytest.raises(TypeError):
        OffsetAllocatorCore(1024, 64).free((0, 1, 64))


def test_a_handle_of_another_allocator_or_with_other_sizes_frees_nothing():
    a, b = OffsetAllocatorCore(1024, 64), OffsetAllocatorCore(1024, 64)
    x, y = a.allocate(100), b.allocate(100)
    assert (x.offset, x.reserved_bytes) == (y.offset, y.reserved_bytes) and x.serial != y.serial
    with pytest.raises(ValueError, match="not live here"):
        a.free(y)
    with pytest.raises(ValueError, match="not live here"):
        a.free(Allocation(x.offset, 100, 64, x.serial))       # sizes the rule never gives
    a.free(x)
    assert a.used == 0 and a.check() == ""
