"""kvstore's boundary vocabulary: ids, enums, and the small records components exchange.

Components talk through these (STYLE rules 2, 3): the master's index takes
and returns them, the store node reports them, the SDK returns them to its
users. Protobuf messages exist only on the wire; :mod:`kvstore.wire` is the
one place that converts between the two.

Enums that have a wire enum are valued as it (``TierKind.DRAM ==
pb.DRAM``), so a conversion is a constructor call.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NewType

#: A store key: printable, at most MAX_KEY_BYTES (512) of UTF-8 (kvstore.keys.validate_key).
ObjectKey = NewType("ObjectKey", str)
#: A prefix-block key: the 32-hex-digit xxh3-128 of the chain up to a block (kvstore.keys).
BlockHash = NewType("BlockHash", str)
#: A store node's stable id (``--node-id``, or the one recorded on its SSD).
NodeId = NewType("NodeId", str)
#: The master's id of one version of an object: unique per put, never reused.
ObjectId = NewType("ObjectId", int)


class TierKind(enum.IntEnum):
    """Kinds of storage tier, valued as the wire enum ``kvstore.v1.Tier``."""

    GPU = 1
    DRAM = 2
    SSD = 3


#: Read preference among a node's tiers: DRAM serves directly, GPU and SSD are copied up first.
TIER_READ_RANK: dict[TierKind, int] = {TierKind.DRAM: 0, TierKind.GPU: 1, TierKind.SSD: 2}


class EventKind(enum.IntEnum):
    """A change to what a node holds, valued as the wire ``kvstore.v1.ReplicaEventKind``."""

    EVICTED = 1     # the node gave the object up; it holds no copy
    DEMOTED = 2     # its fastest copy on the node is now in a slower tier
    PROMOTED = 3    # copied up to a faster tier, which now serves it
    STORED = 4      # the node holds a new, complete, checksum-verified object


class RemoveReason(str, enum.Enum):
    """Why a client removes objects (recorded in the master's counters)."""

    REMOVE = "remove"   # the application deletes it
    EVICT = "evict"     # an operator evicts it (kvctl evict)


class TransportKind(str, enum.Enum):
    """How a client moves bytes to and from one node."""

    TCP = "tcp"         # frames over a socket (any host)
    SHM = "shm"         # through the node's shared-memory segment (same host)
    RDMA = "rdma"       # one-sided RDMA into the node's registered segment


@dataclass(frozen=True, slots=True)
class NodeAddress:
    """Where a store node can be reached."""

    node_id: NodeId
    host: str               # data-plane host (loopback by default)
    data_port: int          # TCP data plane
    shm_name: str = ""      # POSIX shared-memory segment (same-host path), "" if none
    host_id: str = ""       # the machine: equal host_ids can share memory
    tls: bool = False       # the TCP data port speaks TLS
    metrics_address: str = ""   # host:port of its /metrics, "" if none


@dataclass(frozen=True, slots=True)
class Replica:
    """One readable copy of an object: the node and the tier that serves it there."""

    node: NodeAddress
    tier: TierKind


@dataclass(frozen=True, slots=True)
class ObjectMeta:
    """What the master knows about one object (``lookup``, ``list``)."""

    key: ObjectKey
    size_bytes: int
    checksum: int                      # xxh3-64 of the value
    object_id: ObjectId                # names this version on the nodes
    replicas: tuple[Replica, ...] = ()
    created_ms: int = 0                # unix ms
    access_count: int = 0              # lookups since it was stored
    last_access_ms: int = 0            # unix ms of the last lookup


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier of a store node, counted by the node. ``used + free == capacity``."""

    kind: TierKind
    capacity_bytes: int
    used_bytes: int
    free_bytes: int
    evictable_bytes: int = 0      # copies that could be demoted or evicted now
    num_objects: int = 0          # objects with a copy here
    num_reading: int = 0          # ... referenced (read, written, moved)
    num_pinned: int = 0           # ... hard-pinned
    num_soft_pinned: int = 0      # ... soft-pinned, pin not expired
    num_protected: int = 0        # ... protected by prefetch lookahead
    high_watermark: float = 0.0   # eviction starts above this fraction of capacity
    low_watermark: float = 0.0    # ... and stops at this one
    eviction_blocked: str = ""    # why eviction cannot free what the tier needs; "" when it can


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """A store node as its master shard sees it (``KVClient.stat``)."""

    address: NodeAddress
    alive: bool
    capacity_bytes: int                # of the DRAM tier, where puts land
    used_bytes: int
    num_objects: int
    last_heartbeat_ms: int             # unix ms
    tiers: tuple[TierStats, ...] = ()  # every tier of the node, fastest first
    counters: dict[str, int] = field(default_factory=dict)   # the node's own (evictions, ...)
    syncing: bool = False              # registered; its inventory is still being applied


@dataclass(frozen=True, slots=True)
class WarmupProgress:
    """A node a warming-up shard waits for (kvstore/master/warmup.py)."""

    node_id: NodeId
    state: str                         # "waiting" (not registered) or "syncing"
    items_applied: int = 0             # of its inventory, so far


@dataclass(frozen=True, slots=True)
class TenantStatus:
    """One tenant's figures on one master shard (``kvctl tenants``; kvstore.master.tenant_book)."""

    tenant: str
    objects: int                       # its objects on the shard, each once
    bytes: int                         # ... and their bytes (B), each object once
    max_objects: int = 0               # the shard's part of its hard limits (0: none)
    max_bytes: int = 0
    counters: dict[str, int] = field(default_factory=dict)   # puts, hits, misses, evictions, refusals


@dataclass(frozen=True, slots=True)
class ShardStatus:
    """One master shard's view: its nodes, objects and counters (``KVClient.stat``)."""

    shard_id: int
    shard_map_version: int
    nodes: tuple[NodeStatus, ...]
    num_objects: int                   # readable now: a replica on a live node
    total_bytes: int
    counters: dict[str, int] = field(default_factory=dict)   # puts, lookups, removes, ...
    unavailable_objects: int = 0       # every replica on a dead node (kept until forgotten)
    unavailable_bytes: int = 0
    metrics_address: str = ""          # the answering master's /metrics, "" if none
    warmup_left_ms: int = 0            # > 0: index incomplete (nodes re-registering)
    warmup_nodes: tuple[WarmupProgress, ...] = ()   # ... what it waits for
    loop_stall_max_ms: float = 0.0     # the master's event loop's longest stall since start
    loop_stalls: int = 0               # ... and its stalls of 50 ms or more


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """One change to what a node holds, in the order the node made it (kvstore.store.events)."""

    kind: EventKind
    key: ObjectKey
    object_id: ObjectId
    tier: TierKind | None = None  # where it is served from now; None for EVICTED
    size_bytes: int = 0           # STORED: the value's size ...
    checksum: int = 0             # ... and its verified xxh3-64


@dataclass(frozen=True, slots=True)
class InventoryItem:
    """One object a node holds, as it registers (its inventory)."""

    key: ObjectKey
    object_id: ObjectId
    size_bytes: int
    checksum: int
    tier: TierKind                # the tier it is served from
    pending: bool = False         # its STORED event is not yet applied (never indexed from here)
    replica_num: int = 0          # replicas its put asked for (0: not known)


@dataclass(frozen=True, slots=True)
class DropOrder:
    """The master tells a node to free this version (removed, replaced, revoked)."""

    key: ObjectKey
    object_id: ObjectId


@dataclass(frozen=True, slots=True)
class CopyOrder:
    """Re-replication: the master tells a node holding a live replica to copy it to ``target``."""

    key: ObjectKey
    object_id: ObjectId
    target: NodeAddress


@dataclass(frozen=True, slots=True)
class CopyResult:
    """A node reports a finished :class:`CopyOrder`."""

    key: ObjectKey
    object_id: ObjectId
    target_node_id: NodeId
    error: str = ""               # "" when the target holds the copy now
