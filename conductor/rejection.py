"""Early rejection: which decode load a request is checked against when it arrives.

Mooncake (arXiv 2407.00079 §7; FAST'25 §6) serves an overloaded cluster by
refusing requests it cannot serve within the SLOs. A request refused late --
after its prefill ran, because its decode instance has no room -- wastes the
prefill; so the conductor checks the decode side early, at arrival. Three
modes, each a tiny policy returning the decode load to check::

    none        no check at arrival: a request that finds no room when its
                prefill ends is refused then, and its prefill is wasted
    early       the decode batches as they are *now* (Algorithm 1 as
                written): blind both to the requests already in prefill (it
                admits bursts that overflow decode later) and to the members
                that will have left by the time this prefill ends (it refuses
                what would have fit): prefill and decode load swing in
                anti-phase (§7.3)
    predictive  the load predicted for the moment this request's prefill
                ends: the members predicted still decoding then, plus the
                requests in prefill bound to the same instance (§7.4)

Algorithm 1 returns a (prefill, decode) pair: the decode instance is bound at
arrival, because the prefill streams the KVCache to it layer by layer (FAST'25
§3). Whatever the mode, it is the least-loaded instance the check allows,
counting the requests already bound to each (so a burst spreads out). The
TTFT SLO is checked at arrival in every mode (Algorithm 1, line 16), and the
bound decode instance again when the prefill ends: that late check is the
truth, the early one a forecast.

The forecast (:class:`DecodeForecaster`) starts from the paper's system-level
simplification -- every request decodes for the same time ``t_d``, so a
member that started at ``s`` is gone at ``s + t_d`` -- and by default
replaces ``t_d`` with the empirical survival of decode times (see the class).

Thread safety: owned by the scheduler, on the conductor's loop.
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Sequence

from kvstore.conductor.instances import DecodeInstance, DecodeLoad
from kvstore.registry import Registry


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives; ``inf`` disables a check.

    The defaults, TTFT 30 s and TBT 100 ms per token, are the thresholds of
    Mooncake FAST'25's real-workload experiment (§8) as we recall them.
    """

    ttft_ms: float = 30_000.0  # time to first token
    tbt_ms: float = 100.0  # time between tokens (decode step time)

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tbt_ms > 0):
            raise ValueError(f"SLOs must be positive (inf disables), got {self}")

    @classmethod
    def none(cls) -> "Slo":
        """No objectives: nothing is ever refused for latency."""
        return cls(math.inf, math.inf)


@dataclass(slots=True)
class _InFlight:
    decode_id: str | None  # decode instance planned at arrival, if any
    prefill_end_ms: float  # predicted end of its prefill
    context_tokens: int  # KV tokens it will hold in decode


@dataclass(slots=True)
class _Decoding:
    start_ms: float
    context_tokens: int


