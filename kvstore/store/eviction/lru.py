"""Least recently used: evict the key whose last access is oldest.

The textbook baseline (e.g. Tanenbaum, *Modern Operating Systems*, "The Least
Recently Used page replacement algorithm"). Ties on the caller's clock go to
the policy's own event order, so of two keys touched at the same ``now`` the
earlier-touched one goes first. Note what that means for prefix chains: a
request reads its blocks head to tail, so plain LRU evicts a chain's head
before its tail -- the opposite of what prefix reuse wants (see ``default``).

Thread safety: owned by the store node's lock (see ``base``).
"""

from __future__ import annotations

from kvstore.store.eviction.base import EvictionPolicy, PolicyEntry, register_policy


@register_policy("lru")
class LruPolicy(EvictionPolicy):
    """Least recently used first; prefix-unaware."""

    def native_spec(self) -> dict:
        return {"kind": 0}

    def _priority(self, entry: PolicyEntry) -> tuple:
        return (entry.last_access, entry.seq)
