"""The master shard's object index: put protocol, lookups, removal, listing.

An entry goes through::

    PutStart --> PENDING --PutEnd (>= 1 node wrote it)--> COMPLETE --Remove--> gone
                    |                                        (drop orders to its nodes)
                    +--PutRevoke / put deadline passed--> gone (drop orders to its targets)

Rules (issue 2): objects are immutable; a second put of a key with equal
bytes (same size and xxh3-64) is "already present", with different bytes
KEY_CONFLICT; a put while another is PENDING is PUT_IN_PROGRESS; a value
larger than every node is TOO_LARGE; nothing half-created stays visible:
Lookup, Exists and List only ever report COMPLETE entries with a live replica.

Thread safety: owned by the master's event loop; not locked. Pure: time is
passed in as ``now_ms``, so tests drive it without a network or clock.
"""

from __future__ import annotations

import bisect
import enum
import logging
from collections import Counter
from dataclasses import dataclass, field

from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import (OK_STATUS, InvalidArgument, KeyConflict, KVStoreError, NotFound,
                            PutInProgress, TooLarge, Unavailable, WrongShard, to_status)
from kvstore.keys import key_slot, validate_key
from kvstore.master.membership import Membership, NodeInfo
from kvstore.shardmap import ShardMap

log = logging.getLogger(__name__)


class EntryState(enum.Enum):
    PENDING = 1
    COMPLETE = 2


@dataclass(slots=True)
class Entry:
    key: str
    size_bytes: int
    checksum: int                  # xxh3-64 of the value
    object_id: int                 # names this version on the nodes
    state: EntryState
    targets: list[str]             # node ids chosen at PutStart
    replicas: list[str] = field(default_factory=list)   # node ids holding it (COMPLETE)
    created_ms: int = 0
    deadline_ms: int = 0           # PENDING only: revoked after this
    access_count: int = 0
    last_access_ms: int = 0
    evicted_on: set[str] = field(default_factory=set)   # PENDING: targets that evicted it already
    tiers: dict[str, int] = field(default_factory=dict)  # node id -> pb.Tier serving it there
                                                         # (from events; absent: the node's tier)
    replica_num: int = 1           # replicas wanted; repair copies up to it
    repair_target: str = ""        # COMPLETE: node a repair copy is going to ("" none)
    repair_deadline_ms: int = 0    # ... given up after this
    checksum_at_end: bool = False  # PENDING: the checksum comes with PutEnd (layer-wise puts)


