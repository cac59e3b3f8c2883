"""Events a store node reports to its master: every change to what get can read from it.

The master's index is a cache of what the nodes hold (DESIGN.md). A node
queues one small tagged event per change, in the order the changes happen,
and its agent delivers them with the next heartbeat, at least once (a
heartbeat that fails is retried with the same events first)::

    DEMOTED   (key, object_id, tier)  its fastest copy is now in ``tier`` (DRAM -> GPU/SSD)
    PROMOTED  (key, object_id, tier)  copied up; now served from ``tier`` (DRAM)
    EVICTED   (key, object_id)        the node gave the object up; it holds no copy

A put needs no event (the master learns it from PutEnd, the node's inventory
at registration covers restarts), and a drop ordered by the master needs
none either. A change that leaves the fastest copy where it was (a slower
duplicate evicted) does not change what get reads, so it is not reported.

The node keeps them in one :class:`EventQueue`::

    put(event)   under the node's lock, as the change is made   -> ready.set()
    take()       under the node's lock: every event, in order   -> ready.clear()
    ready        a threading.Event the agent waits on to report at once
"""

from __future__ import annotations

import threading

from kvstore.types import NodeEvent


class EventQueue:
    """The node's events not yet taken, in the order they were put.

    Thread safety: :meth:`put` and :meth:`take` run with the node's lock
    held (so the queue's order is the order of the changes); any thread may
    wait on :attr:`ready`.
    """

    def __init__(self) -> None:
        self._events: list[NodeEvent] = []
        #: Set when an event is queued, cleared when the events are taken.
        self.ready = threading.Event()

    def put(self, event: NodeEvent) -> None:
        """Queue one event and set :attr:`ready`."""
        self._events.append(event)
        self.ready.set()

    def take(self) -> list[NodeEvent]:
        """Every queued event, oldest first; the queue is empty afterwards.

        Returns:
            The events (an empty list when there are none).
        """
        events, self._events = self._events, []
        self.ready.clear()
        return events
