"""A damaged SSD folder is refused in one line, and quarantined on request (issue 31, bug 2).

A node restarted on a truncated ``data.mdb`` used to die of SIGBUS at
recovery (no log line, its shared-memory segment left behind); one with a
damaged lmdb page stopped with a traceback (``lmdb.CorruptedError``), every
intact object unreachable. Now the node checks the file against the size
lmdb's meta page records before it reads a page, refuses a corrupt folder
with one line naming ``--ssd-quarantine``, leaves no segment behind, and with
that flag moves the folder aside and starts on the objects it could still
read intact (the rest counted as ``recovery_dropped_corrupt``).

The folders are written by the SSD tier itself (what a node's demotions
write), then damaged, then served by real ``kvstore node`` processes.
"""

from __future__ import annotations

import glob
import os
import random
import struct

import lmdb
import pytest

from kvstore.client import KVClient, NotFound
from kvstore.keys import value_checksum
from kvstore.store.tiers.base import ObjectRecord
from kvstore.store.tiers.ssd import SsdTier
from kvstore.tools.cluster.processes import ChildFailed, ProcessGroup, service_args
from kvtest import wait_for

MiB = 1024 * 1024
PAGE = 4096
SSD = "64MiB"


def value_of(i: int) -> bytes:
    """Small values (in lmdb's leaf pages) and some over a page (overflow pages)."""
    return random.Random(i).randbytes(9000 if i % 10 == 0 else 700 + i)


def fill_ssd(path: str, n: int) -> dict[str, bytes]:
    """An SSD folder owned by node n0 holding ``n`` objects, written in a few commits."""
    tier = SsdTier(path, 64 * MiB)
    try:
        tier.claim("n0")
        values = {f"obj/{i:04d}": value_of(i) for i in range(n)}
        items = []
        for oid, (key, value) in enumerate(values.items(), start=1):
            extent = tier.allocate(ObjectRecord(key, oid, len(value), value_checksum(value),
                                                None, 1))
            items.append((extent, memoryview(value)))
            if len(items) == 50:
                tier.write_many(items)
                items = []
        tier.write_many(items)
        return values
    finally:
        tier.close()


def main_root_page(path: str) -> int:
    """The page every lookup starts from: the main B-tree's root in the newest meta page."""
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        metas = [f.read(PAGE), f.read(PAGE)]
    # meta page: 16 B page header, magic, version, address, map size, two MDB_db records
    # (48 B each, md_root last), then mm_last_pg and mm_txnid.
    newest = max(metas, key=lambda p: struct.unpack_from("<Q", p, 144)[0])
    return struct.unpack_from("<Q", newest, 128)[0]


