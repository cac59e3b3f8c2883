"""SSD tier: one lmdb environment per node, with an explicit map size.

Layout of the environment (a directory, ``--ssd-path``)::

    data.mdb / lock.mdb     lmdb's own files
    kvstore.lock            flock: one node process per directory
    db "data"   slot -> value bytes
    db "meta"   slot -> | object_id u64 | size u64 | checksum u64 | seq u64 | key_len u16 | parent_len u16 | key | parent | replica_num u8 |
    db "info"   b"node_id" -> the node id that owns the directory

    slot = xxh3-128(key) || object_id (u64 big-endian)   (24 B, under lmdb's 511 B key limit)

Both records of an object are written in one transaction; ``write_many``
returns after the commit, which lmdb makes durable (``sync=True``), so an
object counts as stored on SSD only once it would survive a crash.

Opening an existing directory first checks ``data.mdb`` as bytes, before
lmdb maps it (:mod:`kvstore.store.tiers.lmdb_file`): a file shorter than the
last page lmdb's meta page records, or a damaged B-tree page, would make
lmdb's first read a SIGBUS or an abort. Such a directory is refused
(:class:`SsdCorrupt`); ``kvstore node --ssd-quarantine`` moves it aside and
copies out what is intact (:mod:`kvstore.store.tiers.ssd_salvage`). On
restart, :meth:`SsdTier.recover` walks "meta", checks each value against its
xxh3-64 checksum and drops what is missing, truncated or corrupt, and what no
longer fits the capacity (counted apart: :class:`RecoveryDrops`).

Accounting: an object reserves its size rounded up to 4 KiB lmdb pages (one
page at least), and ``used + free == capacity`` holds exactly. The map is
larger than the capacity (default ``3 * capacity + 64 MiB``) because lmdb
needs room for its B-trees, for pages freed by transactions still visible to
readers, and for free-list fragmentation: large values need contiguous page
runs. If lmdb still runs out of map, the write fails with
:class:`TierIOError` and the node treats the object as not stored.

Frees are deferred: :meth:`free` (called under the node's lock) only queues
the delete, and :meth:`flush` (the node's mover, off the lock) applies the
queue in one transaction; ``write_many`` flushes first, so a slot freed and
allocated again is never deleted after its new write.

Thread safety: accounting under the node's lock (see ``base``). ``read_into``
runs from any data-server thread (short read transactions); writes
(``write_many``, ``flush``) are serialised by the tier's own lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
from dataclasses import dataclass

import lmdb
import xxhash

from kvstore.keys import value_checksum
from kvstore.store.tiers.base import ObjectRecord, RecoveryDrops, Tier, TierIOError
from kvstore.store.tiers.lmdb_file import LmdbDamage, LmdbFile
from kvstore.types import TierKind

log = logging.getLogger(__name__)

PAGE_BYTES = 4096
_META = struct.Struct("<QQQQHH")
_MAP_SLACK_BYTES = 64 * 1024 * 1024


def default_map_size(capacity_bytes: int) -> int:
    """lmdb map size for a tier of ``capacity_bytes`` (see the module docstring)."""
    return 3 * capacity_bytes + _MAP_SLACK_BYTES


def slot_of(key: str, object_id: int) -> bytes:
    """The lmdb key of one object version."""
    return xxhash.xxh3_128_digest(key.encode()) + object_id.to_bytes(8, "big")


@dataclass(frozen=True, slots=True)
class SsdExtent:
    slot: bytes            # lmdb key of the object's records
    size_bytes: int        # the value's length
    reserved_bytes: int    # size rounded up to whole pages


class SsdInUse(RuntimeError):
    """Another process has this SSD directory open."""


class SsdCorrupt(RuntimeError):
    """The SSD directory's lmdb file is damaged (truncated, a damaged page); the
    message says what, in one line."""


#: lmdb errors that mean the file is not what lmdb wrote.
_DAMAGE_ERRORS = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError,
                  lmdb.VersionMismatchError)


def parse_meta(slot: bytes, meta) -> tuple[int, ObjectRecord] | None:
    """(write sequence, record) of one "meta" value; None when it does not parse or
    does not name ``slot``."""
    try:
        oid, size, checksum, seq, key_len, parent_len = _META.unpack_from(meta)
        names = bytes(meta[_META.size:_META.size + key_len + parent_len])
        key = names[:key_len].decode()
        parent = names[key_len:].decode() or None
        tail = meta[_META.size + key_len + parent_len:]
        replica_num = tail[0] if len(tail) else 0     # absent in older records
    except (struct.error, UnicodeDecodeError):
        return None
    if len(names) != key_len + parent_len or slot != slot_of(key, oid):
        return None
    return seq, ObjectRecord(key, oid, size, checksum, parent, replica_num)


class SsdTier(Tier):
    """Objects in an lmdb environment on local disk.

    Args:
        path: directory of the environment (created if missing).
        capacity_bytes: bytes of values (page-rounded) the tier may hold.
        map_size_bytes: lmdb map size; default ``default_map_size(capacity_bytes)``.

    Raises:
        ValueError: map size below capacity.
        SsdInUse: another node process holds ``path``.
        SsdCorrupt: its lmdb file is truncated or damaged (checked before lmdb reads it).
        lmdb.Error: the environment cannot be opened.
    """

    kind = TierKind.SSD
    persistent = True

    def __init__(self, path: str, capacity_bytes: int, map_size_bytes: int | None = None):
        map_size_bytes = map_size_bytes or default_map_size(capacity_bytes)
        if map_size_bytes < capacity_bytes:
            raise ValueError(f"SSD map size {map_size_bytes} B is below its capacity "
                             f"{capacity_bytes} B")
        self.path = path
        self._capacity_bytes = capacity_bytes
        self._used_bytes = 0
        self._live: dict[bytes, SsdExtent] = {}
        self._records: dict[bytes, ObjectRecord] = {}   # live slot -> what to persist with it
        self._seq = 0                                    # write order, kept in "meta"
        self.dropped = RecoveryDrops()                   # by recover()
        self._recovered: list[tuple[ObjectRecord, SsdExtent]] | None = None
        self._pending_deletes: list[bytes] = []
        self._pending_lock = threading.Lock()
        self._write_lock = threading.Lock()
        os.makedirs(path, exist_ok=True)
        self._lock_fd = os.open(os.path.join(path, "kvstore.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise SsdInUse(f"SSD path {path} is in use by another node process") from None
        try:
            self._check_file()
            self.env = lmdb.open(path, map_size=map_size_bytes, subdir=True, max_dbs=3,
                                 readahead=False, sync=True, metasync=True, lock=True,
                                 max_readers=512)
        except _DAMAGE_ERRORS as exc:
            os.close(self._lock_fd)
            raise SsdCorrupt(f"SSD path {path} is corrupt: lmdb cannot open it ({exc})") from None
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._data = self.env.open_db(b"data")
        self._meta = self.env.open_db(b"meta")
        self._info = self.env.open_db(b"info")

    def _check_file(self) -> None:
        """Check ``data.mdb``, when there is one, before lmdb maps it (module docstring).

        Raises:
            SsdCorrupt: it is truncated or damaged.
        """
        data = os.path.join(self.path, "data.mdb")
        if not os.path.exists(data):
            return                           # a fresh directory
        with LmdbFile(data) as f:
            # An empty data.mdb would be made a new environment by lmdb, silently.
            try:
                f.check()
            except LmdbDamage as exc:
                raise SsdCorrupt(f"SSD path {self.path} is corrupt: {exc}") from None

    # ---- identity ----
    @property
    def owner(self) -> str | None:
        """The node id recorded in this directory, or None for a fresh one."""
        with self.env.begin(db=self._info) as txn:
            raw = txn.get(b"node_id")
        return raw.decode() if raw is not None else None

    def claim(self, node_id: str) -> None:
        """Record ``node_id`` as this directory's owner (durably)."""
        with self._write_lock, self.env.begin(write=True, db=self._info) as txn:
            txn.put(b"node_id", node_id.encode())

    # ---- accounting (node lock) ----
    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @staticmethod
    def reserved_for(size_bytes: int) -> int:
        return max(1, -(-size_bytes // PAGE_BYTES)) * PAGE_BYTES

    def allocate(self, record: ObjectRecord) -> SsdExtent | None:
        reserved = self.reserved_for(record.size_bytes)
        if reserved > self.free_bytes:
            return None
        slot = slot_of(record.key, record.object_id)
        if slot in self._live:
            raise AssertionError(f"SSD slot of {record.key} v{record.object_id} is live already")
        extent = SsdExtent(slot, record.size_bytes, reserved)
        self._live[slot] = extent
        self._used_bytes += reserved
        self._records[slot] = record
        return extent

    def free(self, extent: SsdExtent) -> None:
        if self._live.get(extent.slot) is not extent:
            raise ValueError(f"free of an SSD extent that is not live (double free?): {extent}")
        del self._live[extent.slot]
        self._records.pop(extent.slot, None)
        self._used_bytes -= extent.reserved_bytes
        with self._pending_lock:
            self._pending_deletes.append(extent.slot)

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self._used_bytes == sum(e.reserved_bytes for e in self._live.values())

    # ---- bytes (any thread) ----
    def write_many(self, items: list) -> None:
        """Write each (extent, source) and commit once; durable on return.

        Raises:
            TierIOError: lmdb failed (map full, disk error); nothing was committed.
        """
        with self._write_lock:
            self._flush_locked()
            try:
                with self.env.begin(write=True) as txn:
                    for extent, src in items:
                        record = self._records.get(extent.slot)
                        if record is None:
                            raise AssertionError(f"write to an SSD extent that is not live: {extent}")
                        self._seq += 1
                        key_b = record.key.encode()
                        parent_b = (record.parent or "").encode()
                        meta = (_META.pack(record.object_id, record.size_bytes, record.checksum,
                                           self._seq, len(key_b), len(parent_b)) + key_b + parent_b
                                + bytes([min(record.replica_num, 255)]))
                        txn.put(extent.slot, src, db=self._data)
                        txn.put(extent.slot, meta, db=self._meta)
            except lmdb.Error as exc:
                raise TierIOError(f"SSD write of {len(items)} object(s) failed: {exc}") from exc

    def read_into(self, extent: SsdExtent, dest: memoryview) -> None:
        try:
            with self.env.begin(db=self._data, buffers=True) as txn:
                value = txn.get(extent.slot)
                if value is None or len(value) != extent.size_bytes:
                    raise TierIOError(f"SSD record {extent.slot.hex()} is missing or truncated")
                dest[:extent.size_bytes] = value
        except lmdb.Error as exc:
            raise TierIOError(f"SSD read failed: {exc}") from exc

    def flush(self) -> None:
        """Apply queued deletes in one transaction."""
        with self._write_lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        with self._pending_lock:
            slots, self._pending_deletes = self._pending_deletes, []
        if not slots:
            return
        try:
            with self.env.begin(write=True) as txn:
                for slot in slots:
                    txn.delete(slot, db=self._data)
                    txn.delete(slot, db=self._meta)
        except lmdb.Error as exc:
            # The records stay on disk; a restart would find and re-announce them.
            log.error("SSD delete of %d record(s) failed: %s", len(slots), exc)

    # ---- persistence ----
    def recover(self) -> list[tuple[ObjectRecord, SsdExtent]]:
        """Every intact object on disk, oldest first, accounted as used.

        Records whose value is missing, of the wrong size or with a wrong
        checksum are deleted; so are objects that no longer fit the capacity
        (the node was restarted with a smaller ``--ssd``); :attr:`dropped`
        counts both. The scan runs once: later calls return its result (a node
        may scan before it makes its DRAM segment, so that nothing is left
        behind when the scan fails).

        Raises:
            SsdCorrupt: lmdb found a damaged page (the file check at open passed).
        """
        if self._recovered is not None:
            return self._recovered
        found: list[tuple[int, ObjectRecord, bytes]] = []
        corrupt: list[bytes] = []
        surplus: list[bytes] = []
        try:
            with self.env.begin(buffers=True) as txn:
                for slot, meta in txn.cursor(db=self._meta):
                    slot = bytes(slot)
                    parsed = parse_meta(slot, meta)
                    value = txn.get(slot, db=self._data) if parsed is not None else None
                    # The size first: a value of another length is never read.
                    if (value is None or len(value) != parsed[1].size_bytes
                            or value_checksum(value) != parsed[1].checksum):
                        corrupt.append(slot)
                        continue
                    found.append((parsed[0], parsed[1], slot))
        except _DAMAGE_ERRORS as exc:
            raise SsdCorrupt(f"SSD path {self.path} is corrupt: {exc}") from None
        found.sort(key=lambda t: t[0])
        out: list[tuple[ObjectRecord, SsdExtent]] = []
        for seq, record, slot in found:
            reserved = self.reserved_for(record.size_bytes)
            if reserved > self.free_bytes:
                surplus.append(slot)
                continue
            extent = SsdExtent(slot, record.size_bytes, reserved)
            self._live[slot] = extent
            self._records[slot] = record
            self._used_bytes += reserved
            self._seq = max(self._seq, seq)
            out.append((record, extent))
        if corrupt or surplus:
            log.warning("SSD %s: dropped %d corrupt record(s), and %d over its capacity of "
                        "%d B, at recovery", self.path, len(corrupt), len(surplus),
                        self._capacity_bytes)
            with self._pending_lock:
                self._pending_deletes.extend(corrupt + surplus)
            self.flush()
        self.dropped = RecoveryDrops(self.dropped.corrupt + len(corrupt),
                                     self.dropped.surplus + len(surplus))
        self._recovered = out
        return out

    def restore(self, records: list[tuple[bytes, bytes, bytes]]) -> None:
        """Write records copied from another directory as they were: (slot, value,
        "meta" value) each, in one durable commit (``ssd_salvage``); before
        :meth:`recover`, which then checks and adopts them.

        Raises:
            TierIOError: lmdb failed; nothing was committed.
        """
        with self._write_lock:
            try:
                with self.env.begin(write=True) as txn:
                    for slot, value, meta in records:
                        txn.put(slot, value, db=self._data)
                        txn.put(slot, meta, db=self._meta)
            except lmdb.Error as exc:
                raise TierIOError(f"SSD restore of {len(records)} record(s) failed: "
                                  f"{exc}") from exc

    def note_dropped(self, corrupt: int) -> None:
        """Count ``corrupt`` records lost before this directory (a salvage's)."""
        self.dropped = RecoveryDrops(self.dropped.corrupt + corrupt, self.dropped.surplus)

    def close(self) -> None:
        try:
            self.flush()
            self.env.close()
        finally:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)   # releases the flock
                self._lock_fd = -1
