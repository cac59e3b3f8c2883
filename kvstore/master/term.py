"""One leader term of a master shard: its warm-up, its registrations, and the roster I/O.

A term starts with the process, and again each time the process wins its
shard's election (a fresh index). It reads the shard's roster off the event
loop (a file or etcd: :mod:`kvstore.master.roster`), waits for the nodes on
it (:mod:`kvstore.master.warmup`) while their inventories stream in
(:mod:`kvstore.master.registration`), keeps the next block of object ids
reserved, and takes forgotten nodes off the roster::

    Term(index, roster)     index incomplete: the roster is being read
      load_roster()         the warm-up waits for its nodes (and resumes the ids)
      warming_up()          ... until every one is back or gave up
      reserve_ids()         each maintenance round: a block of ids ahead of the next
      forget_in_roster()    nodes the shard forgot, or that never came back

Thread safety: owned by the master's event loop; roster I/O runs in the
loop's default executor.
"""

from __future__ import annotations

import asyncio
import logging

from kvstore.master.registration import Registrations
from kvstore.master.roster import ID_BLOCK, Roster
from kvstore.master.warmup import Warmup
from kvstore.types import NodeId

log = logging.getLogger(__name__)


class Term:
    """The warm-up and registrations of one term over ``index``.

    Args:
        index: the term's :class:`~kvstore.master.index.ObjectIndex`.
        roster: where the shard's nodes and object-id bound are kept.
        start_ms: when the term started (monotonic ms, as the index's).
    """

    def __init__(self, index, roster: Roster, start_ms: int):
        self.index = index
        self.roster = roster
        self.start_ms = start_ms
        # Until the roster is read, the index counts as incomplete.
        self.warmup = Warmup(None, start_ms, 2**62)
        self.registrations = Registrations(index, self.warmup, roster)
        self.roster_loaded = False

    def warming_up(self, now_ms: int) -> bool:
        """The index is not whole yet."""
        return not self.roster_loaded or not self.warmup.whole(now_ms)

    def describe(self, now_ms: int) -> str:
        """What the index waits for ("" when whole)."""
        if not self.roster_loaded:
            return "reading the roster of its nodes"
        return self.warmup.describe(now_ms)

    async def load_roster(self) -> bool:
        """Read the roster (once; a failure is tried again at the next call). Returns
        whether it is loaded."""
        if self.roster_loaded:
            return True
        loop = asyncio.get_running_loop()
        try:
            known = await loop.run_in_executor(None, self.roster.load)
            ids_below = await loop.run_in_executor(None, self.roster.ids_below)
        except OSError as exc:
            log.warning("the shard's roster could not be read: %s; retrying", exc)
            return False
        if self.roster_loaded:
            return True
        if ids_below is not None:
            # Ids continue above every block an earlier process of the shard reserved.
            self.index.start_term(ids_below)
            if not await self.reserve_ids(force=True):
                return False
        warmup = Warmup(known, self.start_ms, self.index.membership.node_ttl_ms)
        for node_id, applied in self.registrations.in_progress():
            warmup.registered(node_id)
            warmup.applied(node_id, applied)
        for node_id, info in self.index.membership.nodes.items():
            if not info.syncing and node_id in warmup.nodes:
                warmup.synced(node_id)
        self.warmup = self.registrations.warmup = warmup
        self.registrations.known = set(known) if known is not None else None
        self.roster_loaded = True
        if known:
            log.info("shard %d warming up: waiting for %d node(s) of its roster",
                     self.index.shard_id, len(known))
        return True

    async def reserve_ids(self, force: bool = False) -> bool:
        """Keep the next block of object ids reserved in the roster, once less than
        half a block is left (a roster that keeps none: nothing to do). Returns
        False when the roster could not be written (grants past the bound wait)."""
        index = self.index
        if index.ids_below is None and not force:
            return True
        if not force and index._next_id + ID_BLOCK // 2 <= index.ids_below:
            return True
        below = index._next_id + ID_BLOCK
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.roster.reserve_ids,
                                                             below)
        except OSError as exc:
            log.warning("object ids could not be reserved in the roster: %s; retrying", exc)
            return False
        index.ids_below = max(index.ids_below or 0, below)
        return True

    async def forget_in_roster(self, gone: list[NodeId], now_ms: int) -> None:
        """Take forgotten nodes off the roster, and roster nodes that never came back
        within ``forget_ms`` of the term's start (a restart does not wait for them
        again). A roster that cannot be written is tried again next time."""
        membership = self.index.membership
        if self.roster_loaded and now_ms - self.start_ms > membership.forget_ms:
            gone = [*gone, *(n.node_id for n in self.warmup.nodes.values()
                             if n.node_id not in membership.nodes)]
        for node_id in dict.fromkeys(gone):
            try:
                await asyncio.get_running_loop().run_in_executor(None, self.roster.remove,
                                                                 node_id)
            except OSError as exc:
                log.warning("node %s stays on the shard's roster for now: %s", node_id, exc)
                continue
            self.warmup.nodes.pop(node_id, None)
            if self.registrations.known is not None:
                self.registrations.known.discard(node_id)
