"""Conductor scheduling: KVCache-centric choice of prefill and decode, or early rejection.

Mooncake FAST'25 §5, Algorithm 1, for one request::

    best, holder  = the longest prefix of its blocks held by any prefill instance
    for each live prefill instance i:                         (a SchedulingPolicy)
        TTFT(i)   = queue(i) + [transfer(best - local(i)) if best/local(i) >= ratio]
                  + prefill(uncached tokens)
    p             = the instance of least TTFT
    reject        if TTFT(p) > TTFT SLO
    check         the decode load a RejectionPolicy names (none; the batches
                  now; or predicted for when this prefill ends): reject if no
                  instance keeps TBT <= TBT SLO with room for the KV
    d             = the least-loaded allowed decode instance, bound now (the
                  prefill streams the KV to it)
    run on p, fetching (replicating) the remote prefix when chosen

When the prefill ends, :meth:`Scheduler.admit_decode` checks ``d`` against its
live load (the truth the early check forecast); a refusal there wastes the
prefill. Online requests are checked against the SLOs; offline ones are never
refused: the caller delays them (see ``tools/sim/simulate.py``), and they may take
a decode slot only while the batch stays within ``offline_tbt_fraction`` of
the TBT SLO, so they never push an online request past it.

One face: the simulator (``tools/sim/simulate.py``) and the live conductor
(``conductor/service.py``) both call :meth:`Scheduler.schedule` at arrival,
:meth:`~Scheduler.admit_decode` when the prefill ends, and the event hooks.
The simulator supplies a per-instance :class:`~kvstore.conductor.instances.CacheView`
over its pools; the live conductor, whose instances share one store, a view
in which every instance holds the prefix the store holds, and it keeps
``busy_until_ms`` / ``queued_ms`` by the simulator's rules
(:mod:`kvstore.conductor.live_state`).

Thread safety: owned by the conductor's event loop (or the simulator); not locked.
"""

from __future__ import annotations

import math
import random
from typing import Sequence

from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.instances import (
    CacheView,
    Decision,
    DecodeChoice,
    DecodeInstance,
    DecodeLoad,
    PrefillChoice,
    PrefillInstance,
    RejectReason,
    Rejection,
    SchedRequest,
)
from kvstore.conductor.policies import DEFAULT_SCHEDULING_POLICY, Candidate, Situation, make_scheduling_policy
from kvstore.conductor.rejection import DEFAULT_REJECTION_POLICY, DecodeForecaster, Slo, make_rejection_policy


def token_count_model() -> CostModel:
    """A cost model whose "milliseconds" are tokens to compute: the first version's load unit."""
    return CostModel(name="token-count", block_tokens=1, kv_bytes_per_token=1,
                     prefill_base_ms=0.0, prefill_ms_per_token=1.0, prefill_ms_per_mpair=0.0,
                     decode_base_ms=0.0, decode_ms_per_seq=1.0, decode_ms_per_kctx=0.0,
                     transfer_base_ms=0.0, transfer_bytes_per_ms=1.0,
                     decode_kv_capacity_tokens=1 << 62, prefill_cache_bytes=0,
                     hardware="unit costs", source={"*": "queue length in tokens, no timing"})


