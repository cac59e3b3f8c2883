"""The eviction-policy contract and its one eviction loop.

The policy observes and proposes; the store executes (LMCache v1,
``lmcache/v1/distributed/eviction.py``). A node tells its policy what happens
to the objects of one tier and asks it, when the tier passes its high
watermark, which keys to give up::

    store node (executes)                      EvictionPolicy (observes, proposes)
    ---------------------                      -----------------------------------
    object committed          --on_insert-->   track key, size, parent
    object read               --on_access-->   update recency / frequency
    queued request announced  --on_prefetch--> treat as an imminent access (hint)
    object dropped / evicted  --on_remove-->   forget key
    over the high watermark   --victims(n_bytes_needed, can_evict)-->
                              <--key, key, ...  in eviction order; the store
                                                evicts each and calls on_remove

``can_evict(key)`` is the store's veto: keys being read (a reference is held),
hard-pinned, or protected by queue lookahead are skipped, never proposed.

Each policy is a small priority function (SGLang,
``python/sglang/srt/mem_cache/evict_policy.py``): ``_priority(entry)`` returns
a tuple, and the smallest tuple goes first. This module holds the one loop
that pops a binary heap of ``(priority, uid, key)`` with lazy invalidation:

    heap item (prio, uid, key) is live  <=>  entries[key].uid == uid

Every change of a key's priority pushes a fresh item with a fresh uid, so the
old item goes stale and is dropped when popped; the heap is compacted when
stale items outnumber live ones. All operations are O(log n) amortised.

Prefix awareness (``leaf_first = True``): a key inserted with a ``parent``
(the previous block of its prefix chain) makes the parent an inner node, and
only leaves -- keys without cached children -- enter the heap. A chain is
then evicted tail first, and a block stays while any continuation of it is
cached, as SGLang's radix cache evicts only leaves
(``python/sglang/srt/mem_cache/radix_cache.py``) and Mooncake keeps prefix
chains usable (FAST'25, section 4). When the store removes an inner key
anyway (an explicit delete), its children become roots.

Thread safety: a policy is not thread-safe. It is owned by the store node's
lock: every call, including the whole iteration of ``victims()``, must run
under that lock.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

from kvstore.registry import Registry

Key = Hashable
"""A tier's object key; policies only hash and compare it for equality."""

CanEvict = Callable[[Key], bool]
"""The store's veto: False for keys that are read, pinned or protected."""


@dataclass(slots=True, eq=False)
class PolicyEntry:
    """What a policy knows about one tracked key."""

    key: Key  # the store's key
    size_bytes: int  # bytes freed by evicting it
    parent: "PolicyEntry | None"  # previous block of its prefix chain, if tracked at insert
    num_children: int = 0  # tracked keys whose parent is this entry
    last_access: float = 0.0  # caller's clock at the last on_insert / on_access / on_prefetch
    seq: int = 0  # the policy's event counter at the last touch; breaks clock ties
    freq: int = 1  # on_insert counts 1, each on_access adds 1
    score: float = 0.0  # policy-specific state (e.g. a decayed or inflated priority)
    uid: int = -1  # uid of this key's live heap item; -1 when not in the heap
    alive: bool = True  # False once removed; children then stop counting on it


