"""A shard's warm-up: its index is whole once every node it knew is back, or given up.

A master learns what the nodes hold only from them (their inventories and
events). After a restart, or when a standby wins the shard, its index is
empty until the nodes re-register, so client calls answer UNAVAILABLE
("index incomplete", which the SDKs wait out) until the index is whole, never
a NotFound for a key a live node holds::

    term starts -- roster: nodes the shard knew (kvstore/master/roster.py)
        each known node:  WAITING --registers--> SYNCING --last chunk applied--> SYNCED
                             |                      |
                             +-- its ttl passes ----+-- no chunk for a ttl --> GAVE_UP
        whole when no node is SYNCING and every known node is SYNCED or GAVE_UP

A node that registers during the warm-up without being on the roster (new,
or the roster is older) is waited for the same way once it has begun. The
node ttl is the bound on waiting for a node that has not begun: a node not
back by then counts as dead anyway; a roster node whose heartbeats arrive
(answered "register again") is alive, and the bound counts from its last one. A shard with an empty roster (a fresh
cluster) is whole at once. A shard with no roster at all (no ``--state-dir``,
no etcd) cannot tell a fresh cluster from a restart: it waits the bound, then
for the registrations under way. Once whole, a shard stays whole for its
term: a node that registers later (restarted, with its SSD) serves its
objects once its own inventory is applied (:mod:`kvstore.master.inventory`).

Thread safety: owned by the master's event loop; not locked. Pure: time is
passed in.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from kvstore.types import NodeId

log = logging.getLogger(__name__)


class WarmupState(enum.IntEnum):
    """Where a node is in a shard's warm-up (values as ``WarmupState`` in the proto)."""

    WAITING = 1      # on the roster, not registered yet
    SYNCING = 2      # registered; its inventory is arriving
    SYNCED = 3       # its inventory is applied
    GAVE_UP = 4      # not back (or its inventory stalled) within the node ttl


@dataclass(slots=True)
class WarmupNode:
    node_id: NodeId
    state: WarmupState
    items_applied: int = 0          # of its inventory, so far
    heard_ms: int = 0               # its last heartbeat before it registered


class Warmup:
    """One term's warm-up.

    Args:
        known: the nodes the shard knew (its roster); None: it cannot know.
        start_ms: when the term started.
        bound_ms: how long to wait for a node that has not begun registering
            (the node ttl).
    """

    def __init__(self, known: set[NodeId] | None, start_ms: int, bound_ms: int):
        self.start_ms = start_ms
        self.bound_ms = bound_ms
        self.roster_known = known is not None
        self.nodes: dict[NodeId, WarmupNode] = {
            n: WarmupNode(n, WarmupState.WAITING) for n in sorted(known or ())}
        self._whole = False

    def registered(self, node_id: NodeId) -> None:
        """``node_id`` registered: its inventory is on its way."""
        if not self._whole:
            self.nodes[node_id] = WarmupNode(node_id, WarmupState.SYNCING)

    def heard(self, node_id: NodeId, now_ms: int) -> None:
        """A heartbeat of ``node_id`` arrived before it registered: it is alive, about to."""
        node = self.nodes.get(node_id)
        if node is not None and node.state is WarmupState.WAITING:
            node.heard_ms = now_ms

    def _gone(self, node: WarmupNode, now_ms: int) -> bool:
        """A WAITING node not heard from for the bound."""
        return now_ms - max(self.start_ms, node.heard_ms) >= self.bound_ms

    def applied(self, node_id: NodeId, items: int) -> None:
        """``items`` more of its inventory are applied."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.items_applied += items

    def synced(self, node_id: NodeId) -> None:
        """Its whole inventory is applied."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.state = WarmupState.SYNCED

    def gave_up(self, node_id: NodeId) -> None:
        """Its registration stalled (no chunk within a ttl): counted dead."""
        node = self.nodes.get(node_id)
        if node is not None and node.state is WarmupState.SYNCING:
            node.state = WarmupState.GAVE_UP

    def whole(self, now_ms: int) -> bool:
        """Whether the index is whole (latched: once whole, whole for the term)."""
        if self._whole:
            return True
        if any(n.state is WarmupState.SYNCING for n in self.nodes.values()):
            return False
        waiting = [n for n in self.nodes.values() if n.state is WarmupState.WAITING]
        if any(not self._gone(n, now_ms) for n in waiting):
            return False
        if not self.roster_known and now_ms - self.start_ms < self.bound_ms:
            return False
        for node in waiting:
            node.state = WarmupState.GAVE_UP
        self._whole = True
        synced = [n for n in self.nodes.values() if n.state is WarmupState.SYNCED]
        log.info("index whole %d ms after the term began: %d node(s) synced (%d inventory "
                 "items), %d gave up", now_ms - self.start_ms, len(synced),
                 sum(n.items_applied for n in synced), len(self.nodes) - len(synced))
        return True

    def left_ms(self, now_ms: int) -> int:
        """At most how long the wait for nodes that have not begun lasts (0: whole);
        a registration under way may take longer."""
        if self.whole(now_ms):
            return 0
        last = max([self.start_ms] + [n.heard_ms for n in self.missing()])
        return max(1, last + self.bound_ms - now_ms)

    def missing(self) -> list[WarmupNode]:
        """The nodes it still waits for (WAITING or SYNCING), by node id."""
        return [n for n in self.nodes.values()
                if n.state in (WarmupState.WAITING, WarmupState.SYNCING)]

    def describe(self, now_ms: int) -> str:
        """One line: what the index waits for ("" when whole)."""
        if self.whole(now_ms):
            return ""
        parts = []
        for n in self.missing():
            if n.state is WarmupState.SYNCING:
                parts.append(f"{n.node_id} (inventory: {n.items_applied} applied)")
            else:
                parts.append(f"{n.node_id} (not registered)")
        elapsed = now_ms - self.start_ms
        if not parts:
            return (f"no roster of the shard's nodes (--state-dir or --etcd): waiting "
                    f"{self.bound_ms - elapsed} ms more for nodes to register")
        return (f"waiting for {len(parts)} node(s): {', '.join(parts[:8])}"
                + (", ..." if len(parts) > 8 else "")
                + f"; at most {self.left_ms(now_ms)} ms more for those not registered")
