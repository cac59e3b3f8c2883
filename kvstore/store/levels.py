"""A store node's chain of tiers: each tier with its own eviction policy and watermarks.

The chain is fastest first, and DRAM is always level 0 (where puts land and
the transports read)::

    level 0        level 1        level 2
    DRAM    --->   [GPU]   --->   [SSD]       (GPU with --gpu, SSD with --ssd)

Watermarks are fractions of a tier's capacity, with hysteresis::

    used > high            the tier starts draining
    while draining         reclaim rounds give up copies until used <= low
    want_bytes, ...        room that waiting writers and prefetches need, on top

Thread safety: a :class:`TierLevel` is owned by the node's lock
(:class:`~kvstore.store.table.ObjectTable`); every field and method is used
with it held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from kvstore.store.eviction import SlotPolicy, make_slot_policy
from kvstore.store.recount import Recount
from kvstore.store.tiers.base import Tier
from kvstore.types import TierKind

#: Default (high, low) watermarks per tier kind, as fractions of capacity.
DEFAULT_WATERMARKS: dict[TierKind, tuple[float, float]] = {
    TierKind.DRAM: (0.95, 0.85),
    TierKind.GPU: (0.95, 0.85),
    TierKind.SSD: (0.95, 0.90),
}


@dataclass(slots=True, eq=False)
class TierLevel:
    """One tier of the chain with its policy, watermarks and reclaim state."""

    tier: Tier
    policy: SlotPolicy          # by object slot (native arrays)
    high: float                 # fraction of capacity
    low: float
    want_bytes: int = 0         # room that waiting writers / promoters need now
    prefetch_want_bytes: int = 0  # room the next queued prefetch promotion needs
    rounds: int = 0             # reclaim rounds run for this level
    evictions: int = 0          # objects evicted from the node to make room here
    blocked: str = ""           # set by a round that could free nothing it needed
    blocked_round: int = 0      # the round that counted ``blocked`` (kept until RECOUNT_S)
    blocked_logged_s: float = 0.0
    blocked_count: Recount = field(default_factory=Recount)   # when to count ``blocked`` again
    draining: bool = False      # passed ``high``; reclaiming until back at ``low`` (hysteresis)

    def above_high(self) -> bool:
        """Whether the tier uses more than its high watermark."""
        return self.tier.used_bytes > self.high * self.tier.capacity_bytes

    def over_high_bytes(self) -> int:
        """Bytes used beyond the high watermark (<= 0: none)."""
        return self.tier.used_bytes - int(self.high * self.tier.capacity_bytes)

    def need_bytes(self) -> int:
        """Bytes this tier must give up now (starts or ends ``draining``).

        Passing ``high`` starts draining, which goes on -- over later rounds,
        as readers let go -- until use is back at ``low``; a round that frees
        only part of the excess does not end it. Room that waiters need
        (``want_bytes``, ``prefetch_want_bytes``) counts even when not draining.
        """
        cap = self.tier.capacity_bytes
        if self.tier.used_bytes > self.high * cap:
            self.draining = True
        excess = self.tier.used_bytes - int(self.low * cap) if self.draining else 0
        if excess <= 0:
            self.draining = False
            excess = 0
        return max(excess, self.want_bytes + self.prefetch_want_bytes)


def build_levels(chain: Sequence[Tier], policy: str, high_watermark: float,
                 low_watermark: float, ssd_watermarks: tuple[float, float]) -> list[TierLevel]:
    """The levels of a tier chain, one policy instance per tier.

    Args:
        chain: the tiers, fastest first; the first must be DRAM.
        policy: eviction policy name (``kvstore.store.eviction`` registry).
        high_watermark, low_watermark: of the memory tiers (DRAM, GPU).
        ssd_watermarks: (high, low) of the SSD tier.

    Returns:
        One :class:`TierLevel` per tier, in chain order.

    Raises:
        ValueError: an empty chain, one that does not start with DRAM, or
            watermarks outside ``0 < low <= high <= 1``.
        KeyError: no policy of that name.
    """
    if not chain or chain[0].kind is not TierKind.DRAM:
        raise ValueError("a node's tier chain must start with its DRAM tier")
    levels = []
    for tier in chain:
        high, low = ssd_watermarks if tier.kind is TierKind.SSD else (high_watermark,
                                                                        low_watermark)
        if not 0 < low <= high <= 1:
            raise ValueError(f"{tier.kind.name}: need 0 < low ({low}) <= high ({high}) <= 1")
        levels.append(TierLevel(tier, make_slot_policy(policy), high, low))
    return levels
