"""A tier's eviction bookkeeping by object slot, in native arrays: what a store node uses.

The registered policies (``lru``, ``lfu``, ``default``, ``none``) are written in
Python over keys (``base``): they are the specification, and the simulator's
engine. A node does not keep a Python entry and a heap tuple per object; it
names each object by its slot in the object table (:class:`~kvstore.store.table.ObjectTable`)
and keeps the policy's state in :class:`kvstore._native.EvictionCore`: about 68
bytes per tracked object in flat arrays, an indexed heap, O(log n) per touch
(``kvstore/native/eviction.hpp``). Python still chooses the policy by name and
its parameters: :func:`make_slot_policy` builds the registered policy (which
validates them) and asks it for its native kind.

The contract is the key-based one of ``base`` with slots for keys::

    on_insert(slot, size_bytes, now, parent_slot, key)    key: its ghost history
    on_access(slot, now) / on_prefetch(slot, now) / on_remove(slot, key)
    victims(n_bytes_needed, count=, can_evict=slot -> bool)  -> slots, best first

A slot is reused once its object leaves service: the node calls ``on_remove``
before the slot is given to another object.

Thread safety: not thread-safe; owned by the store node's lock, like ``base``.
"""

from __future__ import annotations

from typing import Callable, Iterator

from kvstore._native import EvictionCore
from kvstore.store.eviction.base import make_policy

SlotVeto = Callable[[int], bool]
"""The store's veto by slot: False for objects that are read, pinned or protected."""


class SlotPolicy:
    """One tier's policy state by object slot (see the module docstring).

    Args:
        name: the registered policy's name (for stats and errors).
        evicts: False: proposes no victim, ever (a full tier refuses puts).
        spec: the native kind and parameters (:meth:`EvictionPolicy.native_spec`).
    """

    __slots__ = ("name", "evicts", "_core")

    def __init__(self, name: str, evicts: bool, spec: dict):
        self.name = name
        self.evicts = evicts
        self._core = EvictionCore(**spec)

    def on_insert(self, slot: int, size_bytes: int, now: float, parent: int = -1,
                  key: str = "") -> None:
        """A new object is resident at ``slot`` (tracked already: an access).

        Args:
            slot: its slot in the object table, >= 0.
            size_bytes: bytes it occupies in this tier.
            now: the caller's clock (seconds, monotonic).
            parent: the slot of the previous block of its prefix chain, or -1;
                ignored when that slot is not tracked here.
            key: its key, remembered (as a 64-bit fingerprint) by the ghost history.

        Raises:
            ValueError: ``slot`` out of range (negative, or 2**31 - 1 and beyond).
        """
        self._core.insert(slot, size_bytes, now, parent, key)

    def on_access(self, slot: int, now: float) -> None:
        """A tracked object was read; untracked slots are ignored."""
        self._core.access(slot, now)

    def on_prefetch(self, slot: int, now: float) -> None:
        """Queue lookahead announced a read of it (only ``default`` refreshes its recency)."""
        self._core.prefetch(slot, now)

    def on_remove(self, slot: int, key: str = "") -> None:
        """The object left this tier (evicted, dropped or demoted); untracked slots are ignored.

        Args:
            key: its key, remembered with its use count by the ghost history
                ("": not remembered).
        """
        self._core.remove(slot, key)

    def victims(self, n_bytes_needed: int | None = None, *, count: int | None = None,
                can_evict: SlotVeto | None = None) -> Iterator[int]:
        """Proposes slots to evict, best victim first, as ``EvictionPolicy.victims``.

        Lazy: the caller evicts each proposed slot and calls ``on_remove``
        before asking for the next. Slots vetoed by ``can_evict``, and proposed
        ones the caller keeps, keep their place once the iteration ends (a
        ``for`` loop that breaks ends it). O(log n) per slot popped.

        Args:
            n_bytes_needed: stop once the proposed slots add up to this many bytes.
            count: stop after this many slots.
            can_evict: the store's veto; None allows every slot.

        Yields:
            Slots in eviction order.
        """
        if not self.evicts:
            return
        core = self._core
        freed = proposed = 0
        held: list[int] = []
        try:
            while True:
                if n_bytes_needed is not None and freed >= n_bytes_needed:
                    return
                if count is not None and proposed >= count:
                    return
                slot = core.pop()
                if slot < 0:
                    return
                held.append(slot)
                if can_evict is not None and not can_evict(slot):
                    continue
                proposed += 1
                freed += core.size_of(slot)
                core.propose(slot)
                yield slot
        finally:
            core.restore(held)

    # ------------------------------------------------------------ inspecting

    def __len__(self) -> int:
        return len(self._core)

    def __contains__(self, slot: int) -> bool:
        return slot in self._core

    @property
    def used_bytes(self) -> int:
        """Bytes of all tracked objects."""
        return self._core.used_bytes

    def freq(self, slot: int) -> int:
        """Uses counted for ``slot`` (inserts, accesses, remembered ghosts); 0 when untracked."""
        return self._core.freq(slot)

    @property
    def retention_s(self) -> float:
        """``default``: moving average of the eviction frontier's age (0 for the others)."""
        return self._core.retention_s

    @property
    def credit_s(self) -> float:
        """``default``: the recency credit a protected object gets when queued now."""
        return self._core.credit_s

    @property
    def native_bytes(self) -> int:
        """Bytes of the native arrays (the per-object cost of this policy)."""
        return self._core.native_bytes

    def check_invariants(self) -> None:
        """Fails loudly when the bookkeeping is broken (for tests).

        Raises:
            AssertionError: what broke.
        """
        broken = self._core.check()
        assert not broken, broken


def make_slot_policy(name: str, **params) -> SlotPolicy:
    """The native slot policy of the policy registered as ``name``.

    Raises:
        KeyError: no policy of that name.
        ValueError: a parameter out of range (the registered policy checks
            them), or a policy with no native form (e.g. a simulator-only one).
    """
    policy = make_policy(name, **params)
    return SlotPolicy(policy.name, policy.evicts, policy.native_spec())
