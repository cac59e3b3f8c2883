"""Least frequently used, ties broken by least recently used.

Classic LFU (e.g. Aho, Denning and Ullman, "Principles of Optimal Page
Replacement", JACM 1971, the "least frequently used" rule): the key with the
fewest accesses since it was inserted goes first; among equals, the one
touched longest ago. Counts are not aged, so keys that were hot long ago
linger -- the weakness that LRFU and the ``default`` policy address.

Thread safety: owned by the store node's lock (see ``base``).
"""

from __future__ import annotations

from kvstore.store.eviction.base import EvictionPolicy, PolicyEntry, register_policy


@register_policy("lfu")
class LfuPolicy(EvictionPolicy):
    """Fewest accesses first, then least recently used; prefix-unaware."""

    def native_spec(self) -> dict:
        return {"kind": 1}

    def _priority(self, entry: PolicyEntry) -> tuple:
        return (entry.freq, entry.last_access, entry.seq)