class DecodeForecaster:
    """Decode load now and predicted at a later time.

    Departures are predicted one of two ways:

    * ``"uniform"`` -- the paper's simplification: every request decodes for
      the running mean time ``t_d``, so a member that started at ``s`` is
      gone at ``s + t_d``.
    * ``"survival"`` (default) -- output lengths are heavy-tailed, so a member
      that has decoded long is likely to decode longer, which ``t_d`` misses.
      A member of age ``a`` is still decoding ``h`` later with probability
      ``S(a + h) / S(a)``, ``S`` the empirical survival function of the last
      ``window`` decode times seen; it is counted gone only when that
      probability is at most ``confidence_gone`` (default 5%). Admission is
      deliberately conservative: a wrongly admitted request costs a wasted
      prefill *and* is refused anyway; a wrongly refused one costs only itself.
      With ``confidence_gone = 0`` nobody is predicted gone: the check is a
      pure reservation (batches plus bound requests).

    Args:
        decode: the decode instances (their live counters give the load now).
        departures: "survival" or "uniform".
        confidence_gone: survival probability at or below which a member is
            predicted gone ("survival" only).
        decode_time_prior_ms: ``t_d`` before any decode finished.
        output_tokens_prior: mean output length before any decode finished.
        smoothing: weight of each finished request in the running means.
        window: decode times kept for the survival function.
    """

    def __init__(self, decode: Sequence[DecodeInstance], departures: str = "survival",
                 confidence_gone: float = 0.05, decode_time_prior_ms: float = 20_000.0,
                 output_tokens_prior: float = 256.0, smoothing: float = 0.02, window: int = 4096):
        if departures not in ("survival", "uniform"):
            raise ValueError(f"departures must be 'survival' or 'uniform', got {departures!r}")
        self.decode = list(decode)
        self.departures = departures
        self.confidence_gone = confidence_gone
        self.decode_time_ms = decode_time_prior_ms
        self.output_tokens = output_tokens_prior
        self.smoothing = smoothing
        self._inflight: dict[Hashable, _InFlight] = {}
        self._decoding: dict[str, dict[Hashable, _Decoding]] = {d.instance_id: {} for d in self.decode}
        self._finished = 0
        self._times: deque[float] = deque(maxlen=window)  # recent decode times (ms)
        self._sorted: list[float] = []  # sorted copy of _times, refreshed lazily
        self._stale = 0

    # ------------------------------------------------------------ events

    def admitted(self, request_id: Hashable, decode_id: str | None, prefill_end_ms: float,
                 prompt_tokens: int) -> None:
        """A request entered prefill, predicted to end at ``prefill_end_ms``."""
        self._inflight[request_id] = _InFlight(decode_id, prefill_end_ms, prompt_tokens)

    def decode_started(self, request_id: Hashable, decode_id: str, now_ms: float,
                       prompt_tokens: int) -> None:
        """The request left prefill and joined ``decode_id``'s batch."""
        self._inflight.pop(request_id, None)
        self._decoding[decode_id][request_id] = _Decoding(now_ms, prompt_tokens)

    def decode_finished(self, request_id: Hashable, decode_id: str, now_ms: float,
                        output_tokens: int) -> None:
        """The request's decode ended; its time and length feed the running means."""
        rec = self._decoding[decode_id].pop(request_id, None)
        if rec is None:
            return
        took = now_ms - rec.start_ms
        w = self.smoothing if self._finished else 1.0
        self._finished += 1
        self.decode_time_ms += w * (took - self.decode_time_ms)
        self.output_tokens += w * (output_tokens - self.output_tokens)
        self._times.append(took)
        self._stale += 1

    def dropped(self, request_id: Hashable) -> None:
        """The request was refused after admission (e.g. at the decode check)."""
        self._inflight.pop(request_id, None)

    # ------------------------------------------------------------ state

    def snapshot(self) -> dict:
        """Everything the forecasts are made from, as JSON-able data (see :meth:`restore`).

        Request ids become strings. Used to record the live conductor's state
        beside each decision, so the same decision can be recomputed elsewhere.
        """
        return {
            "decode_time_ms": self.decode_time_ms, "output_tokens": self.output_tokens,
            "finished": self._finished, "times_ms": list(self._times),
            "sorted_ms": list(self._sorted), "stale": self._stale,
            "inflight": {str(k): [v.decode_id, v.prefill_end_ms, v.context_tokens]
                         for k, v in self._inflight.items()},
            "decoding": {d: {str(k): [v.start_ms, v.context_tokens] for k, v in members.items()}
                         for d, members in self._decoding.items()},
        }

    def restore(self, state: dict) -> None:
        """Replaces the forecasts' state with a :meth:`snapshot` (its decode instance ids
        must be this forecaster's).

        Raises:
            KeyError: a field is missing, or a decode instance id is unknown.
        """
        self.decode_time_ms = float(state["decode_time_ms"])
        self.output_tokens = float(state["output_tokens"])
        self._finished = int(state["finished"])
        self._times.clear()
        self._times.extend(float(t) for t in state["times_ms"])
        self._sorted = [float(t) for t in state["sorted_ms"]]
        self._stale = int(state["stale"])
        self._inflight = {k: _InFlight(d, float(e), int(c)) for k, (d, e, c) in state["inflight"].items()}
        for d in self._decoding:
            self._decoding[d] = {}
        for d, members in state["decoding"].items():
            if d not in self._decoding:
                raise KeyError(f"unknown decode instance {d!r} in the forecast state")
            self._decoding[d] = {k: _Decoding(float(s), int(c)) for k, (s, c) in members.items()}

    # ------------------------------------------------------------ loads

    def load_live(self) -> list[DecodeLoad]:
        """Every live decode instance's running batch (what the late check sees)."""
        return [DecodeLoad(d, d.active_requests, d.context_tokens) for d in self.decode if d.alive]

    def _bound(self) -> dict[str, tuple[int, int]]:
        """Per decode instance: (requests, KV tokens) in prefill and bound to it."""
        half_out = int(self.output_tokens / 2)
        bound: dict[str, tuple[int, int]] = {}
        for rec in self._inflight.values():
            if rec.decode_id is not None:
                n, ctx = bound.get(rec.decode_id, (0, 0))
                bound[rec.decode_id] = (n + 1, ctx + rec.context_tokens + half_out)
        return bound

    def load_now(self) -> list[DecodeLoad]:
        """Every live decode instance's load now: its batch plus the requests bound to it."""
        bound = self._bound()
        return [DecodeLoad(d, d.active_requests + bound.get(d.instance_id, (0, 0))[0],
                           d.context_tokens + bound.get(d.instance_id, (0, 0))[1])
                for d in self.decode if d.alive]

    def _survival(self) -> list[float]:
        """The sorted recent decode times (refreshed every 64 finishes)."""
        if self._stale >= 64 or len(self._sorted) < min(len(self._times), 64):
            self._sorted = sorted(self._times)
            self._stale = 0
        return self._sorted

    def still_decoding(self, age_ms: float, horizon_ms: float) -> float:
        """Probability that a member decoding for ``age_ms`` still decodes ``horizon_ms`` later."""
        if self.departures == "uniform" or not self._times:
            return 1.0 if age_ms + horizon_ms < self.decode_time_ms else 0.0
        times = self._survival()
        n = len(times)
        alive_now = n - bisect.bisect_right(times, age_ms)
        if alive_now == 0:
            return 1.0  # older than anything seen: no evidence it ends soon
        return (n - bisect.bisect_right(times, age_ms + horizon_ms)) / alive_now

    def load_at(self, now_ms: float, t_ms: float) -> list[DecodeLoad]:
        """Every live decode instance's load predicted for time ``t_ms``.

        Its members not predicted gone by then (see the class docstring),
        plus every request in prefill bound to it: those admitted before keep
        their claim, whenever their prefill ends.
        """
        half_out = int(self.output_tokens / 2)
        horizon = max(t_ms - now_ms, 0.0)
        bound = self._bound()
        out = []
        for d in self.decode:
            if not d.alive:
                continue
            batch, ctx = bound.get(d.instance_id, (0, 0))
            for rec in self._decoding[d.instance_id].values():
                if self.still_decoding(now_ms - rec.start_ms, horizon) > self.confidence_gone:
                    batch += 1
                    ctx += rec.context_tokens + half_out
            out.append(DecodeLoad(d, batch, ctx))
        return out


