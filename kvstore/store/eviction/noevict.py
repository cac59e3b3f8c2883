"""No eviction: a full tier refuses new objects with NoSpace.

For a node used as a plain store rather than a cache (Redis calls this
``noeviction``), and for tests of what a full store does.

Thread safety: owned by the store node's lock (see ``base``).
"""

from __future__ import annotations

from typing import Iterator

from kvstore.store.eviction.base import EvictionPolicy, Key, PolicyEntry, register_policy


@register_policy("none")
class NoEvictionPolicy(EvictionPolicy):
    """Tracks nothing worth evicting: proposes no victim, ever."""

    evicts = False

    def native_spec(self) -> dict:
        return {"kind": 3}

    def _priority(self, entry: PolicyEntry) -> tuple:
        return (entry.seq,)

    def victims(self, n_bytes_needed=None, *, count=None, can_evict=None) -> Iterator[Key]:
        return iter(())