class Scheduler:
    """Scheduling state and decisions (Algorithm 1 plus early rejection).

    Args:
        prefill: the prefill instances (kept by reference; their counters are
            updated by the caller).
        decode: the decode instances (same).
        policy: scheduling policy name (``kvstore.conductor.policies``).
        rejection: early-rejection policy name (``kvstore.conductor.rejection``).
        cost_model: the time estimates; default counts tokens (no timing).
        slo: the objectives; default: none (never refuse for latency).
        block_tokens: tokens per block of ``SchedRequest.block_keys``;
            default: the cost model's.
        balance_ratio: Algorithm 1's ``kvcache_balancing_threshold``: fetch
            the best remote prefix only when it is at least this many times
            the local one.
        cache_view: which prefix each instance holds; None: nothing local.
        seed: seed of the ``random`` policy.
        offline_tbt_fraction: offline requests join a decode batch only while
            its step time stays within this fraction of the TBT SLO.
        departures: how predictive rejection forecasts decode departures
            ("survival" or the paper's "uniform"; see ``DecodeForecaster``).
        confidence_gone: "survival" only: a member is predicted gone when its
            chance to still decode is at most this.

    Raises:
        ValueError: no prefill or no decode instance, or a bad ratio.
        KeyError: an unknown policy name.
    """

    def __init__(self, prefill: list[PrefillInstance], decode: list[DecodeInstance],
                 *, policy: str = DEFAULT_SCHEDULING_POLICY,
                 rejection: str = DEFAULT_REJECTION_POLICY, cost_model: CostModel | None = None,
                 slo: Slo | None = None, block_tokens: int | None = None,
                 balance_ratio: float = 1.2, cache_view: CacheView | None = None, seed: int = 0,
                 offline_tbt_fraction: float = 0.8, departures: str = "survival",
                 confidence_gone: float = 0.05):
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode instance")
        if balance_ratio < 1:
            raise ValueError(f"balance_ratio must be >= 1, got {balance_ratio}")
        self.prefill = prefill
        self.decode = decode
        self.policy_name, self.rejection_name = policy, rejection
        self.policy = make_scheduling_policy(policy)
        self.rejection = make_rejection_policy(rejection)
        self.cost = cost_model or token_count_model()
        self.slo = slo or Slo.none()
        self.block_tokens = block_tokens or self.cost.block_tokens
        self.balance_ratio = balance_ratio
        self.cache_view = cache_view
        self.offline_tbt_fraction = offline_tbt_fraction
        self.rng = random.Random(seed)
        self.forecast = DecodeForecaster(decode, departures=departures,
                                         confidence_gone=confidence_gone)

    # ------------------------------------------------------------ Algorithm 1

    def queue_ms(self, inst: PrefillInstance, now_ms: float) -> float:
        """Predicted wait before new online work could start on ``inst``.

        The caller keeps ``busy_until_ms`` and ``queued_ms``; a caller that
        only counts queued tokens (the live conductor) gets an estimate from them.
        """
        wait = max(inst.busy_until_ms - now_ms, 0.0) + inst.queued_ms
        if wait == 0.0 and inst.queued_tokens > 0:
            wait = self.cost.prefill_ms(inst.queued_tokens)
        return wait

    def situation(self, req: SchedRequest, now_ms: float,
                  only: PrefillInstance | None = None) -> Situation | None:
        """The policies' inputs for ``req``; None when no prefill instance is live."""
        live = [p for p in self.prefill if p.alive]
        if not live:
            return None
        keys = req.block_keys
        local = {p.instance_id: (self.cache_view.prefix_blocks(p.instance_id, keys)
                                 if self.cache_view is not None and keys else 0) for p in live}
        queue = {p.instance_id: self.queue_ms(p, now_ms) for p in live}
        best_blocks = max(local.values())
        holder = None
        if best_blocks:
            holder = min((p.instance_id for p in live if local[p.instance_id] == best_blocks),
                         key=lambda i: queue[i])
        pool = [only] if only is not None else live
        cands = [Candidate(p, queue[p.instance_id], local[p.instance_id]) for p in pool]
        return Situation(request=req, candidates=cands, best_blocks=best_blocks, best_holder=holder,
                         cost=self.cost, balance_ratio=self.balance_ratio,
                         block_tokens=self.block_tokens, rng=self.rng)

    def plan_prefill(self, req: SchedRequest, now_ms: float,
                     only: PrefillInstance | None = None) -> PrefillChoice | None:
        """The policy's plan for ``req`` (restricted to ``only`` when given); no SLO check."""
        sit = self.situation(req, now_ms, only)
        if sit is None:
            return None
        return self.policy.choose(sit)

    def schedule(self, req: SchedRequest, now_ms: float) -> Decision:
        """Algorithm 1: the (prefill, decode) pair for an online request, or a rejection.

        An accepted request is remembered as in flight (for predictive
        rejection) until :meth:`admit_decode` or :meth:`dropped`.
        """
        choice = self.plan_prefill(req, now_ms)
        if choice is None:
            return Decision(None, None, Rejection(RejectReason.NO_INSTANCE, "no live prefill instance"))
        ttft = choice.estimated_ttft_ms
        if ttft > self.slo.ttft_ms:
            return Decision(choice, None, Rejection(
                RejectReason.TTFT_SLO,
                f"estimated TTFT {ttft:.0f} ms > SLO {self.slo.ttft_ms:.0f} ms on {choice.instance.instance_id}",
                estimated_ttft_ms=ttft))
        allowed: set[str] | None = None
        check = self.rejection.check_load(self.forecast, now_ms, now_ms + ttft)
        if check is not None:
            verdict = self.select_decode(check, req.prompt_tokens, self.slo.tbt_ms)
            if isinstance(verdict, Rejection):
                return Decision(choice, None, Rejection(verdict.reason, verdict.detail, ttft,
                                                        verdict.predicted_tbt_ms))
            allowed = {ld.instance.instance_id for ld in check
                       if self._fits(ld, req.prompt_tokens, self.slo.tbt_ms)[0]}
        # Among the instances the check allows, the least loaded counting the
        # requests already bound to each (so a burst does not all land on one).
        picked = self.select_decode(self.forecast.load_now(), req.prompt_tokens, math.inf,
                                    must_fit=False, allowed=allowed)
        if isinstance(picked, Rejection):
            return Decision(choice, None, picked)  # no live decode instance
        self.forecast.admitted(req.request_id, picked.instance.instance_id, now_ms + ttft,
                               req.prompt_tokens)
        return Decision(choice, picked)

    def _fits(self, ld: DecodeLoad, prompt_tokens: int, tbt_limit_ms: float) -> tuple[bool, float]:
        """(whether ``ld``'s instance can take the request, its predicted TBT with it).

        The KV check reserves the running mean output length for the request.
        """
        tbt = self.cost.decode_step_ms(ld.batch_size + 1, ld.context_tokens + prompt_tokens)
        room = (ld.context_tokens + prompt_tokens + int(self.forecast.output_tokens)
                <= self.cost.decode_kv_capacity_tokens)
        return room and tbt <= tbt_limit_ms, tbt

    def select_decode(self, load: Sequence[DecodeLoad], prompt_tokens: int, tbt_limit_ms: float,
                      must_fit: bool = True, allowed: set[str] | None = None
                      ) -> DecodeChoice | Rejection:
        """The decode instance of least predicted TBT that can take the request.

        Args:
            load: the decode load to judge by (now, or predicted).
            prompt_tokens: the request's KV tokens.
            tbt_limit_ms: the TBT it may not push an instance past.
            must_fit: False picks the least-loaded instance even when none can
                take it (no check).
            allowed: only these instance ids; None: all in ``load``.
        """
        best: DecodeChoice | None = None
        fallback: DecodeChoice | None = None
        least_tbt = math.inf
        all_full = True
        for ld in load:
            if allowed is not None and ld.instance.instance_id not in allowed:
                continue
            ok, tbt = self._fits(ld, prompt_tokens, tbt_limit_ms)
            if fallback is None or tbt < fallback.predicted_tbt_ms:
                fallback = DecodeChoice(ld.instance, tbt)
            if (ld.context_tokens + prompt_tokens + int(self.forecast.output_tokens)
                    <= self.cost.decode_kv_capacity_tokens):
                all_full = False
                least_tbt = min(least_tbt, tbt)
            if ok and (best is None or tbt < best.predicted_tbt_ms):
                best = DecodeChoice(ld.instance, tbt)
        if best is not None:
            return best
        if fallback is None:
            return Rejection(RejectReason.NO_INSTANCE, "no live decode instance")
        if not must_fit:
            return fallback
        reserve = prompt_tokens + int(self.forecast.output_tokens)
        if all_full:
            return Rejection(RejectReason.KV_CAPACITY,
                             f"no decode instance has room for {reserve} KV tokens")
        return Rejection(RejectReason.TBT_SLO,
                         f"predicted TBT {least_tbt:.1f} ms > limit {tbt_limit_ms:.1f} ms",
                         predicted_tbt_ms=least_tbt)

    def admit_decode(self, req: SchedRequest, now_ms: float,
                     planned: DecodeInstance | None = None) -> DecodeChoice | Rejection:
        """The late check, when ``req``'s prefill has ended: a decode instance under live load.

        ``planned`` is the instance bound at arrival (Algorithm 1 returns the
        pair; the KV streams there during prefill): only it is checked. With
        none (offline work), the least-loaded instance that can take it.
        Online requests must keep TBT within the SLO; offline ones within
        ``offline_tbt_fraction`` of it (the caller delays them when refused).
        A refused online request is forgotten (its prefill was wasted).
        """
        limit = self.slo.tbt_ms if req.online else self.slo.tbt_ms * self.offline_tbt_fraction
        load = self.forecast.load_live()
        if planned is not None:
            load = [ld for ld in load if ld.instance is planned]
        picked = self.select_decode(load, req.prompt_tokens, limit)
        if isinstance(picked, Rejection) and req.online:
            self.forecast.dropped(req.request_id)
        return picked

    # ------------------------------------------------------------ events from the executor

    def decode_started(self, req: SchedRequest, decode_id: str, now_ms: float) -> None:
        """``req`` joined ``decode_id``'s batch (after :meth:`admit_decode`)."""
        self.forecast.decode_started(req.request_id, decode_id, now_ms, req.prompt_tokens)

    def decode_finished(self, req: SchedRequest, decode_id: str, now_ms: float,
                        output_tokens: int) -> None:
        """``req``'s decode ended after ``output_tokens`` tokens."""
        self.forecast.decode_finished(req.request_id, decode_id, now_ms, output_tokens)

    def dropped(self, req: SchedRequest) -> None:
        """``req`` left without decoding (refused late, failed, or no decode needed)."""
        self.forecast.dropped(req.request_id)


__all__ = [
    "Decision",
    "DecodeChoice",
    "DecodeInstance",
    "PrefillChoice",
    "PrefillInstance",
    "Rejection",
    "SchedRequest",
    "Scheduler",
    "Slo",
    "token_count_model",
]
