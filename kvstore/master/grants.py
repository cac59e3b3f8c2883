"""Placement grants: the one put protocol, one client round trip per put.

A put needs an object id and target nodes before its first byte moves.
Rather than ask the shard for them per put, a client holds a grant, the
shard's authority to place for a while, and the shard decides each put
when the node that stored it reports it (whole values and values written
part by part alike; nothing is held here while the bytes move, so a writer
that dies mid-put leaves nothing behind and blocks no other writer)::

    client ──GrantPlacement──> shard: ids [first, first + n), the nodes that may
       │                      take new bytes (alive, not quarantined) and their
       │                      free space; valid for valid_ms. Asked again in the
       │                      background, before the ids or the time run out.
       │
       └─PUT key, id──> node: stores, verifies the checksum, reports STORED
                        ──ReportEvents──> shard applies it (below), and only then
       <──────────────  the node answers: one client round trip, no master call
                        between the client's first byte and its acknowledgement

The shard decides each STORED of a granted id when it applies it, one event
at a time on its event loop (:meth:`ObjectIndex._stored`): the key is new
(or its every replica died) → the object is indexed and visible, with this
node as its replica and the grant's ``replica_num``; the key is visible with
this very version → one more replica; with another version of equal bytes
(size and xxh3-64) → ALREADY_PRESENT, the node drops its copy; of other bytes
→ KEY_CONFLICT, the node drops it. A value written part by part
(:mod:`kvstore.client.parts`) has its checksum known only at its end: the
node verifies it at the commit and the STORED report carries it, which is
all this decision needs. So immutability holds when two writers race through two
different nodes: the first STORED applied wins, the other is refused, and
since a node acknowledges only after its shard applied the report, a put
that returned is visible to every reader.

An id is decided once. A put's first STORED applied decides it; a STORED of
the same id from another target adds a replica while that version is the
key's, and is refused NOT_FOUND (the node drops its copy) once the key holds
nothing or another version: a target that gets the bytes late (its link
was cut mid-put, and TCP delivered them when it healed) never brings back a
key that was removed meanwhile. The decided ids go with their grant.

Placement still follows the shard's view: a grant lists only nodes it would
place on itself, with their free space; the client picks ``replica_num``
distinct nodes from it (:mod:`kvstore.client.core.placement`), and a node that
cannot take the bytes refuses them (NO_SPACE, fenced, gone) so the client
tries the next. An id no live grant covers (a grant of a previous leader,
expired long ago, or invented) is refused NOT_FOUND ("placement grant is
unknown here"; the node drops the bytes): the client asks for a new grant
and tries again. A new leader's
ids start above every previous term's (``start_term``), so no two grants
ever share an id.

Memory is bounded: grants expire ``valid_ms`` plus the put timeout after they
were issued (a put started just before expiry may still report), and at most
``MAX_GRANTS`` are kept (the oldest go first).

Thread safety: owned by the master's event loop; not locked.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MAX_GRANTS = 65_536
MAX_IDS_PER_GRANT = 65_536


@dataclass(frozen=True, slots=True)
class Grant:
    first_object_id: int
    num_ids: int
    replica_num: int             # what each put of the grant wants (repair copies up to it)
    expires_ms: int              # STORED of its ids are accepted until then
    # Ids whose put the shard decided (visible, ALREADY_PRESENT or KEY_CONFLICT):
    # a later STORED of one decides nothing (see the module docstring).
    decided_ids: set[int] = field(default_factory=set, compare=False, repr=False)

    def covers(self, object_id: int) -> bool:
        return self.first_object_id <= object_id < self.first_object_id + self.num_ids


class Grants:
    """The shard's live grants, by first object id.

    Args:
        valid_ms: how long a client may use a grant.
        grace_ms: how long after that its ids are still accepted (the put timeout).
    """

    def __init__(self, valid_ms: int = 2000, grace_ms: int = 30_000):
        self.valid_ms = valid_ms
        self.grace_ms = grace_ms
        self._firsts: list[int] = []            # sorted first ids (ids only grow)
        self._grants: dict[int, Grant] = {}

    def issue(self, first_object_id: int, num_ids: int, replica_num: int, now_ms: int) -> Grant:
        """Record a grant of ``num_ids`` ids from ``first_object_id`` (the caller
        reserved them: no other grant or put gets them)."""
        g = Grant(first_object_id, num_ids, max(1, replica_num),
                  now_ms + self.valid_ms + self.grace_ms)
        if self._firsts and first_object_id <= self._firsts[-1]:
            bisect.insort(self._firsts, first_object_id)
        else:
            self._firsts.append(first_object_id)
        self._grants[first_object_id] = g
        while len(self._grants) > MAX_GRANTS:
            self._grants.pop(self._firsts.pop(0), None)
        return g

    def find(self, object_id: int, now_ms: int) -> Grant | None:
        """The live grant covering ``object_id``, or None."""
        i = bisect.bisect_right(self._firsts, object_id) - 1
        if i < 0:
            return None
        g = self._grants.get(self._firsts[i])
        if g is None or not g.covers(object_id) or now_ms > g.expires_ms:
            return None
        return g

    def expire(self, now_ms: int) -> int:
        """Forget the grants past their expiry; returns how many."""
        keep = [f for f in self._firsts if self._grants[f].expires_ms >= now_ms]
        gone = len(self._firsts) - len(keep)
        if gone:
            for f in set(self._firsts) - set(keep):
                del self._grants[f]
            self._firsts = keep
        return gone

    def __len__(self) -> int:
        return len(self._grants)
