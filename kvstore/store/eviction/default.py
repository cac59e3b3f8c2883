from __future__ import annotations
from kvstore.store.eviction.base import EvictionPolicy, PolicyEntry, register_policy

@register_policy("default")
class DefaultPolicy(EvictionPolicy):
    leaf_first = True
    def _priority(self, entry: PolicyEntry) -> tuple:
        return (entry.last_access, entry.seq)
    def on_prefetch(self, key, now):
        self.on_access(key, now)
