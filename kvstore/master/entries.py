"""A master shard's entries: a compact native table, with the node ids interned.

The index (:mod:`kvstore.master.index`) decides what its entries mean; this
module only holds them. They live in :class:`kvstore._native.EntryTable`
(kvstore/native/entry_table.hpp): per entry one 72-byte record in arrays and
an 8-byte bucket of an open addressing map keyed by the key's bytes, instead
of a Python object graph per entry (670 B an object at 10M before)::

    key (32 hex chars: packed in 16 B; else a side table) --> slot --> record
    record: size, checksum, object id, created / last access ms, access count,
            replica_num, up to 3 replicas inline as (node number, tier);
            more replicas and a repair in flight in an overflow side table

Nodes are numbered here (:meth:`EntryTable.ix`: a node id's number never changes
while the process lives; a few hundred nodes at most), and the native calls
that need to know which nodes are alive take a mask by number
(:meth:`EntryTable.alive_mask`, a few bytes, built per call from the
membership: ``NodeInfo.alive`` changes in many places, so nothing is cached).

A slot names an entry while it lives; a deleted entry's slot is reused by the
next one. A scan (the native ``*_slice`` calls) walks the positions that
existed when it started, a slice at a time, the caller changing the table in
between: an entry added during a scan may take a free position behind it and
be missed, and an entry deleted is skipped: a scan sees every entry that lived
through it, which is what each of its users needs (see theirs).

:class:`EntriesView` is a read-only mapping ``key -> Entry`` whose values are
built on demand (:class:`kvstore.master.entry.Entry`), for tests and rare paths.

Thread safety: owned by the master's event loop, like the index; not locked.
"""

from __future__ import annotations

from typing import Callable, Iterator

from kvstore._native import EntryTable as NativeEntryTable
from kvstore.master.entry import Entry
from kvstore.types import NodeId, ObjectKey, TierKind

#: Positions looked at per slice of a native scan: about 1-3 ms of the event loop.
SCAN_SLICE = 65_536

#: Nodes a table can number (node number 65535 is the native "none").
MAX_NODES = 65_535

#: A tier as stored (the wire enum value, 0-3) -> TierKind; 0 (unset) is served as DRAM.
TIERS = (TierKind.DRAM, TierKind.GPU, TierKind.DRAM, TierKind.SSD)

# stored_probe codes (kvstore/native/entry_table.hpp, StoredProbe)
PROBE_ABSENT, PROBE_OTHER_VERSION, PROBE_OTHER_BYTES, PROBE_REPLICA, PROBE_NEW_REPLICA = range(5)


class EntryTable:
    """The entries of one shard (the native table) and the numbers of their nodes.

    Attributes:
        native: the :class:`kvstore._native.EntryTable`; its calls take slots and
            node numbers (see its docstrings).
        node_ids: node number -> node id.
    """

    def __init__(self):
        self.native = NativeEntryTable()
        self.node_ids: list[NodeId] = []
        self._numbers: dict[NodeId, int] = {}

    def __len__(self) -> int:
        return len(self.native)

    def ix(self, node_id: NodeId) -> int:
        """The number of ``node_id`` (numbered now if new).

        Raises:
            OverflowError: more than :data:`MAX_NODES` node ids seen.
        """
        n = self._numbers.get(node_id)
        if n is None:
            if len(self.node_ids) >= MAX_NODES:
                raise OverflowError(f"more than {MAX_NODES} node ids")
            n = self._numbers[node_id] = len(self.node_ids)
            self.node_ids.append(node_id)
        return n

    def ix_of(self, node_id: NodeId) -> int | None:
        """The number of ``node_id``, or None if it never held an entry."""
        return self._numbers.get(node_id)

    def alive_mask(self, alive: Callable[[NodeId], bool]) -> bytes:
        """One byte per node number: 1 where ``alive(node id)``."""
        return bytes([1 if alive(n) else 0 for n in self.node_ids])

    def mask_of(self, node_ids) -> bytes:
        """One byte per node number: 1 for the nodes in ``node_ids``."""
        return bytes([1 if n in node_ids else 0 for n in self.node_ids])

    def names(self, numbers) -> list[NodeId]:
        return [self.node_ids[n] for n in numbers]

    def entry(self, slot: int) -> Entry:
        """A snapshot of the entry at ``slot`` (changing it changes nothing)."""
        (key, size, checksum, object_id, created, count, last, replica_num, reps, target,
         deadline) = self.native.record(slot)
        names = self.node_ids
        return Entry(key=ObjectKey(key), size_bytes=size, checksum=checksum,
                     object_id=object_id, replicas=[names[n] for n, _ in reps],
                     created_ms=created, access_count=count, last_access_ms=last,
                     tiers={names[n]: TIERS[t] for n, t in reps}, replica_num=replica_num,
                     repair_target=names[target] if target >= 0 else None,
                     repair_deadline_ms=deadline, slot=slot)

    def unavailable(self, alive: Callable[[NodeId], bool]) -> tuple[int, int]:
        """(objects, bytes) of the entries no node that is ``alive`` holds."""
        return self.native.unavailable(self.alive_mask(alive))

    def check(self) -> None:
        """Fails loudly when the counts by holders or the key map disagree with a recount
        (tests)."""
        self.native.check()

    def view(self) -> "EntriesView":
        return EntriesView(self)


class EntriesView:
    """``key -> Entry`` snapshots of a table, read-only (built on demand)."""

    __slots__ = ("_table",)

    def __init__(self, table: EntryTable):
        self._table = table

    def get(self, key: str, default=None) -> Entry | None:
        slot = self._table.native.find(key)
        return default if slot < 0 else self._table.entry(slot)

    def __getitem__(self, key: str) -> Entry:
        slot = self._table.native.find(key)
        if slot < 0:
            raise KeyError(key)
        return self._table.entry(slot)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._table.native.find(key) >= 0

    def __len__(self) -> int:
        return len(self._table.native)

    def __bool__(self) -> bool:
        return len(self._table.native) > 0

    def values(self) -> Iterator[Entry]:
        native = self._table.native
        for slot in range(native.positions()):
            try:
                yield self._table.entry(slot)
            except IndexError:
                continue               # a free position

    def items(self) -> Iterator[tuple[ObjectKey, Entry]]:
        for e in self.values():
            yield e.key, e

    def keys(self) -> Iterator[ObjectKey]:
        for e in self.values():
            yield e.key

    def __iter__(self) -> Iterator[ObjectKey]:
        return self.keys()