def meta_db_leaves(path: str) -> tuple[list[int], int]:
    """The leaf pages of the "meta" database (one record per object) and its entries."""
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=3)
    try:
        with env.begin() as txn:
            raw = txn.get(b"meta")              # the named database's MDB_db record
            entries = txn.stat(env.open_db(b"meta", txn=txn, create=False))["entries"]
    finally:
        env.close()
    depth, root = struct.unpack_from("<H", raw, 6)[0], struct.unpack_from("<Q", raw, 40)[0]
    assert depth == 2, f"expected a root branch over leaves, depth {depth}"
    with open(os.path.join(path, "data.mdb"), "rb") as f:
        f.seek(root * PAGE)
        page = f.read(PAGE)
    flags, lower = struct.unpack_from("<HH", page, 10)
    assert flags & 0x01, "root is not a branch page"
    leaves = []
    for i in range((lower - 16) // 2):
        (at,) = struct.unpack_from("<H", page, 16 + 2 * i)
        lo, hi, high = struct.unpack_from("<HHH", page, at)
        leaves.append(lo | hi << 16 | high << 32)
    return leaves, entries


def segments_of(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/kvstore-{pid}-*")


def node_cmd(master: str, path: str, *extra: str) -> list[str]:
    return service_args("node", "--master", master, "--node-id", "n0", "--dram", "16MiB",
                        "--ssd", SSD, "--ssd-path", path, *extra)


def refused_start(procs: ProcessGroup, name: str, args: list[str], log_dir: str) -> str:
    """Start a node that must refuse to start; returns its log. Checks it exited by
    itself (no signal), in one line naming --ssd-quarantine, its segment gone."""
    with pytest.raises(ChildFailed):
        procs.start(name, args, timeout_s=60)
    child = procs.children.pop()
    rc = child.proc.wait(10)
    log = open(os.path.join(log_dir, f"{name}.log")).read()
    print(f"{name}: exit status {rc}; segments left {segments_of(child.proc.pid)}; "
          f"log tail {log.strip().splitlines()[-1:]!r}")
    assert rc > 0, f"killed by signal {-rc}"
    assert "Traceback" not in log
    (line,) = [ln for ln in log.splitlines() if "--ssd-quarantine" in ln]
    assert line.startswith("kvstore node: ")
    assert segments_of(child.proc.pid) == []
    return line


def check_served(kv: KVClient, values: dict[str, bytes]) -> int:
    """Every key reads back exact or NotFound; returns how many read back."""
    found = 0
    for key, value in values.items():
        try:
            assert kv.get(key) == value, key
            found += 1
        except NotFound:
            pass
    return found


def quarantined(tmp_path) -> list[str]:
    return sorted(glob.glob(str(tmp_path / "n0.quarantine-*")))


@pytest.mark.slow
def test_a_truncated_data_file_is_refused_then_quarantined(tmp_path):
    path = str(tmp_path / "n0")
    values = fill_ssd(path, 400)
    data = os.path.join(path, "data.mdb")
    full = os.path.getsize(data)
    cut = main_root_page(path) * PAGE          # every lookup starts beyond the end
    os.truncate(data, cut)
    logs = str(tmp_path / "logs")
    with ProcessGroup(log_dir=logs) as procs:
        master = procs.start("master", service_args("master")).address
        line = refused_start(procs, "n0", node_cmd(master, path), logs)
        assert "truncated" in line and str(cut) in line and str(full) in line
        assert os.path.getsize(data) == cut       # nothing was touched

        # Cut before the main database's root, the folder's index is gone: the node
        # starts empty, and the folder is kept aside as it was.
        node = procs.start("n0-quarantine", node_cmd(master, path, "--ssd-quarantine"))
        (moved,) = quarantined(tmp_path)
        assert os.path.getsize(os.path.join(moved, "data.mdb")) == cut
        assert "truncated" in open(os.path.join(moved, "QUARANTINE")).read()
        assert node.info["node_id"] == "n0" and node.info["recovered"] == 0
        with KVClient(master) as kv:
            assert check_served(kv, values) == 0
            kv.put("after", b"y" * 5000)
            assert kv.get("after") == b"y" * 5000
        procs.check()


@pytest.mark.slow
@pytest.mark.parametrize("leaf", ["first", "middle"])
def test_a_damaged_page_is_refused_then_the_intact_objects_are_served(tmp_path, leaf):
    # The first leaf: lmdb's scan used to stop with MDB_CORRUPTED (a traceback);
    # one in the middle: lmdb's cursor step used to abort the node (an assertion).
    path = str(tmp_path / "n0")
    values = fill_ssd(path, 400)
    leaves, entries = meta_db_leaves(path)
    assert entries == len(values) and len(leaves) >= 4
    damaged = leaves[0 if leaf == "first" else len(leaves) // 2]
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        f.seek(damaged * PAGE + 12)
        lost = (struct.unpack("<H", f.read(2))[0] - 16) // 2    # the records on that page
        f.seek(damaged * PAGE)
        f.write(b"\0" * PAGE)
    logs = str(tmp_path / "logs")
    with ProcessGroup(log_dir=logs) as procs:
        master = procs.start("master", service_args("master")).address
        line = refused_start(procs, "n0", node_cmd(master, path), logs)
        assert "corrupt" in line

        procs.start("n0-quarantine", node_cmd(master, path, "--ssd-quarantine"))
        assert len(quarantined(tmp_path)) == 1
        with KVClient(master) as kv:
            (stats,) = kv.node_stats().values()
            counters = stats["counters"]
            assert counters["recovered"] == len(values) - lost
            assert counters["recovery_dropped_corrupt"] == lost
            wait_for(lambda: check_served(kv, values) == len(values) - lost, timeout_s=10)
        procs.check()

        # The fresh folder is whole: the next restart recovers it as it is.
        procs.stop()
    with ProcessGroup(log_dir=logs) as procs:
        master = procs.start("master", service_args("master")).address
        node = procs.start("n0-again", node_cmd(master, path))
        assert node.info["recovered"] == len(values) - lost
        assert len(quarantined(tmp_path)) == 1
