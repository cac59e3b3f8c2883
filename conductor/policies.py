"""Prefill scheduling policies, chosen by name from a registry.

    from kvstore.conductor.policies import make_scheduling_policy
    policy = make_scheduling_policy("global-cache-aware")   # the default

Every policy answers one question -- which prefill instance runs this
request, and with which reused prefix -- from the same inputs: each live
instance's predicted queue time and the number of the request's leading
blocks it holds locally (:class:`Candidate`), plus the best prefix held
anywhere (:class:`Situation`). The four policies are the four of Mooncake
FAST'25 §5.2 (cache load balancing):

* ``random``: any live instance, uniformly (seeded).
* ``load-balance``: the shortest predicted queue; the cache is ignored.
* ``local-cache-aware``: the least ``queue + prefill(uncached tokens)``, each
  instance reusing only what it holds itself.
* ``global-cache-aware``: Algorithm 1 -- as above, but an instance may fetch
  the best prefix held elsewhere when it is longer than its own by at least
  ``balance_ratio`` (the paper's ``kvcache_balancing_threshold``)::

      TTFT(i) = queue(i) + transfer(best - local(i)) + prefill(n - best, best)
                                    if best / local(i) >= balance_ratio
              = queue(i) + prefill(n - local(i), local(i))       otherwise

  The fetched blocks are stored on the chosen instance: hot prefixes are
  replicated to where they are used (the paper's hot-spot migration).

Whatever the policy, the chosen plan carries the estimated TTFT, which is
what early rejection checks against the SLO. Each policy is a small class
with one method; register new ones with :func:`register_scheduling_policy`.

Thread safety: policies are stateless apart from the random generator they
are handed; they run on the conductor's loop.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.instances import PrefillChoice, PrefillInstance, SchedRequest
from kvstore.registry import Registry


@dataclass(frozen=True, slots=True)
class Candidate:
    """One live prefill instance, as the policies see it."""

    instance: PrefillInstance
    queue_ms: float  # predicted wait before a new online request could start there
    local_blocks: int  # leading blocks of the request it holds


@dataclass(frozen=True, slots=True)
class Situation:
    """Everything a policy decides from."""

    request: SchedRequest
    candidates: Sequence[Candidate]  # live instances, in a fixed order
    best_blocks: int  # longest prefix held by any instance
    best_holder: str | None  # an instance holding it (the least loaded among them)
    cost: CostModel
    balance_ratio: float  # fetch a remote prefix only when best >= ratio * local
    block_tokens: int  # tokens per block of ``request.block_keys``
    rng: random.Random  # the only source of randomness


def reused_tokens(sit: Situation, blocks: int) -> int:
    """Tokens covered by ``blocks`` leading blocks; at least one prompt token is always computed."""
    return max(0, min(blocks * sit.block_tokens, sit.request.prompt_tokens - 1))


def plan(sit: Situation, cand: Candidate, allow_transfer: bool) -> PrefillChoice:
    """The plan and estimated TTFT of running the request on ``cand``.

    Args:
        sit: the situation.
        cand: the instance.
        allow_transfer: whether fetching the best remote prefix is allowed
            (then it is fetched exactly when Algorithm 1's ratio test passes).
    """
    n = sit.request.prompt_tokens
    local = cand.local_blocks
    fetch = 0
    if (allow_transfer and sit.best_holder is not None and sit.best_holder != cand.instance.instance_id
            and sit.best_blocks > local and sit.best_blocks >= sit.balance_ratio * local):
        fetch = sit.best_blocks - local
    cached = reused_tokens(sit, local + fetch)
    transfer_ms = sit.cost.blocks_transfer_ms(fetch)
    prefill_ms = sit.cost.prefill_ms(n - cached, cached)
    return PrefillChoice(
        instance=cand.instance,
        tokens_to_compute=n - cached,
        estimated_load_tokens=cand.instance.queued_tokens + n - cached,
        estimated_ttft_ms=cand.queue_ms + transfer_ms + prefill_ms,
        queue_ms=cand.queue_ms,
        prefill_ms=prefill_ms,
        transfer_ms=transfer_ms,
        local_prefix_blocks=local,
        transfer_blocks=fetch,
        transfer_from=sit.best_holder if fetch else None,
    )


class SchedulingPolicy(ABC):
    """Picks the prefill instance and the reused prefix of one request."""

    name: str = "base"  # set by @register_scheduling_policy

    @abstractmethod
    def choose(self, sit: Situation) -> PrefillChoice:
        """The plan for ``sit.request``; ``sit.candidates`` is never empty."""


SCHEDULERS: Registry[SchedulingPolicy] = Registry("scheduler")

#: Registered policies by name.
SCHEDULING_POLICIES = SCHEDULERS.classes
#: Class decorator: registers a scheduling policy under a name.
register_scheduling_policy = SCHEDULERS.register
#: Builds the policy registered under a name (KeyError if unknown).
make_scheduling_policy = SCHEDULERS.make


def _min_by(sit: Situation, plans: Sequence[PrefillChoice], key: Callable[[PrefillChoice], float]
            ) -> PrefillChoice:
    """The plan with the smallest key; ties go to the shorter queue, then to candidate order."""
    best = plans[0]
    for p in plans[1:]:
        if (key(p), p.queue_ms) < (key(best), best.queue_ms):
            best = p
    return best


@register_scheduling_policy("random")
class RandomPolicy(SchedulingPolicy):
    """Uniformly random instance; it reuses whatever it holds locally."""

    def choose(self, sit: Situation) -> PrefillChoice:
        return plan(sit, sit.rng.choice(list(sit.candidates)), allow_transfer=False)


@register_scheduling_policy("load-balance")
class LoadBalancePolicy(SchedulingPolicy):
    """Shortest predicted queue; it reuses whatever it holds locally."""

    def choose(self, sit: Situation) -> PrefillChoice:
        plans = [plan(sit, c, allow_transfer=False) for c in sit.candidates]
        return _min_by(sit, plans, lambda p: p.queue_ms)


@register_scheduling_policy("local-cache-aware")
class LocalCacheAwarePolicy(SchedulingPolicy):
    """Least ``queue + prefill`` with each instance's own cached prefix."""

    def choose(self, sit: Situation) -> PrefillChoice:
        plans = [plan(sit, c, allow_transfer=False) for c in sit.candidates]
        return _min_by(sit, plans, lambda p: p.estimated_ttft_ms)


@register_scheduling_policy("global-cache-aware")
class GlobalCacheAwarePolicy(SchedulingPolicy):
    """Mooncake FAST'25 Algorithm 1: least estimated TTFT, remote prefixes included."""

    def choose(self, sit: Situation) -> PrefillChoice:
        plans = [plan(sit, c, allow_transfer=True) for c in sit.candidates]
        return _min_by(sit, plans, lambda p: p.estimated_ttft_ms)


DEFAULT_SCHEDULING_POLICY = "global-cache-aware"

__all__ = [
    "DEFAULT_SCHEDULING_POLICY",
    "SCHEDULING_POLICIES",
    "Candidate",
    "SchedulingPolicy",
    "Situation",
    "make_scheduling_policy",
    "plan",
    "register_scheduling_policy",
    "reused_tokens",
]
