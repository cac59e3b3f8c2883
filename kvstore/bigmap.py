"""A dict for millions of entries whose growth never stalls its owner for long.

A CPython dict doubles its table when it fills, copying every entry at once:
at 2.8M entries one insert took 147 ms here, at 5.6M 393 ms. A master's index
and a node's table hold that many, and that insert would hold the master's
event loop (or the node's lock) for as long. :class:`BigMap` spreads the
entries over :data:`PARTS` dicts, so a resize copies one part (a 256th)::

    key --hash--> part (hash & 255) --> an ordinary dict

It is a mapping with the dict operations its users need (``get``, ``[]``,
``in``, ``del``, ``len``, ``keys``/``values``/``items``, iteration). The part
is chosen with Python's ``hash()`` of the key: a choice inside this process,
never stored or sent (keys themselves are xxh3 hashes, :mod:`kvstore.keys`).
Iteration order is by part, then insertion.

Thread safety: as a dict's (the owner serializes writers).
"""

from __future__ import annotations

from typing import Generic, Iterator, TypeVar

K = TypeVar("K")
V = TypeVar("V")

#: Parts (a power of two): a resize copies 1 / PARTS of the entries.
PARTS = 256
_MASK = PARTS - 1


class BigMap(Generic[K, V]):
    """A mapping spread over :data:`PARTS` dicts (see the module docstring)."""

    __slots__ = ("_parts", "_len")

    def __init__(self):
        self._parts: list[dict[K, V]] = [{} for _ in range(PARTS)]
        self._len = 0

    def get(self, key: K, default=None):
        return self._parts[hash(key) & _MASK].get(key, default)

    def __getitem__(self, key: K) -> V:
        return self._parts[hash(key) & _MASK][key]

    def __setitem__(self, key: K, value: V) -> None:
        part = self._parts[hash(key) & _MASK]
        n = len(part)
        part[key] = value
        self._len += len(part) - n

    def __delitem__(self, key: K) -> None:
        del self._parts[hash(key) & _MASK][key]
        self._len -= 1

    def pop(self, key: K, *default):
        part = self._parts[hash(key) & _MASK]
        n = len(part)
        value = part.pop(key, *default)
        self._len -= n - len(part)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self._parts[hash(key) & _MASK]

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[K]:
        for part in self._parts:
            yield from part

    def keys(self) -> Iterator[K]:
        return iter(self)

    def values(self) -> Iterator[V]:
        for part in self._parts:
            yield from part.values()

    def items(self) -> Iterator[tuple[K, V]]:
        for part in self._parts:
            yield from part.items()
