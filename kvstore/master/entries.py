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

A scan (:meth:`EntryTable.scan`) walks the positions that existed when it
started. An entry added during a scan may take a free position behind it and
be missed, and an entry deleted is skipped: a scan sees every entry that
lived through it, which is what each of its users needs (see theirs).

Thread safety: owned by the master's event loop, like the index; not locked.
"""

from __future__ import annotations

from typing import Iterator

from kvstore.bigmap import BigMap
from kvstore.master.entry import Entry
from kvstore.types import ObjectKey

#: Entries looked at per slice of a scan: about 1-3 ms of the event loop.
SCAN_SLICE = 2048


class EntryTable:
    """The entries of one shard, by key and by position."""

    def __init__(self):
        self.entries: BigMap[ObjectKey, Entry] = BigMap()
        self._slots: list[Entry | None] = []
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: Entry) -> None:
        """Hold ``entry`` under its key (the caller removed any other entry of it)."""
        self.entries[entry.key] = entry
        if self._free:
            entry.slot = self._free.pop()
            self._slots[entry.slot] = entry
        else:
            entry.slot = len(self._slots)
            self._slots.append(entry)

    def remove(self, entry: Entry) -> None:
        """Forget ``entry`` (it must be held)."""
        del self.entries[entry.key]
        self._slots[entry.slot] = None
        self._free.append(entry.slot)
        entry.slot = -1

    def scan(self, slice_entries: int = SCAN_SLICE) -> Iterator[list[Entry]]:
        """Every entry, ``slice_entries`` positions at a time; the caller may change the
        table between slices (see the module docstring for what it then sees)."""
        end = len(self._slots)
        for start in range(0, end, slice_entries):
            yield [e for e in self._slots[start:start + slice_entries] if e is not None]
