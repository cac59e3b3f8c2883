"""The client's side of placement grants: where a put's bytes go, without asking first.

Each master shard hands this client a grant (``GrantPlacement``;
:mod:`kvstore.master.grants` holds the protocol and its ordering argument): a
range of object ids and the nodes that may take new bytes, with their free
space, valid for ``valid_ms``. A put takes the next id and picks its target
nodes from the list here, so no master call sits before its first byte::

    grant fresh              -> take an id and targets (no RPC)
    past half its validity,
      or a quarter of its ids left -> the same, and a new grant is fetched in
                                      the background
    expired, used up, none,
      or invalidated          -> fetch one now (the only blocking master call)

Targets of a value of ``size_bytes``, ``replica_num`` distinct nodes: first a
node on this host (shared memory) when its free space allows, then the nodes
whose free space (as granted, less what this client placed since) allows, in
rendezvous-hash order of the key (xxh3-64 of node id and key: spread evenly,
and two writers of one key meet on the same nodes), then the others (a node
may still make room by evicting). Nodes the caller excludes (they failed this
put) are skipped.

Thread safety: one lock guards the grants; fetches run outside it (a
background fetch per shard at a time).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import xxhash

from kvstore import sizes, wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.control import Control
from kvstore.errors import KVStoreError, Unavailable
from kvstore.sizes import check_fits
from kvstore.keys import NUM_SLOTS, key_slot
from kvstore.types import NodeAddress, NodeId, ObjectId

log = logging.getLogger(__name__)
_WARNED: set[tuple[int, int]] = set()    # (replica_num, nodes) said once per process

IDS_PER_GRANT = 4096
#: Grants one placement fetches at most (others may use up each before it takes an id).
_MAX_FETCHES = 3


@dataclass(frozen=True, slots=True)
class GrantedNode:
    address: NodeAddress
    free_bytes: int
    max_object_bytes: int


@dataclass(slots=True)
class Grant:
    next_id: int
    end_id: int                                  # exclusive
    nodes: tuple[GrantedNode, ...]
    fetched_at: float                            # monotonic s
    valid_s: float
    first_slot: int = 0                          # the granting shard's slots (inclusive)
    last_slot: int = NUM_SLOTS - 1
    placed_bytes: dict[NodeId, int] = field(default_factory=dict)   # since the grant

    def usable(self, now: float) -> bool:
        return self.next_id < self.end_id and now < self.fetched_at + self.valid_s

    def serves(self, key: str) -> bool:
        """Whether the granting shard owns ``key``'s slot (a stale map may say otherwise)."""
        return self.first_slot <= key_slot(key) <= self.last_slot

    def wants_refresh(self, now: float, num_ids: int) -> bool:
        return (now > self.fetched_at + self.valid_s / 2
                or self.end_id - self.next_id < num_ids // 4)


def grant_of(resp: pb.GrantPlacementResponse) -> "Grant":
    """A grant as GrantPlacement answered it, dated now."""
    return Grant(resp.first_object_id, resp.first_object_id + resp.num_ids,
                 tuple(GrantedNode(wire.node_address(n.address), n.free_bytes,
                                   n.max_object_bytes) for n in resp.nodes),
                 time.monotonic(), resp.valid_ms / 1000.0, resp.first_slot,
                 resp.last_slot if resp.last_slot or resp.first_slot else NUM_SLOTS - 1)


def take(g: "Grant | None", key: str, size_bytes: int, replica_num: int,
         exclude: frozenset[NodeId], local_host_id: str | None) -> tuple[ObjectId, list[NodeAddress]]:
    """The next id of ``g`` and the targets of one value (the order in the module doc;
    ``local_host_id``: this host's id when a local node goes first, else None). The
    caller holds whatever lock guards ``g``.

    Raises:
        Unavailable: no usable grant, or no node left that is not excluded.
        TooLarge: no granted node could ever hold ``size_bytes``.
    """
    if g is None or not g.usable(time.monotonic()):
        raise Unavailable("no placement grant", key=key)
    if not g.serves(key):
        raise Unavailable("the placement grant is another shard's (a stale shard map)", key=key)
    check_fits(size_bytes, max((n.max_object_bytes for n in g.nodes), default=0),
               "any granted node", key=key)
    fits = [n for n in g.nodes if sizes.fits(size_bytes, n.max_object_bytes)]
    cands = [n for n in fits if n.address.node_id not in exclude]
    if not cands:
        raise Unavailable(f"every node that could hold the value failed it ({len(fits)} tried)",
                          key=key)

    def room(n: GrantedNode) -> bool:
        return n.free_bytes - g.placed_bytes.get(n.address.node_id, 0) >= size_bytes

    kb = key.encode()
    order = sorted(cands, key=lambda n: (
        not (local_host_id is not None and n.address.host_id == local_host_id and room(n)),
        not room(n),
        xxhash.xxh3_64_intdigest(n.address.node_id.encode() + b"\0" + kb)))
    targets = [n.address for n in order[:max(1, replica_num)]]
    if len(targets) < replica_num and (replica_num, len(fits)) not in _WARNED:
        _WARNED.add((replica_num, len(fits)))
        log.warning("replica_num %d, but only %d live node(s) can hold the value: it gets %d "
                    "replica(s) now, the shard's repair adds the others as nodes join",
                    replica_num, len(fits), len(targets))
    oid = ObjectId(g.next_id)
    g.next_id += 1
    for t in targets:
        g.placed_bytes[t.node_id] = g.placed_bytes.get(t.node_id, 0) + size_bytes
    return oid, targets


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
                # After a fetch, a grant of another shard is take's error to raise.
                if (g is not None and g.usable(time.monotonic()) and (g.serves(key) or fetches)
                        or fetches == _MAX_FETCHES):
                    oid, targets = take(g, key, size_bytes, replica_num, exclude,
                                        self.host_id if self.prefer_local else None)
                    refresh = (g.wants_refresh(time.monotonic(), self.num_ids)
                               and slot not in self._fetching)
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
