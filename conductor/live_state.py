"""The live conductor's scheduling state, kept by the simulator's rules.

The scheduler (:mod:`kvstore.conductor.scheduler`) decides every request from
the same inputs wherever it runs: each prefill instance's ``busy_until_ms`` and
``queued_ms``, a cache view (how many leading blocks of the request each
instance holds), and the decode forecaster. The simulator
(``tools/sim/simulate.py``) knows when each prefill starts and ends. The live
conductor learns it from its own calls, and keeps the same fields by the same
rules (:class:`PrefillQueues`), in milliseconds of its own monotonic clock::

    dispatched   an idle instance starts it now:  busy_until = now + predicted
                 a busy one queues it:            queued_ms += predicted
    answered     the running request ended; the next one starts now:
                 queued_ms -= predicted(next), busy_until = now + predicted(next)
                 none left:                       busy_until = now

A prefill engine runs one request at a time, in the order they reach it (its
single worker thread), so the oldest request in flight is the running one; one
that ends out of turn (it failed) just leaves the queue.

"predicted" is the cost model's time times the instance's *service ratio*:
the running mean (from 1, weight ``SERVICE_RATIO_WEIGHT``) of measured /
predicted over its answered requests, each bounded to ``SERVICE_RATIO_BOUNDS``
(an engine's first request also pays torch's warm-up), the measure being the
engine's own time on the request (``PrefillResponse.compute_ms``: KV loads
and saves included). A
cost model profiled on a quiet core predicts less than an engine sharing its
cores with the store and the decode engine takes (1.2x-2x on the 2-core
development machine); unscaled, every queued request adds that error to the
queue estimate, and early rejection admits requests that then miss the SLO.
In the simulator the model is exact by construction: its ratio is 1.

Every prefill instance reads the one shared store, so each holds the prefix
the store holds (:class:`SharedStoreView`): Algorithm 1's transfer term is 0,
and its choice is the least predicted queue plus prefill of the uncached tokens.

:class:`DecisionLog` writes each arrival's decision with the state it was made
from, one JSON object per line (``kvstore conductor --decision-log FILE``), so
the simulator's scheduler can recompute it (``kvstore.tools.sim.parity``).

Thread safety: all of it belongs to the conductor's event loop.
"""

from __future__ import annotations

import json
import math
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from kvstore.conductor.instances import BlockKey, Decision, PrefillInstance, SchedRequest

#: Version of the decision log's lines (the header says it).
DECISION_LOG_VERSION = 1

#: Weight of each answered request in an instance's service ratio.
SERVICE_RATIO_WEIGHT = 0.2
#: One request's measured / predicted is taken within these bounds.
SERVICE_RATIO_BOUNDS = (0.25, 4.0)


class SharedStoreView:
    """The scheduler's cache view of instances that share one store: for the request
    being scheduled, every instance holds the leading blocks the store was found to hold."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[tuple[BlockKey, ...], int] = {}

    @contextmanager
    def holding(self, block_keys: tuple[BlockKey, ...], blocks: int) -> Iterator[None]:
        """While inside: every instance holds ``block_keys[:blocks]``."""
        self._held[block_keys] = blocks
        try:
            yield
        finally:
            self._held.pop(block_keys, None)

    def prefix_blocks(self, instance_id: str, block_keys: Sequence[BlockKey]) -> int:
        return self._held.get(tuple(block_keys), 0)


class _Ticket:
    """One dispatched prefill: the model's time and the scaled one it is queued for (ms)."""

    __slots__ = ("model_ms", "predicted_ms")

    def __init__(self, model_ms: float, predicted_ms: float):
        self.model_ms = model_ms
        self.predicted_ms = predicted_ms


