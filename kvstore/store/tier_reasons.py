"""Why a tier gives nothing up: what holds its objects, counted, in one line.

A tier over its high watermark with nothing evictable says why (the node's
stats, its log, a NoSpace message): the objects being read or written, moved,
hard-pinned, protected by prefetch lookahead, awaiting their master's
confirmation or their last reader, and the bytes the policy keeps for prefix
chains. O(objects): callers count it at most every RECOUNT_S
(:mod:`kvstore.store.tiering`).

Thread safety: called with the node's lock held.
"""

from __future__ import annotations

from kvstore.store.levels import TierLevel
from kvstore.store.objects import ObjectState
from kvstore.store.table import ObjectTable


def blocked_reason(table: ObjectTable, lv: TierLevel, level: int, bottom: bool,
                   now: float) -> str:
    """Why nothing at ``level`` (``lv``; ``bottom``: the slowest tier) can be given up."""
    here = [o for o in table.objects.values() if o.copy(level) is not None]
    reading = sum(o.refs > 0 or o.state is not ObjectState.COMPLETE for o in here)
    unconfirmed = 0 if bottom else sum(
        o.state is ObjectState.COMPLETE and not o.confirmed for o in here)
    moving = sum(o.moving or o.promoting for o in here)
    pinned = sum(o.hard_pins > 0 for o in here)
    protected = sum(o.protect_until_s > now for o in here)
    doomed = sum(o.copy(level) is not None for o in table.doomed)
    held = sum(o.copy(level).reserved_bytes for o in here
               if not o.can_give_up(level, True, now) or not (bottom or o.confirmed))
    held += sum(o.copy(level).reserved_bytes for o in table.doomed
                if o.copy(level) is not None)
    used, cap = lv.tier.used_bytes, lv.tier.capacity_bytes
    chains = ("" if held >= used else
              f"; the policy offers none of the other {used - held} B (a prefix-chain "
              f"block goes only after its cached continuations)")
    return (f"nothing evictable in {lv.tier.kind.name} ({used} of {cap} B used): "
            f"{reading} objects being read or written, {moving} being moved, "
            f"{pinned} hard-pinned, {protected} protected by prefetch lookahead, "
            f"{unconfirmed} awaiting their master's confirmation, "
            f"{doomed} awaiting their last reader{chains}")
