"""How fast the demo sends its requests: a rate the bundled engines can serve.

A replay at a rate above what the prefill engines compute measures queueing,
not the cache: every TTFT is the queue's length, with or without hits. The
demo derives its arrival rate from the profiled cost model
(:mod:`kvstore.conductor.cost_model`, ``tiny-cpu`` for the bundled engines)::

    prefill_s      = mean over the window of cost.prefill_ms(prompt tokens, 0 cached) / 1000
    capacity_rps   = num_prefill / prefill_s            (every prompt computed: the no-cache mode)
    rate_rps       = target_utilisation * capacity_rps

The no-cache cost is used so that *both* modes are servable at the same
rate; the cached mode then runs below the target. The target leaves room
for what the profile did not see: the profile ran one engine alone on an
idle core, while the demo shares the machine's cores among the engines, the
store nodes, the conductor and the replay client.

The window keeps the trace's arrival pattern (its bursts and lulls) and
only stretches its clock: arrival ``i`` is at
``(timestamp_i - timestamp_first) * time_scale`` with ``time_scale`` chosen
so that the window's mean rate is ``rate_rps``. ``--overload`` uses a target
above 1 (arrivals above capacity).

Thread safety: pure functions and a frozen record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from kvstore.conductor.cost_model import CostModel
from kvstore.errors import InvalidArgument
from kvstore.tools.demo.trace import ScaledRequest, TraceRecord

DEFAULT_TARGET_UTILISATION = 0.35
"""Predicted busy fraction of the prefill engines in the no-cache mode. Low on
purpose: on the 2 shared development cores the demo's prefill engine ran
about 2x slower than the profile (287 against 138 ms per request), so this
is about 0.75 of what it really computes there."""

OVERLOAD_UTILISATION = 2.0
"""``--overload``: arrivals at twice the predicted no-cache capacity."""


@dataclass(frozen=True, slots=True)
class ArrivalPlan:
    """The demo's arrival rate and how it was derived."""

    rate_rps: float  # mean arrival rate over the window, requests per second
    time_scale: float  # trace clock multiplier that gives that rate
    target_utilisation: float  # predicted prefill busy fraction with nothing cached
    mean_prefill_ms: float  # predicted prefill time of a window request, nothing cached
    capacity_rps: float  # requests per second the prefill engines compute, nothing cached
    num_prefill: int  # prefill engines
    cost_model: str  # name of the cost model used
    derived: bool  # False: ``time_scale`` was given and the rate follows from it

    def describe(self) -> str:
        """One line for the CLI and the README."""
        if not self.derived and self.time_scale == 0:
            return "all at once (--time-scale 0)"
        if not self.derived:
            return (f"{self.rate_rps:.2f} requests/s from the given --time-scale "
                    f"{self.time_scale:g} (predicted no-cache prefill utilisation "
                    f"{self.target_utilisation:.0%} by cost model {self.cost_model})")
        return (f"{self.rate_rps:.2f} requests/s = {self.target_utilisation:.0%} of the "
                f"{self.capacity_rps:.2f} requests/s that {self.num_prefill} prefill engine(s) "
                f"compute without cache (cost model {self.cost_model}: "
                f"{self.mean_prefill_ms:.0f} ms per window request); trace clock x "
                f"{self.time_scale:.3g}")


def _span_ms(records: Sequence[TraceRecord]) -> float:
    return float(records[-1].timestamp_ms - records[0].timestamp_ms) if records else 0.0


def plan_arrivals(records: Sequence[TraceRecord], requests: Sequence[ScaledRequest],
                  cost: CostModel, num_prefill: int = 1,
                  target_utilisation: float = DEFAULT_TARGET_UTILISATION,
                  time_scale: float | None = None) -> ArrivalPlan:
    """The arrival rate for the window ``records`` (scaled as ``requests``).

    Args:
        records: the window's trace records, in order (their timestamps).
        requests: the same requests, scaled (their prompt lengths).
        cost: the engines' cost model.
        num_prefill: prefill engines serving the window.
        target_utilisation: predicted busy fraction of the prefill engines
            with nothing cached (> 0; above 1 is overload).
        time_scale: given: use this trace clock multiplier instead of deriving it.

    Returns:
        The plan. A window whose requests all arrive at once (span 0) gets
        ``time_scale`` 0 and an infinite rate.

    Raises:
        InvalidArgument: no requests, ``num_prefill < 1`` or a non-positive target.
    """
    if not requests or len(records) != len(requests):
        raise InvalidArgument("need the window's records and as many scaled requests")
    if num_prefill < 1 or target_utilisation <= 0:
        raise InvalidArgument(f"need num_prefill >= 1 and target_utilisation > 0, got "
                         f"{num_prefill}, {target_utilisation}")
    mean_ms = sum(cost.prefill_ms(r.num_prompt_tokens, 0) for r in requests) / len(requests)
    capacity = num_prefill * 1000.0 / mean_ms if mean_ms > 0 else float("inf")
    span_ms = _span_ms(records)
    n_gaps = max(len(requests) - 1, 1)
    if time_scale is None:
        rate = target_utilisation * capacity
        scale = (n_gaps / rate * 1000.0) / span_ms if span_ms > 0 else 0.0
        return ArrivalPlan(rate, scale, target_utilisation, mean_ms, capacity, num_prefill,
                           cost.name, derived=True)
    rate = n_gaps * 1000.0 / (span_ms * time_scale) if span_ms * time_scale > 0 else float("inf")
    return ArrivalPlan(rate, time_scale, rate / capacity, mean_ms, capacity, num_prefill,
                       cost.name, derived=False)


def retime(requests: Sequence[ScaledRequest], records: Sequence[TraceRecord],
           time_scale: float) -> list[ScaledRequest]:
    """The requests with arrivals ``(timestamp - first timestamp) * time_scale`` ms."""
    t0 = records[0].timestamp_ms if records else 0
    return [dataclasses.replace(r, arrival_ms=(rec.timestamp_ms - t0) * time_scale)
            for r, rec in zip(requests, records)]


__all__ = ["ArrivalPlan", "DEFAULT_TARGET_UTILISATION", "OVERLOAD_UTILISATION",
           "plan_arrivals", "retime"]
