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
"""

from __future__ import annotations

from kvstore.types import EventKind, NodeEvent

__all__ = ["EventKind", "NodeEvent"]
