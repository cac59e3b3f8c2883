"""A store node's lease on serving: it serves only while its master shards could not
have declared it dead.

A master shard declares a node dead once it heard nothing from it for
``node_ttl_ms``; from then on it stops offering the node's replicas, repairs
them elsewhere, and keeps what the node must drop (removed keys, replaced
versions) until the node's next heartbeat reply carries it. A node cut off
from its master cannot learn what became stale, and a client holding cached
metadata would still read from it. So the node fences itself first::

    node:    sent ─── heartbeat / registration ───┐      acknowledged
    master:                                  received (>= sent) ── ttl ──> may declare dead
    node:    serves until sent + ttl - margin  (<= received + ttl)

``sent`` is when the node *sent* the last heartbeat (or registration) a
master acknowledged, so the fence falls before the master's verdict on any
clock that runs at the master's rate; ``margin`` (5 % of the ttl, far more
than clocks drift apart in one ttl) covers the rest. A lease is renewed only after the reply's drop orders were
applied, so a node back from a partition serves nothing its master ordered
dropped meanwhile. While fenced, reads and writes of the shard's keys answer
UNAVAILABLE (retryable: the client reads another replica, the writer puts
elsewhere); pins, drops, stats and pings go on.

The price: while no master of a shard answers (a master outage, an election)
its keys are not served for longer than the ttl, even through cached
metadata. Objects stay where they are and serve again at the first
acknowledged heartbeat.

Thread safety: deadlines are floats replaced whole (one writer per shard: its
agent's thread); readers take no lock.
"""

from __future__ import annotations

import time
from typing import Callable

from kvstore.errors import Fenced

MARGIN = 0.05         # of the ttl: the node stops this much before the master may decide


class MasterLease:
    """Per master shard, until when this node may serve that shard's keys.

    Made before the node knows its shard map (the data port starts first, and
    serves nothing until a master acknowledged the node); the agents set
    :attr:`shard_of` and :meth:`reset` the shard count once they know it.
    """

    def __init__(self) -> None:
        self.shard_of: Callable[[str], int] | None = None   # key -> shard (None: one shard)
        self._until = [0.0]      # per shard, monotonic seconds; 0.0: never granted
        self.ttl_ms = 0          # the masters' node ttl, as last told
        self._on_change: Callable[[float], None] | None = None

    def watch(self, on_change: Callable[[float], None]) -> None:
        """Call ``on_change(until)`` now and whenever the shortest shard lease moves
        (``until``: monotonic seconds): same-host readers that bypass the node stop
        there (:mod:`kvstore.transfer.shm_slots`)."""
        self._on_change = on_change
        on_change(min(self._until))

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(min(self._until))

    def reset(self, num_shards: int) -> None:
        """``num_shards`` shards, none granted yet."""
        self._until = [0.0] * max(1, num_shards)
        self._changed()

    def renew(self, shard: int, sent_at: float, ttl_ms: int) -> None:
        """A master of ``shard`` acknowledged what the node sent at ``sent_at``
        (monotonic seconds) and the node applied the reply; ``ttl_ms`` is the
        master's node ttl."""
        self.ttl_ms = ttl_ms
        until = sent_at + ttl_ms * (1.0 - MARGIN) / 1000.0
        if until > self._until[shard]:
            self._until[shard] = until
            self._changed()

    def held(self, shard: int = 0) -> bool:
        return time.monotonic() < self._until[shard]

    def held_all(self) -> bool:
        """Every shard's lease holds (the node's health)."""
        now = time.monotonic()
        return all(now < t for t in self._until)

    def check(self, key: str) -> None:
        """Raises Fenced (an Unavailable) unless the lease of ``key``'s shard holds."""
        shard = self.shard_of(key) if self.shard_of is not None else 0
        if time.monotonic() >= self._until[shard]:
            raise Fenced(
                f"this node has not heard from its master shard for over "
                f"{self.ttl_ms * (1.0 - MARGIN):.0f} ms: fenced (it serves again once a "
                f"master answers)", key=key)
