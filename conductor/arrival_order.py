"""First come, first scheduled: requests reach Algorithm 1 in the order they arrived.

Before the conductor schedules a request it asks the store which leading
blocks of its prompt are cached (one ``batch_exists``, on a worker thread).
Those lookups finish in any order, and a request scheduled before an older
one takes the older one's place in the prefill queue: with a burst of
arrivals (the Mooncake traces send many requests in the same millisecond)
the engine then serves them in an order no one chose, and the TTFT of the
burst depends on it. FAST'25's scheduler takes requests in arrival order, and
so does the simulator (``kvstore.tools.sim.simulate``), which is held against
the cluster (``kvstore simulate-demo``).

:class:`ArrivalOrder` hands each request a ticket at arrival; the request
looks its prefix up, then waits for its turn, which comes once every older
ticket is done (scheduled, refused or abandoned). The wait is bounded by the
slowest older lookup (each has the store's deadline). A caller marks its
ticket done right after its turn, before it yields to the event loop again:
the next request resumes only when this one has been scheduled and sent to
its engine.

Thread safety: it belongs to the conductor's event loop.
"""

from __future__ import annotations

import asyncio


class ArrivalOrder:
    """Tickets in arrival order; :meth:`turn` waits until every older one is done."""

    def __init__(self) -> None:
        self._issued = 0
        self._next = 0                  # the oldest ticket not done
        self._done: set[int] = set()    # done out of turn (abandoned while waiting)
        self._waiting: dict[int, asyncio.Future] = {}

    def ticket(self) -> int:
        """The next arrival's ticket."""
        t = self._issued
        self._issued += 1
        return t

    async def turn(self, ticket: int) -> None:
        """Returns once every ticket older than ``ticket`` is done.

        Raises:
            asyncio.CancelledError: the caller was cancelled while waiting (it
                must still mark its ticket done).
        """
        if ticket == self._next:
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = fut
        try:
            await fut
        finally:
            self._waiting.pop(ticket, None)

    def done(self, ticket: int) -> None:
        """``ticket`` is scheduled, refused or abandoned; the next one may go. Once per ticket."""
        self._done.add(ticket)
        while self._next in self._done:
            self._done.discard(self._next)
            self._next += 1
        fut = self._waiting.get(self._next)
        if fut is not None and not fut.done():
            fut.set_result(None)

    @property
    def waiting(self) -> int:
        """Requests looked up and waiting for an older one."""
        return len(self._waiting)
