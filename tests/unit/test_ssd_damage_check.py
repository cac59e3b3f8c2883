"""A damaged SSD directory is found before lmdb reads it, and salvaged on request.

In-process, on real lmdb files: a truncated ``data.mdb`` or a damaged
B-tree page is refused at open (:class:`SsdCorrupt`: lmdb would fault or
abort), records dropped at recovery are counted by cause, and a quarantine
copies what is intact into a fresh directory. (A real node process on such
folders: tests/integration/test_ssd_damage.py.)
"""

from __future__ import annotations

import glob
import os

import pytest

from kvstore.keys import value_checksum
from kvstore.store.tiers.base import ObjectRecord, RecoveryDrops
from kvstore.store.tiers.lmdb_file import LmdbFile
from kvstore.store.tiers.ssd import SsdCorrupt, SsdTier
from kvstore.store.tiers.ssd_salvage import quarantine

KiB, MiB = 1024, 1024 * 1024


def value_of(i: int) -> bytes:
    return bytes([i % 251]) * (5000 if i % 7 == 0 else 300 + i)   # some in overflow pages


def fill(path: str, n: int, capacity: int = 8 * MiB) -> dict[str, bytes]:
    tier = SsdTier(path, capacity)
    try:
        tier.claim("n9")
        values = {f"k/{i:04d}": value_of(i) for i in range(n)}
        items = []
        for oid, (key, value) in enumerate(values.items(), start=1):
            rec = ObjectRecord(key, oid, len(value), value_checksum(value), None, 2)
            items.append((tier.allocate(rec), memoryview(value)))
        for at in range(0, len(items), 100):
            tier.write_many(items[at:at + 100])
        return values
    finally:
        tier.close()


def meta_leaves(path: str) -> list[tuple[int, int]]:
    """(pgno, records) of each leaf of the "meta" database, in key order."""
    with LmdbFile(os.path.join(path, "data.mdb")) as f:
        return [(pgno, len(nodes)) for pgno, _raw, nodes in f.leaves(f.databases()[b"meta"])]


def zero_page(path: str, pgno: int) -> None:
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        f.seek(pgno * 4096)
        f.write(b"\0" * 4096)


def test_an_intact_directory_passes_the_check_and_recovers_whole(tmp_path):
    path = str(tmp_path / "ssd")
    values = fill(path, 300)
    tier = SsdTier(path, 8 * MiB)
    try:
        assert sorted(r.key for r, _ in tier.recover()) == sorted(values)
        assert tier.dropped == RecoveryDrops()
        assert tier.recover() is tier.recover()          # one scan
    finally:
        tier.close()


def test_records_over_a_smaller_capacity_are_dropped_as_surplus(tmp_path):
    path = str(tmp_path / "ssd")
    fill(path, 20, capacity=1 * MiB)
    tier = SsdTier(path, 40 * KiB)                       # 10 pages
    try:
        kept = tier.recover()
        assert tier.dropped.corrupt == 0
        assert tier.dropped.surplus == 20 - len(kept) > 0
        assert [r.object_id for r, _ in kept] == sorted(r.object_id for r, _ in kept)
    finally:
        tier.close()


@pytest.mark.parametrize("cut", ["to-nothing", "half", "last-page"])
def test_a_truncated_data_file_is_refused_before_lmdb_maps_it(tmp_path, cut):
    path = str(tmp_path / "ssd")
    fill(path, 300)
    data = os.path.join(path, "data.mdb")
    size = os.path.getsize(data)
    os.truncate(data, {"to-nothing": 0, "half": size // 2, "last-page": size - 4096}[cut])
    with pytest.raises(SsdCorrupt, match="truncated|no valid lmdb meta page"):
        SsdTier(path, 8 * MiB)
    SsdTier(str(tmp_path / "other"), 1 * MiB).close()     # the flock was let go: no leak


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_a_damaged_page_is_refused_and_salvage_copies_every_other_record(tmp_path, which):
    path = str(tmp_path / "ssd")
    values = fill(path, 400)
    leaves = meta_leaves(path)
    assert len(leaves) >= 4
    pgno, lost = leaves[{"first": 0, "middle": len(leaves) // 2, "last": -1}[which]]
    zero_page(path, pgno)
    with pytest.raises(SsdCorrupt, match=f"page {pgno}") as refused:
        SsdTier(path, 8 * MiB)

    tier, salvage = quarantine(path, 8 * MiB, reason=str(refused.value))
    try:
        (moved,) = glob.glob(str(tmp_path / "ssd.quarantine-*"))
        assert salvage.moved_to == moved and "QUARANTINE" in os.listdir(moved)
        assert (salvage.copied, salvage.corrupt) == (len(values) - lost, lost)
        assert tier.owner == "n9"
        found = tier.recover()
        assert tier.dropped == RecoveryDrops(corrupt=lost)
        assert len(found) == len(values) - lost
        for record, extent in found:
            out = memoryview(bytearray(record.size_bytes))
            tier.read_into(extent, out)
            assert bytes(out) == values[record.key] and record.replica_num == 2
    finally:
        tier.close()
    # The fresh directory passes the check on the next start.
    again = SsdTier(path, 8 * MiB)
    try:
        assert len(again.recover()) == len(values) - lost
    finally:
        again.close()


def test_a_damaged_value_is_dropped_as_corrupt_not_refused(tmp_path):
    path = str(tmp_path / "ssd")
    values = fill(path, 50)
    big = [k for k, v in values.items() if len(v) == 5000][1]
    blob = open(os.path.join(path, "data.mdb"), "rb").read()
    at = blob.index(values[big])                           # its overflow page, in place
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        f.seek(at + 100)
        f.write(b"\xff" * 8)
    tier = SsdTier(path, 8 * MiB)                          # the structure is whole
    try:
        found = {r.key for r, _ in tier.recover()}
        assert big not in found and len(found) == len(values) - 1
        assert tier.dropped == RecoveryDrops(corrupt=1)
    finally:
        tier.close()


@pytest.mark.parametrize("which", ["newest", "older"])
def test_a_damaged_meta_page_is_refused_and_the_other_one_salvages(tmp_path, which):
    path = str(tmp_path / "ssd")
    values = fill(path, 300)                             # three commits of 100
    with LmdbFile(os.path.join(path, "data.mdb")) as f:
        newest = f.meta().txnid % 2                      # lmdb alternates its two meta pages
    page = newest if which == "newest" else 1 - newest
    zero_page(path, page)
    with pytest.raises(SsdCorrupt, match="meta page"):
        SsdTier(path, 8 * MiB)
    tier, salvage = quarantine(path, 8 * MiB)
    try:
        if page == 0:
            expected = 0                                 # it holds the page size
        elif which == "newest":
            expected = 200                               # the commit before the last
        else:
            expected = len(values)
        assert salvage.copied == expected
        assert len(tier.recover()) == expected
    finally:
        tier.close()
