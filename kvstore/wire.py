"""The one place where kvstore's records (kvstore.types) meet their protobuf messages.

The master's servicer, the store node's agent and the SDK convert here, at
their edges; everything behind them works on :mod:`kvstore.types` records.
Each record has ``X(msg)`` (message to record) and ``X_pb(record)`` (record to
message). Per-item statuses go through :mod:`kvstore.errors`
(``to_status`` / ``error_for_code``), which owns the code table.

Messages come from peers, so a value a record cannot hold (an enum number
no kind has: proto3 enums are open) is :class:`~kvstore.errors.InvalidArgument`,
never a ``ValueError`` from deep inside. Going out, sums of what peers
reported (a shard's total bytes, a node's used bytes plus what it stored
since its heartbeat) saturate at 2^64 - 1 rather than overflow the uint64.
"""

from __future__ import annotations

import enum
from collections import Counter
from typing import TypeVar

from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import InvalidArgument, code_name
from kvstore.shardmap import ShardMap, ShardRange
from kvstore.types import (CopyOrder, CopyResult, DropOrder, EventKind, InventoryItem,
                           NodeAddress, NodeEvent, NodeId, NodeStatus, ObjectId, ObjectKey,
                           ObjectMeta, Replica, ShardStatus, TenantStatus, TierKind, TierStats,
                           WarmupProgress)

_E = TypeVar("_E", bound=enum.IntEnum)
#: The largest value of a uint64 field.
U64_MAX = 2**64 - 1


def _u64(n: int) -> int:
    """``n`` clamped to a uint64 field's range."""
    return min(max(n, 0), U64_MAX)


_MEMBERS: dict[type, dict[int, enum.IntEnum]] = {}    # enum class -> value -> member


def _kind(cls: type[_E], value: int, what: str) -> _E:
    """``cls(value)``, or InvalidArgument naming the field and the known values.

    A dict lookup (an enum's call costs a microsecond, several per reported event)."""
    members = _MEMBERS.get(cls)
    if members is None:
        members = _MEMBERS[cls] = {m.value: m for m in cls}
    member = members.get(value)
    if member is None:
        raise InvalidArgument(f"{what} {value} is not one of "
                              f"{', '.join(f'{k.name}={k.value}' for k in cls)}")
    return member


def node_address(msg: pb.NodeAddress) -> NodeAddress:
    return NodeAddress(NodeId(msg.node_id), msg.host, msg.data_port, msg.shm_name, msg.host_id,
                       msg.tls, msg.metrics_address)


def node_address_pb(a: NodeAddress) -> pb.NodeAddress:
    return pb.NodeAddress(node_id=a.node_id, host=a.host, data_port=a.data_port,
                          shm_name=a.shm_name, host_id=a.host_id, tls=a.tls,
                          metrics_address=a.metrics_address)


def object_meta(msg: pb.ObjectMeta) -> ObjectMeta:
    return ObjectMeta(
        key=ObjectKey(msg.key), size_bytes=msg.size_bytes, checksum=msg.checksum,
        object_id=ObjectId(msg.object_id),
        replicas=tuple(Replica(node_address(r.node), _kind(TierKind, r.tier, "replica tier"))
                       for r in msg.replicas),
        created_ms=msg.created_ms, access_count=msg.access_count,
        last_access_ms=msg.last_access_ms)


def object_meta_pb(m: ObjectMeta) -> pb.ObjectMeta:
    return pb.ObjectMeta(
        key=m.key, size_bytes=m.size_bytes, checksum=m.checksum, object_id=m.object_id,
        replicas=[pb.Replica(node=node_address_pb(r.node), tier=r.tier) for r in m.replicas],
        created_ms=m.created_ms, access_count=m.access_count, last_access_ms=m.last_access_ms)


_TIER_FIELDS = ("capacity_bytes", "used_bytes", "free_bytes", "evictable_bytes", "num_objects",
                "num_reading", "num_pinned", "num_soft_pinned", "num_protected",
                "high_watermark", "low_watermark", "eviction_blocked")


def tier_stats(msg: pb.TierStat) -> TierStats:
    return TierStats(kind=_kind(TierKind, msg.tier, "tier"),
                     **{f: getattr(msg, f) for f in _TIER_FIELDS})


def tier_stats_pb(t: TierStats) -> pb.TierStat:
    return pb.TierStat(tier=t.kind, **{f: getattr(t, f) for f in _TIER_FIELDS})


def node_status(msg: pb.NodeStat) -> NodeStatus:
    # Counters as a Counter: one never reported reads 0, as in the wire map.
    return NodeStatus(address=node_address(msg.address), alive=msg.alive,
                      capacity_bytes=msg.capacity_bytes, used_bytes=msg.used_bytes,
                      num_objects=msg.num_objects, last_heartbeat_ms=msg.last_heartbeat_ms,
                      tiers=tuple(tier_stats(t) for t in msg.tiers), counters=Counter(msg.counters),
                      syncing=msg.syncing)


def node_status_pb(n: NodeStatus) -> pb.NodeStat:
    return pb.NodeStat(address=node_address_pb(n.address), alive=n.alive, tier=pb.DRAM,
                       capacity_bytes=_u64(n.capacity_bytes), used_bytes=_u64(n.used_bytes),
                       num_objects=_u64(n.num_objects), last_heartbeat_ms=n.last_heartbeat_ms,
                       tiers=[tier_stats_pb(t) for t in n.tiers], counters=n.counters,
                       syncing=n.syncing)


