"""Conductor scheduling: choose the prefill and decode instance of a request.

First version of the KVCache-centric scheduler (Mooncake FAST'25 §5,
Algorithm 1, simplified): every prefill instance reads the same global
store, so an instance's estimated work for a request is its queued prompt
tokens plus the tokens it must compute (prompt minus the cached prefix);
the instance with the least is chosen, with a bonus for the instance that
last computed this prefix (its own recent blocks are the likeliest to be
still resident). A decode instance is chosen by fewest active requests.

Thread safety: owned by the conductor's event loop; not locked.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefillInstance:
    instance_id: str
    address: str
    queued_requests: int = 0      # admitted, not finished prefill
    queued_tokens: int = 0        # tokens still to compute for those requests
    alive: bool = True


@dataclass(slots=True)
class DecodeInstance:
    instance_id: str
    address: str
    active_requests: int = 0
    alive: bool = True


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    instance: PrefillInstance
    tokens_to_compute: int        # prompt tokens not covered by the cached prefix
    estimated_load_tokens: int    # queue + own work: the scheduling score


class Scheduler:
    """Pure scheduling state and decisions.

    Args:
        affinity_tokens: score bonus (in tokens) for the instance that last
            computed the request's first block.
    """

    def __init__(self, prefill: list[PrefillInstance], decode: list[DecodeInstance],
                 affinity_tokens: int = 256):
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode instance")
        self.prefill = prefill
        self.decode = decode
        self.affinity_tokens = affinity_tokens
        self._last_owner: dict[str, str] = {}   # first block key -> prefill instance id

    def pick_prefill(self, prompt_tokens: int, cached_tokens: int, first_block_key: str | None
                     ) -> PrefillChoice:
        """Least estimated load among live prefill instances.

        Raises:
            RuntimeError: no live prefill instance.
        """
        to_compute = max(0, prompt_tokens - cached_tokens)
        owner = self._last_owner.get(first_block_key) if first_block_key else None
        best: PrefillChoice | None = None
        for inst in self.prefill:
            if not inst.alive:
                continue
            score = inst.queued_tokens + to_compute
            if inst.instance_id == owner:
                score -= self.affinity_tokens
            if best is None or score < best.estimated_load_tokens:
                best = PrefillChoice(inst, to_compute, score)
        if best is None:
            raise RuntimeError("no live prefill instance")
        if first_block_key:
            self._last_owner[first_block_key] = best.instance.instance_id
        return best

    def pick_decode(self) -> DecodeInstance:
        """Fewest active requests among live decode instances.

        Raises:
            RuntimeError: no live decode instance.
        """
        alive = [d for d in self.decode if d.alive]
        if not alive:
            raise RuntimeError("no live decode instance")
        return min(alive, key=lambda d: (d.active_requests, d.instance_id))
