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
    recovery_dropped_corrupt   ... records dropped at start as damaged (unreadable, wrong size
                               or checksum; with --ssd-quarantine, what could not be copied out)
    recovery_dropped_surplus   ... intact records dropped at start: over the SSD's capacity
    stalled_writes             writers dropped for stalling mid-value (their space freed)
    stalled_reads              readers dropped for taking no byte of their replies within the
                               send deadline, or whose host stopped answering (references freed)
    peers_lost                 idle data connections closed because the client's host stopped
                               answering TCP keepalive (within about twice the send deadline)
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
from typing import TYPE_CHECKING, Mapping

from kvstore.store.objects import ObjectState
from kvstore.types import TierKind, TierStats

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
    RECOVERY_DROPPED_CORRUPT = "recovery_dropped_corrupt"
    RECOVERY_DROPPED_SURPLUS = "recovery_dropped_surplus"
    STALLED_WRITES = "stalled_writes"
    STALLED_READS = "stalled_reads"
    PEERS_LOST = "peers_lost"
    ACCEPT_ERRORS = "accept_errors"
    CONNECTIONS_REFUSED = "connections_refused"
    NO_FIT = "no_fit"
    OVER_OBJECT_LIMIT = "over_object_limit"     # writes refused at --max-objects
    EVICTED_FOR_COUNT = "evicted_for_count"     # objects evicted to stay under it
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


@dataclass(frozen=True, slots=True)
class TierUse:
    """One tier's byte accounting, read under the node's lock (for :func:`tier_stats`)."""

    level: int               # its index in the chain
    kind: TierKind
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    high: float
    low: float
    blocked: str             # the mover's reason while the tier needs room, else ""
    above_high: bool

    @classmethod
    def of(cls, lv: TierLevel, level: int) -> "TierUse":
        return cls(level, lv.tier.kind, lv.tier.capacity_bytes, lv.tier.used_bytes,
                   lv.tier.free_bytes, lv.high, lv.low,
                   lv.blocked if lv.need_bytes() > 0 else "", lv.above_high())


def count_objects(objs: list[StoredObject], uses: list[TierUse], now: float,
                  **head) -> NodeStats:
    """A node's stats: its tiers' ``uses`` and a count of ``objs`` (the objects in
    service, a snapshot), without the node's lock; ``head``: the other fields."""
    complete = writing = referenced = evictable = 0
    for o in objs:
        done = o.state is ObjectState.COMPLETE
        complete += done
        writing += o.state is ObjectState.WRITING
        referenced += done and o.refs > 0
        evictable += o.can_give_up(0, True, now)
    return NodeStats(num_objects=complete, num_writing=writing, num_referenced=referenced,
                     num_evictable=evictable,
                     tiers=tuple(tier_stats(use, objs, now) for use in uses), **head)


def tier_stats(use: TierUse, objs: list[StoredObject], now: float) -> TierStats:
    """One tier's use: ``use`` and a count of ``objs`` (the node's objects in service,
    a snapshot), in one pass, without the node's lock (an object may change while
    it is counted: these are statistics). ``eviction_blocked`` is ``use.blocked``;
    the caller asks why when the tier is over its high watermark with nothing
    evictable (see :meth:`kvstore.store.node.StoreNode.stats`)."""
    level = use.level
    n = evictable = reading = pinned = soft = protected = 0
    for o in objs:
        copy = o.copy(level)
        if copy is None:
            continue
        n += 1
        if o.can_give_up(level, True, now):
            evictable += copy.reserved_bytes
        reading += o.refs > 0
        pinned += o.hard_pins > 0
        soft += o.soft_pin_until_s > now
        protected += o.protect_until_s > now
    return TierStats(
        kind=use.kind, capacity_bytes=use.capacity_bytes, used_bytes=use.used_bytes,
        free_bytes=use.free_bytes, evictable_bytes=evictable, num_objects=n,
        num_reading=reading, num_pinned=pinned, num_soft_pinned=soft,
        num_protected=protected, high_watermark=use.high, low_watermark=use.low,
        eviction_blocked=use.blocked)