def shard_status(msg: pb.StatResponse) -> ShardStatus:
    return ShardStatus(shard_id=msg.shard_id, shard_map_version=msg.shard_map_version,
                       nodes=tuple(node_status(n) for n in msg.nodes),
                       num_objects=msg.num_objects, total_bytes=msg.total_bytes,
                       unavailable_objects=msg.unavailable_objects,
                       unavailable_bytes=msg.unavailable_bytes, counters=Counter(msg.counters),
                       metrics_address=msg.metrics_address, warmup_left_ms=msg.warmup_left_ms,
                       warmup_nodes=tuple(
                           WarmupProgress(NodeId(w.node_id),
                                          pb.WarmupState.Name(w.state).lower()
                                          if w.state in pb.WarmupState.values() else "unknown",
                                          w.items_applied) for w in msg.warmup_nodes),
                       loop_stall_max_ms=msg.loop_stall_max_ms, loop_stalls=msg.loop_stalls)


def tenant_status(msg: pb.TenantStat) -> TenantStatus:
    return TenantStatus(msg.tenant, msg.objects, msg.bytes, msg.max_objects, msg.max_bytes,
                        dict(msg.counters))


def tenant_status_pb(t: TenantStatus) -> pb.TenantStat:
    return pb.TenantStat(tenant=t.tenant, objects=t.objects, bytes=_u64(t.bytes),
                         max_objects=t.max_objects, max_bytes=_u64(t.max_bytes),
                         counters={k: _u64(v) for k, v in t.counters.items()})


def shard_status_pb(s: ShardStatus) -> pb.StatResponse:
    return pb.StatResponse(shard_id=s.shard_id, shard_map_version=s.shard_map_version,
                           nodes=[node_status_pb(n) for n in s.nodes],
                           num_objects=s.num_objects, total_bytes=_u64(s.total_bytes),
                           unavailable_objects=s.unavailable_objects,
                           unavailable_bytes=_u64(s.unavailable_bytes),
                           counters=s.counters,
                           metrics_address=s.metrics_address,
                           warmup_left_ms=s.warmup_left_ms)


def node_event(msg: pb.ReplicaEvent) -> NodeEvent:
    return NodeEvent(_kind(EventKind, msg.kind, "event kind"), ObjectKey(msg.key),
                     ObjectId(msg.object_id),
                     _kind(TierKind, msg.tier, "event tier") if msg.tier else None,
                     msg.size_bytes, msg.checksum)


def node_event_pb(e: NodeEvent) -> pb.ReplicaEvent:
    return pb.ReplicaEvent(kind=e.kind, key=e.key, object_id=e.object_id,
                           tier=e.tier if e.tier is not None else pb.TIER_UNSPECIFIED,
                           size_bytes=e.size_bytes, checksum=e.checksum)


def inventory_item(msg: pb.InventoryItem) -> InventoryItem:
    return InventoryItem(ObjectKey(msg.key), ObjectId(msg.object_id), msg.size_bytes,
                         msg.checksum, _kind(TierKind, msg.tier or pb.DRAM, "inventory tier"),
                         msg.pending, msg.replica_num)


def inventory_row(row: tuple) -> InventoryItem:
    """An item of a natively decoded chunk (``kvstore._native.InventoryChunk.item``: key,
    object_id, size_bytes, checksum, tier, pending, replica_num), read as
    :func:`inventory_item` reads a message (the same checks)."""
    key, object_id, size_bytes, checksum, tier, pending, replica_num = row
    return InventoryItem(ObjectKey(key), ObjectId(object_id), size_bytes, checksum,
                         _kind(TierKind, tier or pb.DRAM, "inventory tier"), pending, replica_num)


def inventory_item_pb(it: InventoryItem) -> pb.InventoryItem:
    return pb.InventoryItem(key=it.key, object_id=it.object_id, size_bytes=it.size_bytes,
                            checksum=it.checksum, tier=it.tier, pending=it.pending,
                            replica_num=it.replica_num)


def drop_order(msg: pb.DropOrder) -> DropOrder:
    return DropOrder(ObjectKey(msg.key), ObjectId(msg.object_id))


def drop_order_pb(d: DropOrder) -> pb.DropOrder:
    return pb.DropOrder(key=d.key, object_id=d.object_id)


def copy_order(msg: pb.CopyOrder) -> CopyOrder:
    return CopyOrder(ObjectKey(msg.key), ObjectId(msg.object_id), node_address(msg.target))


def copy_order_pb(c: CopyOrder) -> pb.CopyOrder:
    return pb.CopyOrder(key=c.key, object_id=c.object_id, target=node_address_pb(c.target))


def copy_result(msg: pb.CopyResult) -> CopyResult:
    return CopyResult(ObjectKey(msg.key), ObjectId(msg.object_id), NodeId(msg.target_node_id),
                      "" if msg.status.code == pb.OK else
                      msg.status.message or code_name(msg.status.code))


def copy_result_pb(r: CopyResult) -> pb.CopyResult:
    status = pb.Status(code=pb.OK) if not r.error else pb.Status(code=pb.INTERNAL,
                                                                  message=r.error)
    return pb.CopyResult(key=r.key, object_id=r.object_id, target_node_id=r.target_node_id,
                         status=status)


def shard_map(msg: pb.ShardMap) -> ShardMap:
    return ShardMap(msg.version, tuple(ShardRange(r.first_slot, r.last_slot, tuple(r.addresses),
                                                  r.shard_id) for r in msg.ranges))


def shard_map_pb(m: ShardMap) -> pb.ShardMap:
    return pb.ShardMap(version=m.version, num_slots=m.num_slots, ranges=[
        pb.ShardRange(first_slot=r.first_slot, last_slot=r.last_slot, addresses=r.addresses,
                      shard_id=r.shard_id) for r in m.ranges])
