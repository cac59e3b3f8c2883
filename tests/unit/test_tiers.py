"""The tier interface on the real DRAM (shm) and SSD (lmdb) tiers: accounting, bytes, restarts."""

from __future__ import annotations

import os

import lmdb
import pytest

from kvstore.keys import value_checksum
from kvstore.store.tiers.base import ObjectRecord, RecoveryDrops, TierIOError, copy_between
from kvstore.types import TierKind
from kvstore.store.tiers.dram import DramTier
from kvstore.store.tiers.ssd import PAGE_BYTES, SsdInUse, SsdTier, slot_of

KiB, MiB = 1024, 1024 * 1024


def record(key: str, data: bytes, object_id: int = 1, parent: str | None = None,
           replica_num: int = 0) -> ObjectRecord:
    return ObjectRecord(key, object_id, len(data), value_checksum(data), parent, replica_num)


@pytest.fixture
def ssd(tmp_path):
    tier = SsdTier(str(tmp_path / "ssd"), 1 * MiB)
    try:
        yield tier
    finally:
        tier.close()


def check(tier) -> None:
    tier.check_invariants()
    assert tier.used_bytes + tier.free_bytes == tier.capacity_bytes


def test_ssd_accounting_rounds_to_pages_and_adds_up(ssd):
    assert ssd.kind is TierKind.SSD and ssd.persistent
    extents = [ssd.allocate(record(f"k{i}", b"x" * n, i + 1))
               for i, n in enumerate([0, 1, PAGE_BYTES, PAGE_BYTES + 1])]
    assert [e.reserved_bytes for e in extents] == [PAGE_BYTES, PAGE_BYTES, PAGE_BYTES,
                                                   2 * PAGE_BYTES]
    assert ssd.used_bytes == 5 * PAGE_BYTES
    check(ssd)
    for e in extents:
        ssd.free(e)
    assert ssd.used_bytes == 0
    with pytest.raises(ValueError):
        ssd.free(extents[0])                     # a double free is a bug
    check(ssd)


def test_ssd_full_is_a_return_value(ssd):
    data = b"f" * (256 * KiB)
    held = [ssd.allocate(record(f"k{i}", data, i + 1)) for i in range(4)]
    assert all(held) and ssd.free_bytes == 0
    assert ssd.allocate(record("one-more", b"z")) is None
    check(ssd)


def test_ssd_write_read_and_copy_from_dram(ssd):
    dram = DramTier(64 * KiB)
    try:
        data = os.urandom(10_000)
        src = dram.allocate(record("k", data))
        dram.view(src)[:] = data
        dst = ssd.allocate(record("k", data))
        copy_between(dram, src, ssd, dst)           # DRAM has a view: written from it directly
        back = dram.allocate(record("k", data))
        copy_between(ssd, dst, dram, back)          # and read straight into DRAM
        assert bytes(dram.view(back)) == data
        out = memoryview(bytearray(len(data)))
        ssd.read_into(dst, out)
        assert bytes(out) == data
        check(dram)
        check(ssd)
    finally:
        dram.close()


def test_ssd_survives_reopen_and_drops_bad_records(tmp_path):
    path = str(tmp_path / "ssd")
    tier = SsdTier(path, 1 * MiB)
    values = {f"k{i}": os.urandom(3000 + i) for i in range(5)}
    extents = {}
    for i, (k, v) in enumerate(values.items()):
        extents[k] = tier.allocate(record(k, v, i + 10, parent=f"p{i}", replica_num=i))
    tier.write_many([(extents[k], memoryview(v)) for k, v in values.items()])
    tier.free(extents["k4"])                         # freed: must not come back
    tier.claim("n7")
    tier.close()
    # Corrupt k0's bytes on disk (same length, different content).
    env = lmdb.open(path, max_dbs=3)
    with env.begin(write=True) as txn:
        txn.put(slot_of("k0", 10), b"\0" * len(values["k0"]), db=env.open_db(b"data", txn=txn))
    env.close()

    again = SsdTier(path, 1 * MiB)
    try:
        assert again.owner == "n7"
        found = {r.key: (r, e) for r, e in again.recover()}
        assert sorted(found) == ["k1", "k2", "k3"]
        assert again.dropped == RecoveryDrops(corrupt=1)
        r, e = found["k2"]
        assert (r.object_id, r.size_bytes, r.parent) == (12, len(values["k2"]), "p2")
        assert r.replica_num == 2                        # what its put asked for, kept
        out = memoryview(bytearray(r.size_bytes))
        again.read_into(e, out)
        assert bytes(out) == values["k2"]
        assert again.used_bytes == sum(e.reserved_bytes for _, e in found.values())
        check(again)
    finally:
        again.close()


def test_ssd_path_is_one_process_at_a_time(ssd):
    with pytest.raises(SsdInUse):
        SsdTier(ssd.path, 1 * MiB)


def test_ssd_map_full_is_a_tier_io_error(tmp_path):
    # Capacity as large as the map: the accounting admits more than lmdb can hold.
    tier = SsdTier(str(tmp_path / "tiny"), 256 * KiB, map_size_bytes=256 * KiB)
    try:
        data = b"m" * (60 * KiB)
        extents = [tier.allocate(record(f"k{i}", data, i + 1)) for i in range(4)]
        with pytest.raises(TierIOError):
            tier.write_many([(e, memoryview(data)) for e in extents])
    finally:
        tier.close()


def test_dram_tier_speaks_the_interface():
    dram = DramTier(4 * KiB)
    try:
        assert dram.kind is TierKind.DRAM and not dram.persistent
        e = dram.allocate(record("k", b"abc"))
        dram.write_many([(e, memoryview(b"abc"))])
        out = bytearray(3)
        dram.read_into(e, memoryview(out))
        assert out == b"abc" and bytes(dram.view(e)) == b"abc"
        assert dram.largest_free_bytes() == 4 * KiB - 64
        check(dram)
    finally:
        dram.close()