class PrefillQueues:
    """``busy_until_ms`` / ``queued_ms`` of the live prefill instances (rules above).

    Args:
        learn_ratio: keep each instance's service ratio; False (a cost model whose
            "milliseconds" are token counts) keeps every ratio at 1.
    """

    def __init__(self, learn_ratio: bool = True) -> None:
        self._fifo: dict[str, deque[_Ticket]] = {}
        self.learn_ratio = learn_ratio
        self.service_ratio: dict[str, float] = {}   # instance id -> measured / model

    def dispatched(self, inst: PrefillInstance, model_ms: float, now_ms: float) -> _Ticket:
        """A request was sent to ``inst``; the cost model says it takes ``model_ms``."""
        fifo = self._fifo.setdefault(inst.instance_id, deque())
        predicted_ms = model_ms * self.service_ratio.get(inst.instance_id, 1.0)
        ticket = _Ticket(model_ms, predicted_ms)
        if not fifo:
            inst.busy_until_ms = now_ms + predicted_ms
        else:
            inst.queued_ms += predicted_ms
        fifo.append(ticket)
        return ticket

    def answered(self, inst: PrefillInstance, ticket: _Ticket, now_ms: float,
                 service_ms: float | None = None) -> None:
        """``inst`` answered (or failed) the request of ``ticket``; ``service_ms``: the
        engine's time on it, when it answered."""
        fifo = self._fifo.get(inst.instance_id)
        if not fifo or ticket not in fifo:
            return
        if self.learn_ratio and service_ms is not None and service_ms > 0 and ticket.model_ms > 0:
            old = self.service_ratio.get(inst.instance_id, 1.0)
            lo, hi = SERVICE_RATIO_BOUNDS
            ratio = min(max(service_ms / ticket.model_ms, lo), hi)
            self.service_ratio[inst.instance_id] = old + SERVICE_RATIO_WEIGHT * (ratio - old)
        if fifo[0] is not ticket:              # ended out of turn: it was still queued
            fifo.remove(ticket)
            inst.queued_ms = max(inst.queued_ms - ticket.predicted_ms, 0.0)
            return
        fifo.popleft()
        if fifo:
            inst.queued_ms = max(inst.queued_ms - fifo[0].predicted_ms, 0.0)
            inst.busy_until_ms = now_ms + fifo[0].predicted_ms
        else:
            inst.queued_ms = 0.0
            inst.busy_until_ms = now_ms


def _num(x: float) -> float | str:
    """JSON has no infinity: ``inf`` is written as the string "inf"."""
    return x if math.isfinite(x) else str(x)


class DecisionLog:
    """JSON lines: a header (the scheduler's settings), then one line per decision.

    Each decision line holds the state before the decision (``prefill``:
    per instance ``id, alive, busy_until_ms, queued_ms, queued_requests,
    queued_tokens``; ``decode``: ``id, alive, active_requests,
    context_tokens``; ``forecast``: the forecaster's snapshot), the request
    (``prompt_tokens``, ``blocks``, ``cached_blocks``), ``t_ms`` and the
    ``choice`` (``prefill``, ``decode``, ``estimated_ttft_ms``, ``rejected``).

    Args:
        path: the file (appended to; line-buffered).
    """

    def __init__(self, path: str | Path):
        self._file = open(path, "a", buffering=1, encoding="utf-8")
        self._header_written = False

    def _header(self, scheduler) -> None:
        self._write({"header": {
            "version": DECISION_LOG_VERSION,
            "cost_model": scheduler.cost.to_dict(),
            "policy": scheduler.policy_name, "rejection": scheduler.rejection_name,
            "slo": {"ttft_ms": _num(scheduler.slo.ttft_ms), "tbt_ms": _num(scheduler.slo.tbt_ms)},
            "balance_ratio": scheduler.balance_ratio, "block_tokens": scheduler.block_tokens,
            "prefill": [p.instance_id for p in scheduler.prefill],
            "decode": [d.instance_id for d in scheduler.decode]}})
        self._header_written = True

    @staticmethod
    def state(scheduler) -> dict:
        """The scheduler's inputs now (take it before the decision changes them)."""
        return {
            "prefill": [{"id": p.instance_id, "alive": p.alive, "busy_until_ms": p.busy_until_ms,
                         "queued_ms": p.queued_ms, "queued_requests": p.queued_requests,
                         "queued_tokens": p.queued_tokens} for p in scheduler.prefill],
            "decode": [{"id": d.instance_id, "alive": d.alive, "active_requests": d.active_requests,
                        "context_tokens": d.context_tokens} for d in scheduler.decode],
            "forecast": scheduler.forecast.snapshot(),
        }

    def record(self, scheduler, state: dict, req: SchedRequest, cached_blocks: int,
               now_ms: float, decision: Decision) -> None:
        """One decision, with the ``state`` taken before it."""
        if not self._header_written:
            self._header(scheduler)
        choice = {"prefill": decision.prefill.instance.instance_id if decision.accepted else None,
                  "decode": decision.decode.instance.instance_id if decision.decode else None,
                  "estimated_ttft_ms": decision.prefill.estimated_ttft_ms if decision.prefill else None,
                  "rejected": decision.rejection.reason.value if decision.rejection else None}
        self._write({"t_ms": now_ms, "request_id": str(req.request_id),
                     "prompt_tokens": req.prompt_tokens, "blocks": len(req.block_keys),
                     "cached_blocks": cached_blocks, **state, "choice": choice})

    def _write(self, obj: dict) -> None:
        self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
