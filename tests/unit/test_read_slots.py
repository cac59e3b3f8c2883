"""Read slots in a DRAM tier's segment, as a second mapping (a same-host client) sees them."""

from __future__ import annotations

import time

import pytest

from kvstore.store.lease import MasterLease
from kvstore.store.tiers.base import ObjectRecord
from kvstore.store.tiers.dram import DramTier
from kvstore.transfer.shm import ShmSegment
from kvstore.transfer.shm_slots import OPTIMISTIC_READS, SLOT_COUNT, ReadSlots

pytestmark = pytest.mark.skipif(not OPTIMISTIC_READS, reason="copy-then-check needs x86-64")


@pytest.fixture
def tier_and_reader():
    tier = DramTier(1 << 20)
    seg = ShmSegment(tier.name)
    slots = ReadSlots.attach(seg.view)
    assert slots is not None
    yield tier, slots
    seg.close()
    tier.close()


def alloc(tier: DramTier, key: str = "k", size: int = 4096):
    return tier.allocate(ObjectRecord(key, 1, size, 0, None))


def test_published_until_hidden_or_freed(tier_and_reader):
    tier, slots = tier_and_reader
    a, b = alloc(tier, "a"), alloc(tier, "b")
    assert not slots.serves(a.serial)                # never read: not published
    tier.publish(a)
    tier.publish(b)
    assert slots.serves(a.serial) and slots.still(a.serial) and slots.serves(b.serial)
    tier.hide(a)
    assert not slots.serves(a.serial) and not slots.still(a.serial)
    assert slots.serves(b.serial)
    tier.free(b)                                     # freeing hides too
    assert not slots.serves(b.serial)
    c = alloc(tier, "c")                             # b's range again, a new serial
    assert c.offset in (a.offset, b.offset) and c.serial not in (a.serial, b.serial)
    assert not slots.serves(c.serial) and not slots.serves(0)


def test_a_colliding_serial_costs_a_round_trip_never_a_wrong_copy(tier_and_reader):
    tier, slots = tier_and_reader
    tier.slots.publish(5)
    tier.slots.publish(5 + SLOT_COUNT)               # same slot: the later one wins
    assert not slots.serves(5) and slots.serves(5 + SLOT_COUNT)
    tier.slots.hide(5)                               # not the slot's holder: no change
    assert slots.serves(5 + SLOT_COUNT)


def test_the_node_lease_bounds_unreferenced_reads(tier_and_reader):
    tier, slots = tier_and_reader
    a = alloc(tier)
    tier.publish(a)
    assert slots.serves(a.serial)                    # a node without masters: no fence
    lease = MasterLease()
    lease.watch(tier.lease)
    assert not slots.serves(a.serial)                # never granted
    lease.reset(2)
    lease.renew(0, time.monotonic(), 60_000)
    assert not slots.serves(a.serial)                # the shortest shard lease counts
    lease.renew(1, time.monotonic(), 200)
    assert slots.serves(a.serial)
    time.sleep(0.25)                                 # on purpose: the 200 ms lease lapses
    assert not slots.serves(a.serial)                # lapsed: back to the node (fenced there)
    lease.renew(1, time.monotonic(), 60_000)
    assert slots.serves(a.serial)
    tier.close()                                     # a node stopping sends readers back
    assert not slots.serves(a.serial)


def test_a_segment_without_a_table_is_read_through_the_node(tmp_path):
    seg = ShmSegment(f"kvstore-test-noslots-{time.monotonic_ns()}", 1 << 20, create=True)
    try:
        assert ReadSlots.attach(seg.view) is None
    finally:
        seg.close()
