"""One key's entry in a master shard's index (:mod:`kvstore.master.index`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvstore.types import NodeId, ObjectId, ObjectKey, ReplicaState, TierKind


@dataclass(slots=True)
class Entry:
    key: ObjectKey
    size_bytes: int
    checksum: int                  # xxh3-64 of the value
    object_id: ObjectId            # names this version on the nodes
    state: ReplicaState = ReplicaState.COMPLETE
    targets: list[NodeId] = field(default_factory=list)   # (unused: goes in the next commits)
    replicas: list[NodeId] = field(default_factory=list)   # nodes holding it (COMPLETE)
    created_ms: int = 0
    deadline_ms: int = 0           # while targets are outstanding: revoked / released after this
    access_count: int = 0
    last_access_ms: int = 0
    tiers: dict[NodeId, TierKind] = field(default_factory=dict)  # node -> tier serving it there
                                                                 # (from events; absent: DRAM)
    replica_num: int = 1           # replicas wanted; repair copies up to it
    repair_target: NodeId | None = None   # COMPLETE: node a repair copy is going to
    repair_deadline_ms: int = 0    # ... given up after this
    checksum_at_end: bool = False  # PENDING: the checksum comes with the first STORED report
