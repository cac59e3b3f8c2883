"""When an O(objects) count under a node's lock may run again (stats, why a tier is blocked).

Thread safety: not locked; two threads that race on one (shard agents asking for
stats) at worst both count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(slots=True)
class Recount:
    """When an O(objects) count may run again: ``min_s`` after the last one, and 50
    times what that one took (so counting costs at most 2 % of the time, however
    many objects there are)."""

    at: float = float("-inf")    # monotonic s when the last count started ...
    cost_s: float = 0.0          # ... and how long it took

    def due(self, now: float, min_s: float) -> bool:
        return now - self.at >= max(min_s, 50 * self.cost_s)

    def done(self, started: float) -> None:
        """A count that started at ``started`` (monotonic s) just ended."""
        self.at, self.cost_s = started, time.monotonic() - started
