"""What a store node reports about itself: per-tier use and the node's counters.

Sent to the master in heartbeats (``TierStat``, ``counters``) and straight to
a client by the STATS data op (:meth:`NodeStats.to_dict`, JSON). For every
tier ``used_bytes + free_bytes == capacity_bytes``.

The node's counters (since start)::

    puts, gets, drops          objects committed, read references taken, dropped by order
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
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.types import TierStats


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

    def to_dict(self) -> dict:
        """JSON-ready form (tier kinds by name), as the STATS data op sends it."""
        out = {f: getattr(self, f) for f in self.__slots__ if f != "tiers"}
        out["tiers"] = [{**{f: getattr(t, f) for f in t.__slots__}, "kind": t.kind.name}
                        for t in self.tiers]
        return out