class ObjectIndex:
    """Index of one master shard.

    Args:
        membership: the shard's node registry.
        shard_map: the current map; keys of other shards get WRONG_SHARD.
        shard_id: this shard's id in the map.
        put_timeout_ms: a PENDING put older than this is revoked.
    """

    def __init__(self, membership: Membership, shard_map: ShardMap, shard_id: int = 0,
                 put_timeout_ms: int = 30_000):
        self.membership = membership
        self.shard_map = shard_map
        self.shard_id = shard_id
        self.put_timeout_ms = put_timeout_ms
        self.entries: dict[str, Entry] = {}
        self._sorted_keys: list[str] | None = None   # COMPLETE keys, rebuilt lazily for List
        self._next_id = 1              # object ids; above every id seen in an inventory
        self.counters: Counter[str] = Counter()
        self._now_ms = 0               # time of the current request (for placement)
        self.repair_timeout_ms = 10_000

    # ---- helpers ----
    def _check_key(self, key: str) -> None:
        validate_key(key)
        shard = self.shard_map.shard_for_slot(key_slot(key))
        if shard.shard_id != self.shard_id:
            raise WrongShard(f"slot owned by shard {shard.shard_id}", key=key,
                             redirect=str(shard))

    def _new_id(self) -> int:
        oid = self._next_id
        self._next_id += 1
        return oid

    def _live_replicas(self, entry: Entry) -> list[str]:
        return [n for n in entry.replicas if self.membership.is_alive(n)]

    def _visible(self, entry: Entry | None) -> bool:
        return (entry is not None and entry.state is EntryState.COMPLETE
                and bool(self._live_replicas(entry)))

    def _delete(self, entry: Entry, nodes: list[str]) -> None:
        del self.entries[entry.key]
        if entry.state is EntryState.COMPLETE:
            self._sorted_keys = None
        for node_id in nodes:
            self.membership.order_drop(node_id, entry.key, entry.object_id)
        if entry.state is EntryState.PENDING:
            self._unreserve(entry)

    def _unreserve(self, entry: Entry) -> None:
        for node_id in entry.targets:
            info = self.membership.nodes.get(node_id)
            if info is not None:
                info.reserved_bytes = max(0, info.reserved_bytes - entry.size_bytes)

    def _place(self, size_bytes: int, replica_num: int, preferred: str) -> list[NodeInfo]:
        """Choose up to ``replica_num`` distinct live nodes, most free space first.

        Raises:
            Unavailable: no live node.
            TooLarge: the value exceeds every live node's capacity.
        """
        alive = self.membership.alive_nodes()
        if not alive:
            raise Unavailable("no live store node")
        healthy = [n for n in alive if not self.membership.is_quarantined(n.node_id, self._now_ms)]
        alive = healthy or alive   # all quarantined: better a suspect node than no put
        fits = [n for n in alive if n.max_object_bytes >= size_bytes]
        if not fits:
            biggest = max(n.max_object_bytes for n in alive)
            raise TooLarge(f"{size_bytes} B exceeds the largest node capacity of {biggest} B")
        fits.sort(key=lambda n: (n.node_id != preferred, -n.free_bytes, n.node_id))
        return fits[:max(1, replica_num)]

    # ---- put ----
    def put_start(self, req: pb.PutStartRequest, now_ms: int) -> pb.PutStartResponse:
        replica_num = req.config.replica_num or 1
        results = []
        for item in req.items:
            try:
                results.append(self._put_start_one(item, replica_num, req.config.preferred_node,
                                                   now_ms))
            except KVStoreError as err:
                err.key = item.key
                results.append(pb.PutStartResult(status=to_status(err)))
        return pb.PutStartResponse(results=results)

    def _put_start_one(self, item: pb.PutStartItem, replica_num: int, preferred: str,
                       now_ms: int) -> pb.PutStartResult:
        self._check_key(item.key)
        self._now_ms = now_ms
        entry = self.entries.get(item.key)
        if entry is not None and entry.state is EntryState.PENDING and now_ms > entry.deadline_ms:
            log.warning("put of %s timed out after %d ms: revoked", item.key, self.put_timeout_ms)
            self.counters["puts_expired"] += 1
            self._delete(entry, entry.targets)
            entry = None
        if entry is not None and entry.state is EntryState.COMPLETE and not self._live_replicas(entry):
            # Every replica is on a dead node: the object is lost; the key is free again.
            self._delete(entry, [])
            entry = None
        if entry is not None:
            if entry.state is EntryState.PENDING:
                raise PutInProgress("another put of this key is in progress")
            if (item.checksum_at_end or entry.checksum == item.checksum) and \
                    entry.size_bytes == item.size_bytes:
                self.counters["puts_already_present"] += 1
                return pb.PutStartResult(status=OK_STATUS, already_present=True,
                                         object_id=entry.object_id)
            raise KeyConflict(f"key holds different bytes ({entry.size_bytes} B, checksum "
                              f"{entry.checksum:#x}); objects are immutable")
        nodes = self._place(item.size_bytes, replica_num, preferred)
        entry = Entry(key=item.key, size_bytes=item.size_bytes, checksum=item.checksum,
                      object_id=self._new_id(), state=EntryState.PENDING,
                      targets=[n.node_id for n in nodes], created_ms=now_ms,
                      deadline_ms=now_ms + self.put_timeout_ms, replica_num=replica_num,
                      checksum_at_end=item.checksum_at_end)
        for n in nodes:
            n.reserved_bytes += item.size_bytes
        self.entries[item.key] = entry
        self.counters["put_starts"] += 1
        return pb.PutStartResult(status=OK_STATUS, object_id=entry.object_id,
                                 targets=[n.address for n in nodes])

    def put_end(self, req: pb.PutEndRequest, now_ms: int) -> pb.PutEndResponse:
        statuses = []
        for item in req.items:
            entry = self.entries.get(item.key)
            if entry is None or entry.object_id != item.object_id or entry.state is not EntryState.PENDING:
                statuses.append(to_status(NotFound("no pending put with this object_id "
                                                   "(revoked or timed out)", key=item.key)))
                continue
            written = [n for n in item.written_node_ids if n in entry.targets]
            if written and all(n in entry.evicted_on for n in written):
                # The nodes stored it and evicted it before this PutEnd: the put
                # succeeded, but there is nothing left to index.
                self._delete(entry, [])
                self.counters["evicted_before_visible"] += 1
                statuses.append(OK_STATUS)
                continue
            written = [n for n in written if n not in entry.evicted_on]
            if not written:
                statuses.append(to_status(InvalidArgument("no target node acknowledged the bytes",
                                                          key=item.key)))
                continue
            self._unreserve(entry)
            for n in entry.targets:
                if n not in written:
                    self.membership.order_drop(n, entry.key, entry.object_id)
            for n in written:
                # Count the bytes as used until the node's next heartbeat reports
                # them; otherwise placement sees the space as free in between.
                info = self.membership.nodes.get(n)
                if info is not None:
                    info.used_bytes += entry.size_bytes
            if entry.checksum_at_end:
                entry.checksum = item.checksum
            entry.state = EntryState.COMPLETE
            entry.replicas = written
            entry.deadline_ms = 0
            self._sorted_keys = None
            self.counters["puts"] += 1
            statuses.append(OK_STATUS)
        return pb.PutEndResponse(statuses=statuses)

    def put_revoke(self, req: pb.PutRevokeRequest) -> pb.PutRevokeResponse:
        statuses = []
        for item in req.items:
            entry = self.entries.get(item.key)
            if entry is None or entry.object_id != item.object_id or entry.state is not EntryState.PENDING:
                statuses.append(to_status(NotFound("no pending put with this object_id",
                                                   key=item.key)))
                continue
            self._delete(entry, entry.targets)
            self.counters["puts_revoked"] += 1
            statuses.append(OK_STATUS)
        return pb.PutRevokeResponse(statuses=statuses)

    # ---- read side ----
    def _visible_entry(self, key: str) -> Entry:
        """The complete, readable entry of ``key`` on this shard.

        Raises:
            InvalidArgument: a bad key. WrongShard: another shard's key. NotFound.
        """
        self._check_key(key)
        entry = self.entries.get(key)
        if not self._visible(entry):
            raise NotFound("no such key", key=key)
        return entry

    def lookup(self, keys: list[str], now_ms: int) -> pb.LookupResponse:
        results = []
        for key in keys:
            try:
                entry = self._visible_entry(key)
            except KVStoreError as err:
                self.counters["lookup_misses"] += 1
                results.append(pb.LookupResult(status=to_status(err)))
                continue
            entry.access_count += 1
            entry.last_access_ms = now_ms
            self.counters["lookup_hits"] += 1
            results.append(pb.LookupResult(status=OK_STATUS, meta=self._meta(entry, live_only=True)))
        return pb.LookupResponse(results=results)

    def exists(self, keys: list[str]) -> list[bool]:
        """Visibility only; never refreshes access stats (it must not block eviction)."""
        return self.exists_checked(keys)[0]

    def exists_checked(self, keys: list[str]) -> tuple[list[bool], list[pb.Status]]:
        """Visibility per key, with a status per key: WRONG_SHARD (and False)
        for a key this shard does not own, never a False that means "absent".
        The statuses are empty when every key was answered (the common case:
        no 1000 OK messages to build and parse)."""
        self.counters["exists_keys"] += len(keys)
        entries = self.entries
        out, statuses = [], []
        failed = False
        for key in keys:
            try:
                self._check_key(key)
            except KVStoreError as err:
                out.append(False)
                statuses.append(to_status(err))
                failed = True
                continue
            entry = entries.get(key)
            out.append(entry is not None and self._visible(entry))
            statuses.append(OK_STATUS)
        return out, statuses if failed else []

    def remove(self, keys: list[str], reason: str) -> pb.RemoveResponse:
        statuses = []
        for key in keys:
            try:
                entry = self._visible_entry(key)
            except KVStoreError as err:
                statuses.append(to_status(err))
                continue
            self._delete(entry, entry.replicas)
            self.counters["evicts" if reason == "evict" else "removes"] += 1
            statuses.append(OK_STATUS)
        return pb.RemoveResponse(statuses=statuses)

    def list(self, prefix: str, start_after: str, limit: int) -> pb.ListResponse:
        if self._sorted_keys is None:
            self._sorted_keys = sorted(k for k, e in self.entries.items()
                                       if e.state is EntryState.COMPLETE)
        keys = self._sorted_keys
        i = bisect.bisect_right(keys, start_after) if start_after else bisect.bisect_left(keys, prefix)
        limit = limit or 1000
        out: list[pb.ObjectMeta] = []
        while i < len(keys) and len(out) < limit:
            key = keys[i]
            i += 1
            if not key.startswith(prefix):
                if key > prefix:
                    break
                continue
            entry = self.entries.get(key)
            if self._visible(entry):
                out.append(self._meta(entry, live_only=True))
        more = i < len(keys) and keys[i].startswith(prefix)
        return pb.ListResponse(objects=out, next_cursor=out[-1].key if out and more else "")

    def _meta(self, entry: Entry, live_only: bool) -> pb.ObjectMeta:
        nodes = self._live_replicas(entry) if live_only else entry.replicas
        replicas = []
        for node_id in nodes:
            info = self.membership.nodes[node_id]
            replicas.append(pb.Replica(node=info.address, tier=entry.tiers.get(node_id, info.tier)))
        return pb.ObjectMeta(key=entry.key, size_bytes=entry.size_bytes, checksum=entry.checksum,
                             object_id=entry.object_id, replicas=replicas,
                             created_ms=entry.created_ms, access_count=entry.access_count,
                             last_access_ms=entry.last_access_ms)

    # ---- membership-driven maintenance ----
    def forget_node_objects(self, node_id: str) -> int:
        """A node restarted with empty DRAM: it holds none of what we think.

        Returns the number of entries that lost their last replica (deleted).
        """
        lost = 0
        for entry in list(self.entries.values()):
            if node_id in entry.replicas:
                entry.replicas.remove(node_id)
                entry.tiers.pop(node_id, None)
                if entry.state is EntryState.COMPLETE and not entry.replicas:
                    self._delete(entry, [])
                    lost += 1
        return lost

    def node_removed(self, node_id: str, key: str, object_id: int) -> None:
        """A node evicted its replica of (key, object_id): take it out of the index."""
        entry = self.entries.get(key)
        if entry is None or entry.object_id != object_id:
            return
        if entry.state is EntryState.PENDING:
            # The event overtook the writer's PutEnd: remember it for PutEnd.
            if node_id in entry.targets:
                entry.evicted_on.add(node_id)
            return
        if node_id not in entry.replicas:
            return
        entry.replicas.remove(node_id)
        entry.tiers.pop(node_id, None)
        self.counters["replicas_evicted"] += 1
        if entry.state is EntryState.COMPLETE and not entry.replicas:
            self._delete(entry, [])

    def node_tier_changed(self, node_id: str, key: str, object_id: int, tier: int,
                          promoted: bool) -> None:
        """A node now serves its replica of (key, object_id) from ``tier`` (DEMOTED / PROMOTED)."""
        entry = self.entries.get(key)
        if entry is None or entry.object_id != object_id:
            return
        if node_id in entry.replicas or (entry.state is EntryState.PENDING
                                         and node_id in entry.targets):
            entry.tiers[node_id] = tier
            self.counters["replicas_promoted" if promoted else "replicas_demoted"] += 1

    def node_event(self, node_id: str, event: pb.ReplicaEvent) -> None:
        """Apply one of a node's events (kvstore/store/events.py), in the order it sent them."""
        if event.kind == pb.EVICTED:
            self.node_removed(node_id, event.key, event.object_id)
        elif event.kind in (pb.DEMOTED, pb.PROMOTED):
            self.node_tier_changed(node_id, event.key, event.object_id, event.tier,
                                   promoted=event.kind == pb.PROMOTED)

    def sync_node_inventory(self, node_id: str, items, now_ms: int) -> tuple[int, int]:
        """Make the index agree with what a (re)registering node holds.

        The node's replicas that its inventory does not list (same key and
        object_id) are forgotten -- a restart loses DRAM -- and listed
        objects the index does not know are indexed as COMPLETE (a restart
        keeps the SSD; a new master learns the cluster this way). A listed
        version that the index has replaced is ordered dropped; one it already
        ordered dropped (removed while the node was away) is not indexed again.

        Returns:
            (entries that lost their last replica, entries indexed from the inventory).
        """
        info = self.membership.nodes.get(node_id)
        ordered = {(d.key, d.object_id) for d in info.drops} if info is not None else set()
        items = [it for it in items if (it.key, it.object_id) not in ordered]
        held = {it.key: it for it in items}
        lost = 0
        for entry in list(self.entries.values()):
            if entry.state is EntryState.PENDING and node_id in entry.targets:
                it = held.get(entry.key)
                if it is None or it.object_id != entry.object_id:
                    entry.evicted_on.add(node_id)   # lost in the restart: PutEnd skips it
                continue
            if node_id not in entry.replicas:
                continue
            it = held.get(entry.key)
            if it is None or it.object_id != entry.object_id:
                entry.replicas.remove(node_id)
                entry.tiers.pop(node_id, None)
                if entry.state is EntryState.COMPLETE and not entry.replicas:
                    self._delete(entry, [])
                    lost += 1
        indexed = 0
        for it in items:
            try:
                self._check_key(it.key)
            except KVStoreError:
                continue                  # another shard's key (or garbage): not ours to index
            self._next_id = max(self._next_id, it.object_id + 1)
            entry = self.entries.get(it.key)
            if entry is None:
                entry = Entry(key=it.key, size_bytes=it.size_bytes, checksum=it.checksum,
                              object_id=it.object_id, state=EntryState.COMPLETE, targets=[],
                              replicas=[node_id], created_ms=now_ms)
                entry.tiers[node_id] = it.tier
                self.entries[it.key] = entry
                self._sorted_keys = None
                indexed += 1
            elif entry.object_id == it.object_id:
                if entry.state is EntryState.COMPLETE:
                    if node_id not in entry.replicas:
                        entry.replicas.append(node_id)
                        # A rebuilt index learns how many replicas were wanted from
                        # how many it finds (it cannot know more).
                        entry.replica_num = max(entry.replica_num, len(entry.replicas))
                    entry.tiers[node_id] = it.tier
                # PENDING with this id: the put in flight ends it (PutEnd).
            else:
                self.membership.order_drop(node_id, it.key, it.object_id)
                self.counters["stale_replicas_dropped"] += 1
        self.counters["reindexed"] += indexed
        return lost, indexed

    # ---- re-replication ----
    def plan_repairs(self, now_ms: int, max_orders: int = 64) -> int:
        """Order copies for COMPLETE objects with fewer live replicas than wanted.

        For each, one live replica's node is told (in its next heartbeat
        reply) to copy the object to a live node that holds none, most free
        space first; at most one copy per object is in flight. Returns the
        number of orders placed.
        """
        self._now_ms = now_ms
        ordered = 0
        for entry in self.entries.values():
            if ordered >= max_orders:
                break
            if entry.state is not EntryState.COMPLETE:
                continue
            if entry.repair_target:
                if now_ms <= entry.repair_deadline_ms:
                    continue
                self.counters["repair_timeouts"] += 1
                entry.repair_target = ""
            live = self._live_replicas(entry)
            if not live or len(live) >= entry.replica_num:
                continue
            held = set(entry.replicas)
            targets = [n for n in self.membership.alive_nodes()
                       if n.node_id not in held and n.max_object_bytes >= entry.size_bytes
                       and n.free_bytes >= entry.size_bytes
                       and not self.membership.is_quarantined(n.node_id, now_ms)]
            if not targets:
                continue
            target = max(targets, key=lambda n: (n.free_bytes, n.node_id))
            source = self.membership.nodes[live[0]]
            source.copies.append(pb.CopyOrder(key=entry.key, object_id=entry.object_id,
                                              target=target.address))
            target.reserved_bytes += entry.size_bytes
            entry.repair_target = target.node_id
            entry.repair_deadline_ms = now_ms + self.repair_timeout_ms
            self.counters["repairs_ordered"] += 1
            ordered += 1
        return ordered

    def copy_done(self, result: pb.CopyResult) -> None:
        """A node reports a repair copy: the target holds a replica now (or not)."""
        target = self.membership.nodes.get(result.target_node_id)
        entry = self.entries.get(result.key)
        if target is not None:
            target.reserved_bytes = max(0, target.reserved_bytes - (entry.size_bytes if entry else 0))
        if entry is None or entry.object_id != result.object_id:
            if result.status.code == pb.OK and target is not None:
                # Removed or replaced meanwhile: the copy is garbage.
                self.membership.order_drop(target.node_id, result.key, result.object_id)
            return
        if entry.repair_target == result.target_node_id:
            entry.repair_target = ""
        if result.status.code != pb.OK:
            self.counters["repair_failures"] += 1
            log.warning("repair copy of %s to %s failed: %s", result.key, result.target_node_id,
                        result.status.message)
            return
        if entry.state is EntryState.COMPLETE and result.target_node_id not in entry.replicas:
            entry.replicas.append(result.target_node_id)
            if target is not None:
                target.used_bytes += entry.size_bytes
            self.counters["repairs"] += 1

    def expire_puts(self, now_ms: int) -> int:
        """Revoke PENDING puts past their deadline; returns how many."""
        expired = [e for e in self.entries.values()
                   if e.state is EntryState.PENDING and now_ms > e.deadline_ms]
        for entry in expired:
            self._delete(entry, entry.targets)
        self.counters["puts_expired"] += len(expired)
        return len(expired)

    def stat(self) -> pb.StatResponse:
        resp = pb.StatResponse(shard_id=self.shard_id, shard_map_version=self.shard_map.version)
        for info in self.membership.nodes.values():
            resp.nodes.append(pb.NodeStat(
                address=info.address, alive=info.alive, tier=info.tier,
                capacity_bytes=info.capacity_bytes, used_bytes=info.used_bytes,
                num_objects=info.num_objects, last_heartbeat_ms=info.last_heartbeat_ms,
                tiers=info.tiers, counters=info.counters))
        complete = [e for e in self.entries.values() if e.state is EntryState.COMPLETE]
        resp.num_objects = len(complete)
        resp.total_bytes = sum(e.size_bytes for e in complete)
        resp.pending_puts = len(self.entries) - len(complete)
        for k, v in self.counters.items():
            resp.counters[k] = v
        return resp
