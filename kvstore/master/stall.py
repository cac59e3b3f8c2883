"""How long the master's event loop was kept from serving: the longest stall seen.

Every call, heartbeat and report of a master shard runs on one event loop, so
any step that holds it (applying an inventory slice, a scan slice) delays
them all. :class:`LoopWatch` wakes every ``tick_s`` and records how late it
woke, and how much of that lateness the loop's own thread spent working (its
CPU time): a step that held the loop shows in both; a machine too busy to
run the process shows in the first only. The longest stall of work since
start is in ``kvctl stats`` (``loop_stall_max_ms``) and in
``kvstore_event_loop_stall_max_seconds``::

    tick      |--sleep tick_s--|~~~~late~~~~|        late  = wall clock past the tick
                               [== work ==]          stall = min(late, loop thread's CPU)

Thread safety: runs on the loop it watches; the figures are read anywhere.
"""

from __future__ import annotations

import asyncio
import logging
import time

log = logging.getLogger(__name__)

#: A stall at least this long is counted (``loop_stalls``) and logged.
STALL_MS = 50


class LoopWatch:
    """The longest stall of the running event loop since :meth:`run` began.

    Args:
        tick_s: how often it wakes (the resolution of what it sees).
    """

    def __init__(self, tick_s: float = 0.005):
        self.tick_s = tick_s
        self.max_ms = 0.0          # the longest stall of work on the loop seen (ms)
        self.max_late_ms = 0.0     # the longest lateness, whatever its cause (ms)
        self.stalls = 0            # stalls of STALL_MS or more

    async def run(self) -> None:
        """Watch until cancelled."""
        while True:
            t, cpu = time.monotonic(), time.thread_time()
            await asyncio.sleep(self.tick_s)
            late_ms = (time.monotonic() - t - self.tick_s) * 1000
            stall_ms = min(late_ms, (time.thread_time() - cpu) * 1000)
            self.max_late_ms = max(self.max_late_ms, late_ms)
            if stall_ms > self.max_ms:
                self.max_ms = stall_ms
            if stall_ms >= STALL_MS:
                self.stalls += 1
                log.info("event loop stalled %.0f ms by work on it (%.0f ms late)", stall_ms,
                         late_ms)
