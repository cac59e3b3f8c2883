"""Placement grants, the pure part: where a put's bytes go, without asking first.

Each master shard hands a client a grant (``GrantPlacement``;
:mod:`kvstore.master.grants` holds the protocol and its ordering argument): a
range of object ids and the nodes that may take new bytes, with their free
space, valid for ``valid_ms``. A put takes the next id and picks its target
nodes here, so no master call sits before its first byte; when to fetch a
grant is :func:`grant_use`'s to say::

    grant fresh              -> USE: take an id and targets (no RPC)
    past half its validity,
      or a quarter of its ids left -> REFRESH: the same, and a new grant is fetched
                                      in the background
    expired, used up, none,
      or another shard's      -> FETCH: fetch one now (the only blocking master call)

Targets of a value of ``size_bytes``, ``replica_num`` distinct nodes: first a
node on this host (shared memory, or a loopback hop) when its free space
allows, then the nodes whose free space (as granted, less what this client
placed since) allows, in rendezvous-hash order of the key (xxh3-64 of node
id and key: spread evenly, and two writers of one key meet on the same
nodes), then the others (a node may still make room by evicting). Nodes the
caller excludes (they failed this put) are skipped.

Thread safety: the caller holds whatever guards a :class:`Grant` (the sync
SDK a lock, the asyncio SDK its one event loop).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import xxhash

from kvstore import sizes, wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import Unavailable
from kvstore.sizes import check_fits
from kvstore.keys import NUM_SLOTS, key_slot
from kvstore.types import NodeAddress, NodeId, ObjectId

log = logging.getLogger(__name__)
_WARNED: set[tuple[int, int]] = set()    # (replica_num, nodes) said once per process

#: Object ids asked for per grant.
IDS_PER_GRANT = 4096


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


class GrantUse(enum.Enum):
    """What a put does with the grant it holds (:func:`grant_use`)."""

    USE = "use"            # take an id and targets from it
    REFRESH = "refresh"    # take from it, and fetch the next one in the background
    FETCH = "fetch"        # fetch a new one first


def grant_use(g: "Grant | None", key: str, now: float, num_ids: int = IDS_PER_GRANT) -> GrantUse:
    """Whether the grant held for ``key``'s shard can be used now (the table in the module doc)."""
    if g is None or not g.usable(now) or not g.serves(key):
        return GrantUse.FETCH
    return GrantUse.REFRESH if g.wants_refresh(now, num_ids) else GrantUse.USE
