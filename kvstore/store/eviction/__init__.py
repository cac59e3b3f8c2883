"""Eviction policies for a store node's tiers, chosen by name from a registry.

    from kvstore.store.eviction import make_policy
    policy = make_policy("default")   # or "lru", "lfu"

The policy observes and proposes; the store executes (see ``base``).
"""

from kvstore.store.eviction.base import (
    POLICIES,
    CanEvict,
    EvictionPolicy,
    Key,
    PolicyEntry,
    make_policy,
    register_policy,
)
from kvstore.store.eviction import default, lfu, lru, noevict  # noqa: E402,F401  (register)
from kvstore.store.eviction.default import DefaultPolicy
from kvstore.store.eviction.lfu import LfuPolicy
from kvstore.store.eviction.lru import LruPolicy
from kvstore.store.eviction.slotted import SlotPolicy, make_slot_policy

__all__ = [
    "POLICIES",
    "CanEvict",
    "DefaultPolicy",
    "EvictionPolicy",
    "Key",
    "LfuPolicy",
    "LruPolicy",
    "PolicyEntry",
    "SlotPolicy",
    "make_policy",
    "make_slot_policy",
    "register_policy",
]
