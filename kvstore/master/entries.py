"""A master shard's entries: the key -> :class:`Entry` map, kept scannable in slices.

The index (:mod:`kvstore.master.index`) decides what its entries mean; this
table only holds them, so that a scan of every entry (an inventory's sweep,
forgetting dead nodes, the repair planner's look for short replicas) can run
a slice at a time on the master's event loop, with other calls served in
between, instead of stalling the loop for seconds at millions of entries::

    entries   key -> Entry                      lookups (a BigMap: its growth never
                                                copies every entry at once)
    slots     [Entry | None, ...]               each entry at a fixed position
              (entry.slot); a deleted entry's position goes on a free list and
              is reused by the next entry: no compaction, no copy of the table

The table also counts its entries and their bytes by the set of nodes holding
them (``holders``), kept with every change to an entry's replicas
(:meth:`EntryTable.set_replicas`): so the objects whose every replica is on
a dead node -- kept until ``--node-forget-ms`` in case the node returns, but
not readable -- are counted in O(sets of holders), not O(entries)
(:meth:`EntryTable.unavailable`).

A scan (:meth:`EntryTable.scan`) walks the positions that existed when it
started. An entry added during a scan may take a free position behind it and
be missed, and an entry deleted is skipped: a scan sees every entry that
lived through it, which is what each of its users needs (see theirs).

Thread safety: owned by the master's event loop, like the index; not locked.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterator, Sequence

from kvstore.bigmap import BigMap
from kvstore.master.entry import Entry
from kvstore.types import NodeId, ObjectKey

#: Entries looked at per slice of a scan: about 1-3 ms of the event loop.
SCAN_SLICE = 2048


class EntryTable:
    """The entries of one shard, by key and by position."""

    def __init__(self):
        self.entries: BigMap[ObjectKey, Entry] = BigMap()
        self._slots: list[Entry | None] = []
        self._free: list[int] = []
        self._held_objects: Counter[tuple[NodeId, ...]] = Counter()   # by holders
        self._held_bytes: Counter[tuple[NodeId, ...]] = Counter()

    def _count(self, entry: Entry, sign: int) -> None:
        holders = tuple(sorted(entry.replicas))
        self._held_objects[holders] += sign
        self._held_bytes[holders] += sign * entry.size_bytes
        if not self._held_objects[holders]:
            del self._held_objects[holders], self._held_bytes[holders]

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: Entry) -> None:
        """Hold ``entry`` under its key (the caller removed any other entry of it)."""
        self.entries[entry.key] = entry
        self._count(entry, 1)
        if self._free:
            entry.slot = self._free.pop()
            self._slots[entry.slot] = entry
        else:
            entry.slot = len(self._slots)
            self._slots.append(entry)

    def remove(self, entry: Entry) -> None:
        """Forget ``entry`` (it must be held)."""
        del self.entries[entry.key]
        self._count(entry, -1)
        self._slots[entry.slot] = None
        self._free.append(entry.slot)
        entry.slot = -1

    def set_replicas(self, entry: Entry, replicas: Sequence[NodeId]) -> None:
        """Change the nodes holding a held ``entry`` (every change goes through here)."""
        self._count(entry, -1)
        entry.replicas = list(replicas)
        self._count(entry, 1)

    def unavailable(self, alive: Callable[[NodeId], bool]) -> tuple[int, int]:
        """(objects, bytes) of the entries no node that is ``alive`` holds."""
        dead = [h for h in self._held_objects if not any(alive(n) for n in h)]
        return (sum(self._held_objects[h] for h in dead),
                sum(self._held_bytes[h] for h in dead))

    def check(self) -> None:
        """Fails loudly when the counts by holders disagree with the entries (tests)."""
        objects: Counter = Counter()
        for e in self.entries.values():
            objects[tuple(sorted(e.replicas))] += 1
        assert objects == self._held_objects, (objects, self._held_objects)

    def scan(self, slice_entries: int = SCAN_SLICE) -> Iterator[list[Entry]]:
        """Every entry, ``slice_entries`` positions at a time; the caller may change the
        table between slices (see the module docstring for what it then sees)."""
        end = len(self._slots)
        for start in range(0, end, slice_entries):
            yield [e for e in self._slots[start:start + slice_entries] if e is not None]
