"""One key's entry in a master shard's index (:mod:`kvstore.master.index`), as a snapshot.

An entry exists only for a version some node reported STORED and the shard
accepted (:mod:`kvstore.master.grants`): there is no half-created entry.
Entries are held in the native table (:mod:`kvstore.master.entries`); an
:class:`Entry` is a copy of one, built on demand (tests, rare paths): changing
it changes nothing in the index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.types import NodeId, ObjectId, ObjectKey, TierKind


@dataclass(slots=True)
class Entry:
    key: ObjectKey
    size_bytes: int
    checksum: int                  # xxh3-64 of the value
    object_id: ObjectId            # names this version on the nodes
    replicas: list[NodeId] = field(default_factory=list)   # nodes holding it (some maybe dead)
    created_ms: int = 0            # monotonic ms (kvstore.clock); unix ms in replies
    access_count: int = 0
    last_access_ms: int = 0        # monotonic ms, as created_ms
    tiers: dict[NodeId, TierKind] = field(default_factory=dict)  # node -> tier serving it there
    replica_num: int = 1           # replicas wanted; repair copies up to it
    repair_target: NodeId | None = None   # node a repair copy is going to
    repair_deadline_ms: int = 0    # ... given up after this
    slot: int = -1                 # its position in the table