class RejectionPolicy(ABC):
    """Says which decode load a request is checked against at arrival, if any."""

    name: str = "base"  # set by @register_rejection_policy

    @abstractmethod
    def check_load(self, forecast: DecodeForecaster, now_ms: float, prefill_end_ms: float
                   ) -> list[DecodeLoad] | None:
        """The decode load to check a request against at arrival; None: no check."""


REJECTIONS: Registry[RejectionPolicy] = Registry("rejection policy")

#: Registered rejection policies by name.
REJECTION_POLICIES = REJECTIONS.classes
#: Class decorator: registers a rejection policy under a name.
register_rejection_policy = REJECTIONS.register
#: Builds the rejection policy registered under a name (KeyError if unknown).
make_rejection_policy = REJECTIONS.make


@register_rejection_policy("none")
class NoEarlyRejection(RejectionPolicy):
    """No check at arrival; the bound decode instance is checked when the prefill ends."""

    def check_load(self, forecast, now_ms, prefill_end_ms):
        return None


@register_rejection_policy("early")
class EarlyRejection(RejectionPolicy):
    """Check against the decode batches as they are at arrival."""

    def check_load(self, forecast, now_ms, prefill_end_ms):
        return forecast.load_live()


@register_rejection_policy("predictive")
class PredictiveRejection(RejectionPolicy):
    """Check against the decode load predicted for the end of this request's prefill."""

    def check_load(self, forecast, now_ms, prefill_end_ms):
        return forecast.load_at(now_ms, prefill_end_ms)


DEFAULT_REJECTION_POLICY = "none"

__all__ = [
    "DEFAULT_REJECTION_POLICY",
    "REJECTION_POLICIES",
    "DecodeForecaster",
    "RejectionPolicy",
    "Slo",
    "make_rejection_policy",
    "register_rejection_policy",
]
