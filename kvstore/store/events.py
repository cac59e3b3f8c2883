"""A store node's event log: every change to what it holds, to its masters, in order.

The master's index is a cache of what the nodes hold (DESIGN.md). A node
appends one small tagged event per change, in the order the changes happen
(under the node's lock), and its agent delivers them to the owning master
shard, at least once and in order (a delivery that fails is retried with
the same events first)::

    STORED    (key, object_id, size, checksum)  a new object, complete and verified
    DEMOTED   (key, object_id, tier)            its fastest copy is now in ``tier``
    PROMOTED  (key, object_id, tier)            copied up; now served from ``tier``
    EVICTED   (key, object_id)                  the node gave it up; it holds no copy

A drop ordered by the master needs no event, and a change that leaves the
fastest copy where it was (a slower duplicate evicted) does not change what
get reads, so it is not reported.

STORED is how an object becomes visible: the data server acknowledges a
write only once the event's :class:`Ticket` is resolved, i.e. the master
applied it (or refused it: the write fails). Waiting writers deliver
themselves (:meth:`EventLog.wait` calls the registered delivery in the
writer's thread), so concurrent writes share one report (group commit) and
a lone write costs one round trip to its master, not a wake-up of another
thread. A node without a delivery (no master: unit tests) resolves its
tickets at once. An applied STORED event confirms its object on the node
(:meth:`EventLog.set_on_applied`) before its writer hears of it.

Thread safety: every method takes the log's own lock; :meth:`append` is
called with the node's lock held (the log never takes the node's lock).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Iterable

from kvstore.errors import KVStoreError
from kvstore.types import EventKind, NodeEvent

__all__ = ["EventKind", "EventLog", "NodeEvent", "Ticket"]


class Ticket:
    """One event on its way to its master: ``done`` once delivered, with the
    master's refusal in ``error`` (None when applied)."""

    __slots__ = ("event", "done", "error")

    def __init__(self, event: NodeEvent):
        self.event = event
        self.done = False
        self.error: KVStoreError | None = None


class EventLog:
    """The node's pending events, handed to the agents that deliver them."""

    def __init__(self):
        self._cond = threading.Condition()
        self._pending: list[Ticket] = []
        self._subscribers: list[threading.Event] = []
        self._deliver: Callable[[list[Ticket], float], None] | None = None
        self._on_applied: Callable[[NodeEvent], None] | None = None

    def append(self, event: NodeEvent) -> Ticket:
        """Queue ``event`` (call in the order of the changes) and wake the subscribers."""
        ticket = Ticket(event)
        with self._cond:
            self._pending.append(ticket)
            for ready in self._subscribers:
                ready.set()
        return ticket

    def subscribe(self) -> threading.Event:
        """An event set whenever something is appended (one per delivering thread)."""
        ready = threading.Event()
        with self._cond:
            self._subscribers.append(ready)
            if self._pending:
                ready.set()
        return ready

    def take(self) -> list[Ticket]:
        """Every pending event, in order; the caller delivers them (and resolves them)."""
        with self._cond:
            taken, self._pending = self._pending, []
            return taken

    def set_on_applied(self, on_applied: Callable[[NodeEvent], None] | None) -> None:
        """Who hears that a master applied a STORED event (the node: the object is
        confirmed), before the event's waiters do. Called without the log's lock."""
        self._on_applied = on_applied

    def _applied(self, results: list[tuple[Ticket, KVStoreError | None]]) -> None:
        hook = self._on_applied
        if hook is not None:
            for ticket, error in results:
                if error is None and ticket.event.kind is EventKind.STORED:
                    hook(ticket.event)

    def resolve(self, results: Iterable[tuple[Ticket, KVStoreError | None]]) -> None:
        """Mark delivered events done, each with the master's refusal or None (the
        applied STORED events are confirmed first: see :meth:`set_on_applied`)."""
        results = list(results)
        self._applied(results)
        with self._cond:
            for ticket, error in results:
                ticket.done, ticket.error = True, error
            self._cond.notify_all()

    def set_delivery(self, deliver: Callable[[list[Ticket], float], None] | None) -> None:
        """Who delivers: ``deliver(tickets, timeout_s)`` sends what is pending for the
        masters of ``tickets`` now (and resolves it), safe from any thread, returning
        within about ``timeout_s`` when done or when it failed. None: the node has
        no master (tests, tools), and tickets resolve at once."""
        with self._cond:
            self._deliver = deliver

    def has_delivery(self) -> bool:
        """Whether a delivery is registered (a node linked, or to be linked, to masters)."""
        return self._deliver is not None

    def wait(self, tickets: list[Ticket], timeout_s: float) -> bool:
        """Until every ticket is resolved, delivering through the registered delivery.

        Returns:
            True when all are resolved; False when ``timeout_s`` passed first
            (a master unreachable: the events stay queued for a later delivery).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            with self._cond:
                waiting = [t for t in tickets if not t.done]
                if not waiting:
                    return True
                deliver = self._deliver
            if deliver is None:               # no master to tell: applied at once
                self.resolve([(t, None) for t in waiting])
                return True
            deliver(waiting, max(0.0, deadline - time.monotonic()))
            with self._cond:
                if all(t.done for t in tickets):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))   # a failed delivery is retried
