"""A shard's visible keys in order (List, the RESP front's SCAN and KEYS), kept cheaply.

The index used to sort every visible key again at the first List after any
put or removal: a full SCAN of a shard that is being written paid one sort
per page (a million keys: about a second of the master's event loop each).
:class:`KeyOrder` keeps a sorted list, rebuilt rarely, and the keys added
since, merged in as they are read::

    sorted   keys at the last rebuild (removed ones stay until the next; the
             caller skips what is no longer visible)
    added    keys made visible since, sorted when read (timsort: only the new
             tail is out of order)

A read rebuilds first when the added keys pass an eighth of the sorted ones
(at least :data:`MIN_REBUILD`), or removed keys make up half of the list: a
rebuild's O(n log n) is paid once per O(n) changes.

Thread safety: as the index (the master's event loop).
"""

from __future__ import annotations

import bisect
import heapq
from typing import Callable, Iterable, Iterator

#: Changes below this never force a rebuild.
MIN_REBUILD = 1024


class KeyOrder:
    """The keys made visible on a shard, readable in order from any point."""

    def __init__(self):
        self._sorted: list[str] = []
        self._added: list[str] = []
        self._added_sorted = True

    def add(self, key: str) -> None:
        """``key`` became visible (again)."""
        self._added.append(key)
        self._added_sorted = False

    def iterate(self, start: str, after: bool, live: Callable[[], Iterable[str]],
                num_live: int) -> Iterator[str]:
        """The keys from ``start`` on (``after``: only those above it), in order, each
        once; possibly some that are no longer visible (the caller checks).

        Args:
            live: every visible key now (read only for a rebuild).
            num_live: how many there are.
        """
        if (len(self._added) > max(MIN_REBUILD, len(self._sorted) // 8)
                or len(self._sorted) > 2 * num_live + MIN_REBUILD):
            self._sorted, self._added, self._added_sorted = sorted(live()), [], True
        if not self._added_sorted:
            self._added.sort()
            self._added_sorted = True
        find = bisect.bisect_right if after else bisect.bisect_left
        last = None
        for key in heapq.merge(_from(self._sorted, find(self._sorted, start)),
                               _from(self._added, find(self._added, start))):
            if key != last:
                yield key
                last = key


def _from(keys: list[str], i: int) -> Iterator[str]:
    # No copy of the tail (a slice would copy up to a million references per page).
    return (keys[j] for j in range(i, len(keys)))