class EvictionPolicy(ABC):
    """Base of all eviction policies: bookkeeping plus the one eviction loop.

    Subclasses implement ``_priority``; they may override ``_on_touch`` to
    update per-key state (called before the new priority is computed) and set
    ``leaf_first``.

    Thread safety: not thread-safe; owned by the store node's lock (see the
    module docstring).
    """

    name: str = "base"  # set by @register_policy
    leaf_first: bool = False  # only keys without cached children are proposed
    evicts: bool = True  # False: proposes no victim, ever (a full tier refuses puts)

    def __init__(self) -> None:
        self._entries: dict[Key, PolicyEntry] = {}
        self._heap: list[tuple[Any, int, Key]] = []
        self._uids = itertools.count()
        self._seq = 0
        self._used_bytes = 0
        self._clock = float("-inf")  # the latest ``now`` the caller passed
        self._proposed: Key | None = None  # the key victims() yielded last

    # ------------------------------------------------------------ observing

    def on_insert(self, key: Key, size_bytes: int, now: float, parent: Key | None = None) -> None:
        """A new object is resident.

        Args:
            key: its key; inserting a tracked key again counts as an access.
            size_bytes: bytes it occupies in this tier.
            now: the caller's clock (seconds, or any monotone unit).
            parent: the key of the previous block of its prefix chain, or
                None for a chain head or an object outside any chain. Ignored
                when the parent is not tracked.
        """
        entry = self._entries.get(key)
        if entry is not None:
            self.on_access(key, now)
            return
        self._clock = max(self._clock, now)
        parent_entry = self._entries.get(parent) if parent is not None else None
        self._seq += 1
        entry = PolicyEntry(key=key, size_bytes=size_bytes, parent=parent_entry,
                            last_access=now, seq=self._seq)
        self._entries[key] = entry
        self._used_bytes += size_bytes
        if parent_entry is not None:
            parent_entry.num_children += 1
            if self.leaf_first:
                parent_entry.uid = -1  # an inner node leaves the heap
        self._on_touch(entry, now, hit=False)
        self._push(entry)

    def on_access(self, key: Key, now: float) -> None:
        """A tracked object was read (or its put found it present).

        Untracked keys are ignored.
        """
        entry = self._entries.get(key)
        if entry is None:
            return
        self._clock = max(self._clock, now)
        self._seq += 1
        entry.freq += 1
        entry.last_access = now
        entry.seq = self._seq
        self._on_touch(entry, now, hit=True)
        self._push(entry)

    def on_prefetch(self, key: Key, now: float) -> None:
        """Queue lookahead announced that a queued request will read ``key``.

        A hint, not an access: the base ignores it. Protection from eviction
        is the store's veto (``can_evict``), not the policy's business.
        """

    def on_remove(self, key: Key) -> None:
        """The object is gone (evicted, dropped or demoted). Untracked keys are ignored."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        entry.alive = False
        entry.uid = -1
        self._used_bytes -= entry.size_bytes
        if key == self._proposed:
            self._proposed = None
            self._on_evict(entry)
        parent = entry.parent
        if parent is not None and parent.alive:
            parent.num_children -= 1
            if self.leaf_first and parent.num_children == 0:
                self._push(parent)  # the parent is a leaf again

    # ------------------------------------------------------------ proposing

    def victims(self, n_bytes_needed: int | None = None, *, count: int | None = None,
                can_evict: CanEvict | None = None) -> Iterator[Key]:
        """Proposes keys to evict, best victim first.

        The iteration is lazy: the caller evicts each proposed key and calls
        ``on_remove(key)`` before asking for the next, so a prefix-aware
        policy can offer a parent once its last child is gone. A proposed key
        the caller keeps stays tracked at its old priority. Keys refused by
        ``can_evict`` are skipped and keep their place.

        One iteration at a time: keys popped by an unfinished iteration are
        back in the queue only once it is exhausted or closed (a ``for`` loop
        that breaks closes it). Cost: O(log n) per key popped, vetoed ones
        included.

        Args:
            n_bytes_needed: stop once the proposed keys add up to this many
                bytes. None: no byte limit.
            count: stop after this many keys. None: no count limit.
            can_evict: the store's veto; None allows every key.

        Yields:
            Keys in eviction order; fewer than asked when the rest is vetoed.
        """
        freed = 0
        proposed = 0
        held: list[tuple[Any, int, Key]] = []  # popped items to push back
        heap = self._heap
        try:
            while heap:
                if n_bytes_needed is not None and freed >= n_bytes_needed:
                    return
                if count is not None and proposed >= count:
                    return
                item = heapq.heappop(heap)
                entry = self._entries.get(item[2])
                if entry is None or entry.uid != item[1]:
                    continue  # stale
                held.append(item)
                if can_evict is not None and not can_evict(entry.key):
                    continue
                proposed += 1
                freed += entry.size_bytes
                self._proposed = entry.key
                yield entry.key
        finally:
            self._proposed = None
            for item in held:
                entry = self._entries.get(item[2])
                if entry is not None and entry.uid == item[1]:
                    heapq.heappush(heap, item)

    # ------------------------------------------------------------ inspecting

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    @property
    def used_bytes(self) -> int:
        """Bytes of all tracked keys."""
        return self._used_bytes

    def entry(self, key: Key) -> PolicyEntry | None:
        """The policy's record of ``key`` (read-only use), or None."""
        return self._entries.get(key)

    def check_invariants(self) -> None:
        """Fails loudly when the bookkeeping is broken (for tests)."""
        children: dict[int, int] = {}
        for entry in self._entries.values():
            assert entry.alive, entry.key
            if entry.parent is not None and entry.parent.alive:
                children[id(entry.parent)] = children.get(id(entry.parent), 0) + 1
        live = {item[1] for item in self._heap}
        for entry in self._entries.values():
            assert entry.num_children == children.get(id(entry), 0), entry.key
            in_heap = entry.uid in live
            should = not (self.leaf_first and entry.num_children > 0)
            assert in_heap == should, (entry.key, in_heap, should)
        assert self._used_bytes == sum(e.size_bytes for e in self._entries.values())

    # ------------------------------------------------------------ for subclasses

    @abstractmethod
    def _priority(self, entry: PolicyEntry) -> tuple:
        """The key's eviction priority: the smallest tuple is evicted first."""

    def native_spec(self) -> dict:
        """The kind and parameters of this policy's native form
        (:class:`~kvstore.store.eviction.slotted.SlotPolicy`), as keyword arguments.

        Raises:
            ValueError: the policy has none (a custom priority function).
        """
        raise ValueError(f"eviction policy {self.name!r} has no native form")

    def _on_touch(self, entry: PolicyEntry, now: float, hit: bool) -> None:
        """Updates policy state of ``entry`` on insert (hit=False) or access (hit=True)."""

    def _on_evict(self, entry: PolicyEntry) -> None:
        """``entry`` was removed right after ``victims()`` proposed it (an eviction)."""

    def _push(self, entry: PolicyEntry) -> None:
        """(Re)queues ``entry`` at its current priority, unless it is an inner node."""
        if self.leaf_first and entry.num_children > 0:
            entry.uid = -1
            return
        uid = next(self._uids)
        entry.uid = uid
        heapq.heappush(self._heap, (self._priority(entry), uid, entry.key))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._compact()

    def _compact(self) -> None:
        """Drops stale items, in place (a running ``victims()`` keeps its heap)."""
        entries = self._entries
        self._heap[:] = [it for it in self._heap
                         if (e := entries.get(it[2])) is not None and e.uid == it[1]]
        heapq.heapify(self._heap)


EVICTION_POLICIES: Registry[EvictionPolicy] = Registry("eviction policy")

#: Registered policies by name; ``make_policy`` builds one.
POLICIES = EVICTION_POLICIES.classes
#: Class decorator: registers an ``EvictionPolicy`` under a name.
register_policy = EVICTION_POLICIES.register
#: Builds the policy registered under a name with its keyword options (KeyError if unknown).
make_policy = EVICTION_POLICIES.make
