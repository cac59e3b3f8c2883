"""The sync SDK's placement grants: one per (shard, replica_num), fetched through
:class:`~kvstore.client.control.Control`, shared by threads.

The rules (when a grant is used, refreshed or fetched; which nodes a value
goes to, same host first) are :mod:`kvstore.client.core.placement`'s; this is
their blocking driver.

Thread safety: one lock guards the grants; fetches run outside it (a
background fetch per shard at a time).
"""

from __future__ import annotations

import logging
import threading
import time

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.control import Control
from kvstore.client.core.placement import (IDS_PER_GRANT, Grant, GrantUse, grant_of,
                                           grant_use, take)
from kvstore.errors import KVStoreError
from kvstore.types import NodeAddress, NodeId, ObjectId

log = logging.getLogger(__name__)

#: Grants one placement fetches at most (others may use up each before it takes an id).
_MAX_FETCHES = 3


class Placements:
    """Grants per (shard, replica_num), and the choice of targets.

    Args:
        control: the master calls (GrantPlacement) go through it.
        host_id: this host's identity (a node with the same one is local).
        prefer_local: put the first replica on a same-host node when it fits.
        num_ids: object ids asked for per grant.
    """

    def __init__(self, control: Control, host_id: str, prefer_local: bool = True,
                 num_ids: int = IDS_PER_GRANT):
        self._control = control
        self.host_id = host_id
        self.prefer_local = prefer_local
        self.num_ids = num_ids
        self._grants: dict[tuple[tuple[str, ...], int], Grant] = {}
        self._fetching: set[tuple[tuple[str, ...], int]] = set()
        self._lock = threading.Lock()

    def place(self, addresses: tuple[str, ...], key: str, size_bytes: int, replica_num: int,
              exclude: frozenset[NodeId] = frozenset()) -> tuple[ObjectId, list[NodeAddress]]:
        """An object id and up to ``replica_num`` distinct target nodes for one value.

        Raises:
            TooLarge: no granted node could ever hold ``size_bytes``.
            Unavailable: no node left to try, or the shard answers no grant.
            WrongShard: ``addresses`` do not own ``key`` (a stale shard map).
        """
        slot = (addresses, replica_num)
        for fetches in range(_MAX_FETCHES + 1):
            with self._lock:
                g = self._grants.get(slot)
                use = grant_use(g, key, time.monotonic(), self.num_ids)
                # After a fetch, a grant of another shard is take's error to raise.
                if (use is not GrantUse.FETCH or fetches == _MAX_FETCHES
                        or fetches and g is not None and g.usable(time.monotonic())):
                    oid, targets = take(g, key, size_bytes, replica_num, exclude,
                                        self.host_id if self.prefer_local else None)
                    refresh = use is GrantUse.REFRESH and slot not in self._fetching
                    if refresh:
                        self._fetching.add(slot)
                    break
            # None yet, expired, or its ids used up (by other threads since this one
            # fetched it, too): a new one. WrongShard when the shard does not own the key.
            self._fetch(slot, key=key)
        if refresh:
            threading.Thread(target=self._fetch, args=(slot, True), daemon=True,
                             name="kvstore-grant").start()
        return oid, targets

    def invalidate(self, addresses: tuple[str, ...]) -> None:
        """Forget the shard's grants (a node refused an id as unknown: a new leader)."""
        with self._lock:
            for slot in [s for s in self._grants if s[0] == addresses]:
                del self._grants[slot]

    def _fetch(self, slot: tuple[tuple[str, ...], int], background: bool = False,
               key: str = "") -> None:
        addresses, replica_num = slot
        try:
            resp = self._control.call(addresses, "GrantPlacement", pb.GrantPlacementRequest(
                replica_num=replica_num, num_ids=self.num_ids, key=key))
            g = grant_of(resp)
            with self._lock:
                self._grants[slot] = g
        except KVStoreError as err:
            if not background:
                raise
            log.debug("background placement grant from %s failed: %s", addresses, err)
        finally:
            if background:
                with self._lock:
                    self._fetching.discard(slot)
