"""The default policy: leaf-first segmented LRU with a fading time credit.

One priority over leaves only, smallest first::

    priority(key) = (last_access + credit * [uses(key) >= 2],  event order)
    credit        = protect_s * min(1, fade_ratio * protect_s / retention)
    retention     = moving average, over evictions, of  now - (last_access + credit)

Four ideas, each from a known design:

1. Prefix awareness, leaf first (SGLang's radix cache,
   ``python/sglang/srt/mem_cache/radix_cache.py``, evicts only leaves;
   Mooncake FAST'25 keeps prefix chains usable). Only keys with no cached
   child are candidates, so a chain goes tail first and a block outlives
   every cached continuation of it. Plain LRU does the opposite: a request
   reads its chain head to tail, so the head is the older of the two and is
   evicted first, which breaks the prefix for every block behind it.

2. Frequency protection, as in segmented LRU (Karedla, Love and Wherry,
   "Caching Strategies to Improve Disk System Performance", IEEE Computer
   27(3), 1994): keys used once are probationary, keys used twice or more
   are protected. Instead of a fixed share of the cache, protection is a
   credit of recency in seconds: a protected key goes after every
   probationary key last used up to ``credit`` seconds after it. Protection
   therefore ages out by itself (plain LFU keeps long-dead popular keys
   forever) and is measured in the unit that governs KV reuse -- the time
   between turns of a conversation -- rather than in cache sizes.

3. Ghost history, as in 2Q's A1out (Johnson and Shasha, VLDB 1994) and ARC's
   B1/B2 lists (Megiddo and Modha, FAST 2003): the use counts of the last
   ``ghost_factor * len(resident)`` removed keys are remembered, and a key
   that comes back resumes its count. On the Mooncake traces most blocks are
   reused only after they fell out of a small cache; without the history
   they would come back as probationary every time.

4. Fading: the credit shrinks once the tier's own retention -- how long an
   unprotected key survives, measured at each eviction, the quantity that
   GreedyDual's inflation value L tracks (Cao and Irani, USENIX ITS 1997) --
   exceeds ``fade_ratio * protect_s``. A tier that already keeps every key
   far longer than the reuse intervals that protection is meant to bridge
   holds mostly finished conversations among its protected keys; full
   credit would only cost it capacity. A key's credit is fixed when it is
   (re)queued, so a change of the credit reaches the heap gradually.

Measured with ``tools/sim/cache.py`` on the bundled Mooncake traces, this
beats LRU at every capacity from 300 to 150k blocks (up to 2.1x at 3k
blocks on the conversation trace) and never falls below it; ``protect_s =
240`` is 2-4 times the median reuse interval of the traces' reused blocks
(about 60 s synthetic, 110 s conversation). With ``protect_s = 0`` the
policy is leaf-first LRU.

Queue lookahead: ``on_prefetch`` refreshes the key's recency (it is not a
use), so a key the conductor announced is not the oldest once the store's
protection of it ends.

Thread safety: owned by the store node's lock (see ``base``).
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.store.eviction.base import EvictionPolicy, Key, PolicyEntry, register_policy

_MIN_GHOSTS = 64  # history kept even for a nearly empty tier


@register_policy("default")
class DefaultPolicy(EvictionPolicy):
    """Leaf-first segmented LRU with a fading time credit and ghost history.

    Args:
        protect_s: full recency credit, in the caller's clock unit (seconds),
            of a key used at least twice. 0 makes the policy leaf-first LRU.
        ghost_factor: remember the use counts of this many removed keys per
            resident key; 0 keeps no history.
        fade_ratio: the credit starts to shrink, as ``1 / retention``, once the
            measured retention exceeds ``fade_ratio * protect_s``.
        retention_weight: weight of each eviction in the retention's
            exponential moving average.

    Raises:
        ValueError: an argument out of range.
    """

    leaf_first = True

    def __init__(self, protect_s: float = 240.0, ghost_factor: float = 4.0, fade_ratio: float = 1.5,
                 retention_weight: float = 1 / 1024) -> None:
        if protect_s < 0 or ghost_factor < 0 or fade_ratio <= 0:
            raise ValueError(f"need protect_s >= 0, ghost_factor >= 0, fade_ratio > 0; got "
                             f"{protect_s}, {ghost_factor}, {fade_ratio}")
        if not 0 < retention_weight <= 1:
            raise ValueError(f"retention_weight must be in (0, 1], got {retention_weight}")
        super().__init__()
        self.protect_s = protect_s
        self.ghost_factor = ghost_factor
        self.fade_ratio = fade_ratio
        self.retention_weight = retention_weight
        self.retention_s = 0.0  # moving average of the eviction frontier's age
        self._ghosts: OrderedDict[Key, int] = OrderedDict()  # removed key -> use count, oldest first

    @property
    def credit_s(self) -> float:
        """The recency credit a protected key gets when it is queued now."""
        full = self.protect_s
        knee = self.fade_ratio * full
        if self.retention_s <= knee:
            return full
        return full * knee / self.retention_s

    def native_spec(self) -> dict:
        return {"kind": 2, "leaf_first": True, "protect_s": self.protect_s,
                "ghost_factor": self.ghost_factor, "fade_ratio": self.fade_ratio,
                "retention_weight": self.retention_weight}

    def _priority(self, entry: PolicyEntry) -> tuple:
        entry.score = self.credit_s if entry.freq > 1 else 0.0  # remembered for _on_evict
        return (entry.last_access + entry.score, entry.seq)

    def _on_touch(self, entry: PolicyEntry, now: float, hit: bool) -> None:
        if not hit and self._ghosts:
            entry.freq += self._ghosts.pop(entry.key, 0)

    def _on_evict(self, entry: PolicyEntry) -> None:
        age = self._clock - (entry.last_access + entry.score)
        self.retention_s += self.retention_weight * (max(age, 0.0) - self.retention_s)

    def on_prefetch(self, key: Key, now: float) -> None:
        """Refreshes the recency of an announced key; its use count is unchanged."""
        entry = self._entries.get(key)
        if entry is None or now < entry.last_access:
            return
        self._clock = max(self._clock, now)
        self._seq += 1
        entry.last_access = now
        entry.seq = self._seq
        self._push(entry)

    def on_remove(self, key: Key) -> None:
        """Forgets ``key`` and remembers its use count in the ghost history."""
        entry = self._entries.get(key)
        super().on_remove(key)
        if entry is None or self.ghost_factor == 0:
            return
        ghosts = self._ghosts
        ghosts[key] = entry.freq
        ghosts.move_to_end(key)
        limit = max(int(self.ghost_factor * len(self._entries)), _MIN_GHOSTS)
        while len(ghosts) > limit:
            ghosts.popitem(last=False)
