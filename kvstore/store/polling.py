"""Busy-polling of a node's data connections: how long, and how many at once.

After answering a client whose last request came within the poll window of
its answer, a connection polls its socket (recv with MSG_DONTWAIT) for that
window before it blocks: a blocking recv's sleep and wake-up cost tens of µs
on a virtual machine, and a client in a tight loop (a get per copy) is back
sooner than that. A slower client, whose request the poll would miss, is not
polled for. The native GET service polls the same way (``serving.cpp``), and a
writer waiting for its master's answer on the report link polls too
(:mod:`kvstore.transfer.report_link`).

Polling trades CPU for latency: a polled wait is a wait spent on a core. With
two cores, sequential 64 KiB requests from one client (wall µs, then the
node's CPU µs per operation from ``/proc``; the table with more windows is in
docs/data-plane.md, "Busy-polling")::

                      polled (default)       never (--busy-poll-us 0)
    put  wall / node  386-417 / 373-402      463-478 / 207-222
    get  wall / node  76-84 / 74-82          130-131 / 40-43

``kvstore node --busy-poll-us N`` sets the window (0: never poll: the least CPU,
for a node sharing its cores with engines); :class:`Pollers` bounds how many
connections poll at once, so one core is left for clients and the node's
other work.

Thread safety: :class:`Pollers` locks itself; ``poll_s`` is read-only.
"""

from __future__ import annotations

import threading

#: The default poll window for a client's next request (s).
POLL_S = 200e-6


class Pollers:
    """How many sessions may busy-poll at once, and for how long.

    Args:
        limit: connections polling at once, at most (the native GET service's too).
        poll_s: how long a connection polls for its client's next request (0: never).

    Raises:
        ValueError: ``poll_s`` outside [0, 1] s, or ``limit`` < 1.
    """

    def __init__(self, limit: int, poll_s: float = POLL_S):
        if not 0 <= poll_s <= 1 or limit < 1:
            raise ValueError(f"poll window {poll_s} s (0 to 1), pollers {limit} (at least 1)")
        self.limit = limit
        self.poll_s = poll_s
        self._active = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self._active >= self.limit:
                return False
            self._active += 1
            return True

    def give(self) -> None:
        with self._lock:
            self._active -= 1
