"""The records the conductor schedules with: instances, requests, choices, rejections.

Scheduler, policies, the live conductor (:mod:`kvstore.conductor.service`) and the
simulator (:mod:`kvstore.tools.sim.simulate`) talk through these small dataclasses only.
Who owns what::

    PrefillInstance / DecodeInstance   mutable, slotted; the live counters are
                                       kept by whoever runs the requests (the
                                       conductor service or the simulator)
    SchedRequest                       frozen; one request as the scheduler sees it
    PrefillChoice / DecodeChoice       frozen; a plan the scheduler returns
    Rejection                          frozen; why a request is refused, with numbers

Thread safety: the mutable records belong to the conductor's event loop (or
the simulator's single thread); they are not locked.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

BlockKey = Hashable
"""A prefix block's key (a store key string live, an interned int in the simulator)."""


@dataclass(slots=True)
class PrefillInstance:
    """One prefill engine as the scheduler sees it."""

    instance_id: str
    address: str = ""
    queued_requests: int = 0  # admitted, not finished prefill
    queued_tokens: int = 0  # tokens still to compute for those requests
    alive: bool = True  # kept by the health monitor; dead instances get no work
    busy_until_ms: float = 0.0  # predicted end of the running job; <= now when idle
    queued_ms: float = 0.0  # predicted ms of queued online work not yet started


@dataclass(slots=True)
class DecodeInstance:
    """One decode engine as the scheduler sees it."""

    instance_id: str
    address: str = ""
    active_requests: int = 0  # requests in its running batch
    alive: bool = True  # kept by the health monitor
    context_tokens: int = 0  # KV tokens the active requests hold


@dataclass(frozen=True, slots=True)
class SchedRequest:
    """One request as the scheduler sees it."""

    request_id: Hashable
    prompt_tokens: int  # prompt length in tokens
    block_keys: tuple[BlockKey, ...] = ()  # prefix keys of its blocks, head first
    online: bool = True  # False: offline (batch) work, delayed rather than rejected


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """Where and how a request's prefill runs, with the scheduler's estimates."""

    instance: PrefillInstance
    tokens_to_compute: int  # prompt tokens not covered by the reused prefix
    estimated_load_tokens: int  # queued tokens + own work (the live scheduler's score)
    estimated_ttft_ms: float = 0.0  # queue_ms + transfer_ms + prefill_ms
    queue_ms: float = 0.0  # predicted wait before the prefill starts
    prefill_ms: float = 0.0  # predicted compute time
    transfer_ms: float = 0.0  # predicted time to fetch the remote prefix
    local_prefix_blocks: int = 0  # leading blocks the instance holds
    transfer_blocks: int = 0  # further leading blocks fetched from ``transfer_from``
    transfer_from: str | None = None  # instance holding the best prefix, when fetched

    @property
    def reused_blocks(self) -> int:
        """Leading blocks whose KV is reused rather than computed."""
        return self.local_prefix_blocks + self.transfer_blocks


@dataclass(frozen=True, slots=True)
class DecodeChoice:
    """The decode instance picked for a request."""

    instance: DecodeInstance
    predicted_tbt_ms: float  # step time of its batch with the request in it


class RejectReason(enum.Enum):
    """Why a request is refused."""

    TTFT_SLO = "ttft_slo"  # no prefill instance can meet the TTFT SLO
    TBT_SLO = "tbt_slo"  # no decode instance can take it within the TBT SLO
    KV_CAPACITY = "kv_capacity"  # no decode instance has room for its KV
    NO_INSTANCE = "no_instance"  # no live instance of a role


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refusal, with the numbers that decided it."""

    reason: RejectReason
    detail: str  # human-readable, with the estimate and the SLO
    estimated_ttft_ms: float = 0.0
    predicted_tbt_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """Algorithm 1's answer: a (prefill, decode) pair, or a rejection."""

    prefill: PrefillChoice | None
    decode: DecodeChoice | None  # the decode instance bound at arrival; None when rejected
    rejection: Rejection | None = None

    @property
    def accepted(self) -> bool:
        return self.rejection is None


@dataclass(frozen=True, slots=True)
class DecodeLoad:
    """A decode instance's load, now or predicted for a later time."""

    instance: DecodeInstance
    batch_size: int  # requests in the batch
    context_tokens: int  # KV tokens they hold


class CacheView(Protocol):
    """Which prefix of a request each prefill instance holds locally.

    The simulator answers from each instance's pool; a deployment whose
    instances all read one shared store has no per-instance view.
    """

    def prefix_blocks(self, instance_id: str, block_keys: Sequence[BlockKey]) -> int:
        """Number of leading ``block_keys`` the instance holds."""
        ...


__all__ = [
    "BlockKey",
    "CacheView",
    "Decision",
    "DecodeChoice",
    "DecodeInstance",
    "DecodeLoad",
    "PrefillChoice",
    "PrefillInstance",
    "RejectReason",
    "Rejection",
    "SchedRequest",
]
