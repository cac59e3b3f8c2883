"""The simulated cluster's parts: prefill KVCache pools and decode batches.

Two models, each exact for what the scheduler can see and cheap enough for
a whole trace in seconds:

* :class:`LocalPool` -- one prefill instance's local KVCache pool (its DRAM),
  a fixed number of blocks managed by the store nodes' own eviction code
  (``kvstore.store.eviction``): the pool calls ``on_insert`` / ``on_access`` /
  ``victims`` / ``on_remove`` exactly as a store node does. Keys are interned
  prefix chains, so equal keys mean equal prefixes. Pinned keys (a plan
  reads them, like a store read's reference) are vetoed from eviction.

* :class:`DecodeBatch` -- one decode instance's continuous batch as a fluid:
  between two events (a join or a finish) every request in the batch gets
  one token per step, and the step time is the cost model's
  ``decode_step_ms(batch, context)``, constant until the next event::

      v(t)  = v(t0) + (t - t0) / step_ms        tokens each member produced since t = 0
      join at v_j, needs m tokens  ->  leaves when v reaches v_j + m

  so a heap of finish points in ``v`` gives the next finish in O(log n),
  with no per-token events. A member's time between tokens is its decode
  time over its decoded tokens.

Thread safety: simulator only, single-threaded.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Hashable, Sequence

import kvstore.store.eviction  # noqa: F401  (registers the policies)
from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.instances import DecodeInstance
from kvstore.store.eviction.base import make_policy


class LocalPool:
    """A prefill instance's local KVCache pool of ``capacity_blocks`` blocks.

    Args:
        capacity_blocks: blocks it holds (>= 0; 0 keeps nothing).
        policy_name: a registered eviction policy ("default", "lru", ...).
    """

    __slots__ = ("capacity_blocks", "policy", "keys", "pins", "evictions")

    def __init__(self, capacity_blocks: int, policy_name: str = "default"):
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.policy = make_policy(policy_name)
        self.keys: set[Hashable] = set()
        self.pins: dict[Hashable, int] = {}  # key -> plans reading it
        self.evictions = 0

    def prefix_blocks(self, keys: Sequence[Hashable]) -> int:
        """How many leading ``keys`` the pool holds."""
        n = 0
        held = self.keys
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def pin(self, keys: Sequence[Hashable]) -> None:
        """Protects ``keys`` from eviction until :meth:`unpin` (counted)."""
        pins = self.pins
        for k in keys:
            pins[k] = pins.get(k, 0) + 1

    def unpin(self, keys: Sequence[Hashable]) -> None:
        """Releases one :meth:`pin` of each key."""
        pins = self.pins
        for k in keys:
            c = pins[k]
            if c > 1:
                pins[k] = c - 1
            else:
                del pins[k]

    def store(self, keys: Sequence[Hashable], now_s: float) -> int:
        """Touches ``keys`` head to tail, inserting the missing ones; evicts to make room.

        Victims are proposed by the policy; pinned keys and ``keys`` themselves
        are vetoed. Insertion stops at the first key that finds no room (a
        block past a gap is useless to a prefix).

        Returns:
            Blocks newly inserted.
        """
        held = self.keys
        missing = sum(1 for k in keys if k not in held)
        excess = len(held) + missing - self.capacity_blocks
        if excess > 0 and held:
            current = set(keys)
            pins = self.pins
            policy = self.policy
            for victim in policy.victims(count=excess,
                                         can_evict=lambda k: k not in pins and k not in current):
                held.discard(victim)
                policy.on_remove(victim)
                self.evictions += 1
        inserted = 0
        parent = None
        policy = self.policy
        for k in keys:
            if k in held:
                policy.on_access(k, now_s)
            elif len(held) < self.capacity_blocks:
                held.add(k)
                policy.on_insert(k, 1, now_s, parent=parent)
                inserted += 1
            else:
                break
            parent = k
        return inserted


class DecodeBatch:
    """A decode instance's continuous batch, simulated as a fluid (see the module docstring).

    Args:
        instance: the scheduler's record; its ``active_requests`` and
            ``context_tokens`` are kept current by every call here.
        cost: the decode step time model.
    """

    __slots__ = ("instance", "cost", "v", "t_ms", "step_ms", "_heap", "_seq", "_prompt_sum",
                 "_vjoin_sum", "version")

    def __init__(self, instance: DecodeInstance, cost: CostModel):
        self.instance = instance
        self.cost = cost
        self.v = 0.0  # tokens produced by each member since time 0
        self.t_ms = 0.0  # when v was last brought up to date
        self.step_ms = 0.0  # current step time; 0 when the batch is empty
        self._heap: list[tuple[float, int, Any, float, int]] = []  # (finish v, seq, item, join ms, tokens)
        self._seq = itertools.count()
        self._prompt_sum = 0  # prompt tokens of the members
        self._vjoin_sum = 0.0  # v at each member's join, summed
        self.version = 0  # bumps whenever the next finish time may change

    def __len__(self) -> int:
        return len(self._heap)

    def context_tokens(self) -> float:
        """KV tokens the members hold now (prompt plus tokens produced)."""
        return self._prompt_sum + len(self._heap) * self.v - self._vjoin_sum

    def advance(self, now_ms: float) -> None:
        """Brings ``v`` and the step time up to ``now_ms`` (the context grew meanwhile)."""
        if self.step_ms > 0:
            self.v += (now_ms - self.t_ms) / self.step_ms
        self.t_ms = now_ms
        self._restep()

    def _restep(self) -> None:
        n = len(self._heap)
        ctx = self.context_tokens()
        self.step_ms = self.cost.decode_step_ms(n, int(ctx))
        self.instance.active_requests = n
        self.instance.context_tokens = int(ctx)
        self.version += 1

    def add(self, item: Any, now_ms: float, prompt_tokens: int, decode_tokens: int) -> None:
        """``item`` joins the batch to produce ``decode_tokens`` (>= 1) more tokens."""
        self.advance(now_ms)
        heapq.heappush(self._heap, (self.v + decode_tokens, next(self._seq), item, now_ms,
                                    decode_tokens))
        self._prompt_sum += prompt_tokens
        self._vjoin_sum += self.v
        self._restep()

    def next_finish_ms(self) -> float | None:
        """When the next member finishes at the current step time; None when empty."""
        if not self._heap:
            return None
        return self.t_ms + max(self._heap[0][0] - self.v, 0.0) * self.step_ms

    def pop_finished(self, now_ms: float, prompt_of: Any) -> list[tuple[Any, float, float]]:
        """Removes the members done by ``now_ms``.

        Args:
            now_ms: the time of the finish event.
            prompt_of: ``prompt_of(item)`` -> its prompt tokens (to keep the sums).

        Returns:
            ``(item, join_ms, tbt_ms)`` per finished member.
        """
        self.advance(now_ms)
        out = []
        heap = self._heap
        while heap and heap[0][0] <= self.v + 1e-6:
            vfin, _, item, join_ms, tokens = heapq.heappop(heap)
            self._prompt_sum -= prompt_of(item)
            self._vjoin_sum -= vfin - tokens
            out.append((item, join_ms, (now_ms - join_ms) / tokens))
        if not heap:
            self._prompt_sum = 0
            self._vjoin_sum = 0.0
        self._restep()
        return out


__all__ = ["DecodeBatch", "LocalPool"]
