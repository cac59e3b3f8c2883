"""What a store node reports about itself: per-tier use and the node's counters.

Sent to the master in heartbeats (``TierStat``, ``counters``) and straight to
a client by the STATS data op (:meth:`NodeStats.to_dict`, JSON). For every
tier ``used_bytes + free_bytes == capacity_bytes``.

The node's counters (since start)::

    puts, gets, drops          objects committed, reads (read references taken, and same-host
                               reads without one: SHM_TOUCH), objects dropped by order
    checksum_errors            writes whose bytes did not match their checksum
    evictions                  objects the node gave up (an EVICTED event each)
    evicted_no_room            ... of which: a DRAM/GPU victim no slower tier could take
    demotions                  copies written to a slower tier (durable, for SSD)
    demotion_failures          ... that failed (the object was evicted instead)
    promotions                 copies up to DRAM (reads of objects not in DRAM, prefetches)
    promotion_failures         ... that found no room in time (TCP then reads the slower copy)
    prefetch_requests          PREFETCH ops accepted
    prefetches                 lookahead protections started (a repeat extends one)
    prefetch_used              ... ended by a read before the deadline
    prefetch_wasted            ... ended by the deadline (or a drop) without a read
    pins, unpins               PIN ops, UNPIN ops that removed a pin
    recovered                  objects adopted from the SSD at start
    stalled_writes             writers dropped for stalling mid-value (their space freed)
    accept_errors              failed accepts (out of fds): retried with a backoff
    connections_refused        connections over --max-connections, answered UNAVAILABLE
    no_fit                     puts refused at once: not even evicting everything evictable
                               would make room (nothing was evicted for them)
    fenced                     reads and writes refused while no master had acknowledged the
                               node for most of its ttl (kvstore.store.lease)

The node counts with :class:`NodeCounter`; what leaves the node (heartbeat
``counters``, the STATS JSON, :attr:`NodeStats.counters`) is keyed by the
counters' plain string names above (:func:`counters_by_name`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

from kvstore.types import TierStats

if TYPE_CHECKING:
    from kvstore.store.levels import TierLevel
    from kvstore.store.objects import StoredObject


class NodeCounter(str, enum.Enum):
    """One of the node's counters, valued as its name in reports (see the module docstring)."""

    PUTS = "puts"
    GETS = "gets"
    DROPS = "drops"
    CHECKSUM_ERRORS = "checksum_errors"
    EVICTIONS = "evictions"
    DEMOTIONS = "demotions"
    DEMOTION_FAILURES = "demotion_failures"
    EVICTED_NO_ROOM = "evicted_no_room"
    PROMOTIONS = "promotions"
    PROMOTION_FAILURES = "promotion_failures"
    PREFETCH_REQUESTS = "prefetch_requests"
    PREFETCHES = "prefetches"
    PREFETCH_USED = "prefetch_used"
    PREFETCH_WASTED = "prefetch_wasted"
    PINS = "pins"
    UNPINS = "unpins"
    RECOVERED = "recovered"
    STALLED_WRITES = "stalled_writes"
    ACCEPT_ERRORS = "accept_errors"
    CONNECTIONS_REFUSED = "connections_refused"
    NO_FIT = "no_fit"
    FENCED = "fenced"


def counters_by_name(counters: Mapping[NodeCounter, int]) -> dict[str, int]:
    """The counters keyed by their plain string names, as they leave the node.

    Args:
        counters: the node's counters, by :class:`NodeCounter`.

    Returns:
        A new dict, in the same order, with ``str`` keys (``"puts"``, ...).
    """
    return {counter.value: n for counter, n in counters.items()}


@dataclass(frozen=True, slots=True)
class NodeStats:
    """The DRAM tier (where puts land) in the flat fields, every tier in ``tiers``."""

    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    num_objects: int         # COMPLETE objects, any tier
    num_writing: int
    num_referenced: int      # complete objects with a reader (or a move) in flight
    num_doomed: int
    num_evictable: int       # objects whose DRAM copy could be given up now
    evictions: int           # objects evicted from the node since start
    tiers: tuple[TierStats, ...] = ()
    counters: dict[str, int] | None = None
    eviction_policy: str = ""     # the node's policy by registry name (lru, lfu, default, none)

    def to_dict(self) -> dict:
        """JSON-ready form (tier kinds by name), as the STATS data op sends it."""
        out = {f: getattr(self, f) for f in self.__slots__ if f != "tiers"}
        out["tiers"] = [{**{f: getattr(t, f) for f in t.__slots__}, "kind": t.kind.name}
                        for t in self.tiers]
        return out


def tier_stats(lv: TierLevel, level: int, objs: list[StoredObject], now: float,
               blocked_reason: Callable[[int, float], str]) -> TierStats:
    """One tier's use, counted now (the node's lock held).

    Args:
        lv: the tier's level; ``level`` its index in the chain.
        objs: the node's objects in service.
        now: ``time.monotonic()`` of the count.
        blocked_reason: why eviction cannot free the tier ``(level, now)``, asked
            only when it is over its high watermark with nothing evictable.
    """
    here = [o for o in objs if o.copies[level] is not None]
    evictable = sum(o.copies[level].reserved_bytes for o in here
                    if o.can_give_up(level, True, now))
    blocked = lv.blocked if lv.need_bytes() > 0 else ""
    if not blocked and lv.above_high() and not evictable:
        blocked = blocked_reason(level, now)
    return TierStats(
        kind=lv.tier.kind, capacity_bytes=lv.tier.capacity_bytes,
        used_bytes=lv.tier.used_bytes, free_bytes=lv.tier.free_bytes,
        evictable_bytes=evictable, num_objects=len(here),
        num_reading=sum(o.refs > 0 for o in here),
        num_pinned=sum(o.hard_pins > 0 for o in here),
        num_soft_pinned=sum(o.soft_pin_until_s > now for o in here),
        num_protected=sum(o.protect_until_s > now for o in here),
        high_watermark=lv.high, low_watermark=lv.low, eviction_blocked=blocked)
