"""The master shard's object index: the put protocol, lookups, removal, listing.

An entry goes through::

    put_start --> PENDING --a target reports STORED--> COMPLETE --remove--> gone
                     |                                 (more targets:   (drop orders to its nodes)
                     |                                  more replicas)
                     +--put_revoke / put deadline passed--> gone (drop orders to its targets)

The node that holds the bytes makes an object visible, not the client: a
node commits a written value (its checksum verified), reports STORED in its
ordered event stream (:meth:`ObjectIndex.node_event`), and acknowledges the
client's write only once this shard has applied the report. So when a put
returns, the entry is COMPLETE here and every reader's lookup finds it
(read-your-writes for everyone), and no client can make the index claim a
node holds what it does not.

Rules: objects are immutable; a second put of a key with equal bytes (same
size and xxh3-64) is "already present", with different bytes KeyConflict;
a put while another is PENDING is PutInProgress; a value larger than every
node is TooLarge; nothing half-created stays visible: lookup, exists and
list only ever report COMPLETE entries with a live replica.

The index is a cache of what the nodes hold (DESIGN.md): node events
(:meth:`ObjectIndex.node_event`) and inventories
(:meth:`ObjectIndex.sync_node_inventory`) keep it true. It speaks
:mod:`kvstore.types` records; only the servicer sees protobuf.

Thread safety: owned by the master's event loop; not locked. Pure: time is
passed in as ``now_ms``, so tests drive it without a network or clock.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Sequence

from kvstore.errors import (AlreadyPresent, KeyConflict, KVStoreError, NoSpace, NotFound,
                            PutInProgress, TooLarge, Unavailable, WrongShard)
from kvstore.keys import key_slot, validate_key
from kvstore.master.counters import MasterCounter as C
from kvstore.bigmap import BigMap
from kvstore.master.entries import EntryTable
from kvstore.master.entry import Entry
from kvstore.master.grants import MAX_IDS_PER_GRANT, Grant, Grants
from kvstore.master.inventory import sync_node_inventory
from kvstore.master.key_order import KeyOrder
from kvstore.master.limits import DEFAULT_MAX_PENDING_PUTS, MASTER_BYTES_PER_OBJECT
from kvstore.master.membership import Membership, NodeInfo
from kvstore.shardmap import ShardMap
from kvstore.types import (EventKind, InventoryItem, NodeAddress, NodeEvent, NodeId, ObjectId,
                           ObjectKey, ObjectMeta, RemoveReason, Replica, ReplicaState,
                           ShardStatus, NodeStatus, TierKind)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PutItem:
    """One value a client wants to put."""

    key: str
    size_bytes: int
    checksum: int = 0              # xxh3-64 of the value
    # Written before its checksum is known (a layer-wise save): ``checksum`` comes with the
    # STORED report; an existing key of equal size is "already present" (not compared yet).
    checksum_at_end: bool = False


@dataclass(frozen=True, slots=True)
class PutPlan:
    """Where a put goes: the new version's id and its target nodes (none when present)."""

    object_id: ObjectId
    targets: tuple[NodeAddress, ...] = ()
    already_present: bool = False   # equal bytes are stored: nothing to write


Results = list  # per input item, in order: a record (or None) for success, a KVStoreError


class ObjectIndex:
    """Index of one master shard.

    Args:
        membership: the shard's node registry.
        shard_map: the current map; keys of other shards get WrongShard.
        shard_id: this shard's id in the map.
        put_timeout_ms: a PENDING put older than this is revoked.
        max_pending_puts: PENDING puts held at once, at most (:mod:`.limits`).
        max_objects: objects indexed at most; a new key beyond is NoSpace (:mod:`.limits`).
    """

    def __init__(self, membership: Membership, shard_map: ShardMap, shard_id: int = 0,
                 put_timeout_ms: int = 30_000, max_pending_puts: int = DEFAULT_MAX_PENDING_PUTS,
                 max_objects: int = 2**63 - 1):
        self.membership = membership
        self.shard_map = shard_map
        self.shard_id = shard_id
        self.put_timeout_ms = put_timeout_ms
        self.max_pending_puts = max_pending_puts
        self.max_objects = max_objects
        self.num_pending = 0           # PENDING entries (kept with every state change)
        self.complete_bytes = 0        # ... and the bytes of the COMPLETE ones (stat is O(1))
        self.table = EntryTable()      # the entries, by key and by position (scans)
        self.entries: BigMap[ObjectKey, Entry] = self.table.entries
        self.key_order = KeyOrder()    # COMPLETE keys in order, for list
        self._next_id = 1              # object ids; above every id seen in an inventory
        self.counters: Counter[C] = Counter()
        self.grants = Grants(grace_ms=put_timeout_ms)    # placement grants (one-round-trip puts)
        # Keys whose entry may still wait for targets to report (a superset; read by the
        # maintenance round instead of every entry).
        self._awaiting: set[ObjectKey] = set()
        # Something may have left an entry with fewer live replicas than wanted
        # (a replica evicted or forgotten, an inventory synced, a put with
        # replica_num > 1 completed by its first replica, a repair failed): the
        # repair planner scans every entry only then or when membership changes.
        self.repair_hint = True
        # Nodes forgotten whose replicas may still be listed in entries (forget_steps).
        self.forgetting: set[NodeId] = set()

    def _check_key(self, key: str) -> ObjectKey:
        validate_key(key)
        shard = self.shard_map.shard_for_slot(key_slot(key))
        if shard.shard_id != self.shard_id:
            raise WrongShard(f"slot owned by shard {shard.shard_id}", key=key,
                             redirect=str(shard))
        return ObjectKey(key)

    def _check_room(self, key: str) -> None:
        """Raises NoSpace when a new key would pass ``max_objects``."""
        if len(self.entries) >= self.max_objects:
            self.counters[C.PUTS_OVER_LIMIT] += 1
            raise NoSpace(f"shard {self.shard_id} indexes {len(self.entries)} objects, its limit "
                          f"(--max-objects {self.max_objects}: about "
                          f"{self.max_objects * MASTER_BYTES_PER_OBJECT >> 20} MiB of the "
                          f"master's memory at {MASTER_BYTES_PER_OBJECT} B each); remove "
                          f"objects or add shards", key=key)

    def _new_id(self) -> ObjectId:
        oid = self._next_id
        self._next_id += 1
        return ObjectId(oid)

    def start_term(self, first_object_id: int) -> None:
        """A new leader's term: its object ids start at ``first_object_id`` or above."""
        self._next_id = max(self._next_id, first_object_id)

    def _live_replicas(self, entry: Entry) -> list[NodeId]:
        return [n for n in entry.replicas if self.membership.is_alive(n)]

    def _visible(self, entry: Entry | None) -> bool:
        return (entry is not None and entry.state is ReplicaState.COMPLETE
                and bool(self._live_replicas(entry)))

    def _delete(self, entry: Entry, drop_on: list[NodeId]) -> None:
        self.table.remove(entry)
        if entry.state is ReplicaState.COMPLETE:
            self.complete_bytes -= entry.size_bytes
        for node_id in drop_on:
            self.membership.order_drop(node_id, entry.key, entry.object_id)
        if entry.state is ReplicaState.PENDING:
            self.num_pending -= 1
            for node_id in entry.targets:
                self.membership.unreserve(node_id, entry.size_bytes)

    def _unreported_drops(self, targets: list[NodeId]) -> list[NodeId]:
        """Of the targets that never reported a put, those to order a drop to: the live
        ones. A dead target needs none, and orders to it would pile up until it is
        forgotten: bytes it may hold unconfirmed are refused when its STORED event
        is replayed (or are gone with its restart; slower tiers hold only
        confirmed objects)."""
        return [n for n in targets if self.membership.is_alive(n)]

    def forget_nodes(self, now_ms: int) -> list[NodeId]:
        """Forget the nodes dead past the membership's ``forget_ms``; their replicas
        go with :meth:`forget_steps` (an object left with no replica anywhere is
        deleted; a node that returns re-announces what it kept). Returns them."""
        gone = self.membership.forget(now_ms)
        self.forgetting.update(gone)
        return sorted(gone)

    def forget_steps(self) -> Iterator[None]:
        """Drop the replicas of the nodes forgotten (:attr:`forgetting`), a slice of the
        entries at a time (yields between slices). A node that registered again
        meanwhile is left to its registration, which sweeps what it no longer holds
        (it sweeps while the node is in :attr:`forgetting`)."""
        if not self.forgetting:
            return
        self.repair_hint = True
        forgotten = set(self.forgetting)
        gone = set(forgotten)
        for entries in self.table.scan():
            gone -= self.membership.nodes.keys()
            for entry in entries:
                if not (gone & set(entry.replicas) or gone & set(entry.targets)):
                    continue
                entry.replicas = [n for n in entry.replicas if n not in gone]
                entry.targets = [n for n in entry.targets if n not in gone]
                for n in gone:
                    entry.tiers.pop(n, None)
                if entry.repair_target in gone:
                    entry.repair_target = None
                if entry.state is ReplicaState.COMPLETE and not entry.replicas:
                    self._delete(entry, [])
                    self.counters[C.FORGOTTEN] += 1
            yield
        self.forgetting -= forgotten

    def _place(self, size_bytes: int, replica_num: int, preferred: str,
               now_ms: int) -> list[NodeInfo]:
        """Choose up to ``replica_num`` distinct live nodes, most free space first.

        Raises:
            Unavailable: no live node.
            TooLarge: the value exceeds every live node's capacity.
        """
        alive = self.membership.alive_nodes()
        if not alive:
            raise self.membership.no_live_node(now_ms)
        # All quarantined: better a suspect node than no put.
        alive = self.membership.healthy_nodes(now_ms) or alive
        fits = [n for n in alive if n.max_object_bytes >= size_bytes]
        if not fits:
            biggest = max(n.max_object_bytes for n in alive)
            raise TooLarge(f"{size_bytes} B exceeds the largest object any node keeps "
                           f"({biggest} B: under its high watermark)")
        fits.sort(key=lambda n: (n.node_id != preferred, -n.free_bytes, n.node_id))
        return fits[:max(1, replica_num)]

    @staticmethod
    def _each(items, fn) -> Results:
        """``fn(item)`` per item; a KVStoreError becomes that item's result."""
        out: Results = []
        for item in items:
            try:
                out.append(fn(item))
            except KVStoreError as err:
                if err.key is None:
                    err.key = getattr(item, "key", item)
                out.append(err)
        return out

    # ---- put ----
    def put_start(self, items: Sequence[PutItem], now_ms: int, replica_num: int = 1,
                  preferred_node: str = "") -> Results:
        """Place each value: per item a :class:`PutPlan` or the error."""
        return self._each(items, lambda it: self._put_start_one(it, max(1, replica_num),
                                                                preferred_node, now_ms))

    def _put_start_one(self, item: PutItem, replica_num: int, preferred: str,
                       now_ms: int) -> PutPlan:
        key = self._check_key(item.key)
        entry = self.entries.get(key)
        if entry is not None and entry.state is ReplicaState.PENDING and now_ms > entry.deadline_ms:
            log.warning("put of %s timed out after %d ms: revoked", key, self.put_timeout_ms)
            self.counters[C.PUTS_EXPIRED] += 1
            self._delete(entry, self._unreported_drops(entry.targets))
            entry = None
        if entry is not None and entry.state is ReplicaState.COMPLETE and not self._live_replicas(entry):
            # Every replica is on a dead node: the object is lost; the key is free again.
            self._delete(entry, [])
            entry = None
        if entry is not None:
            if entry.state is ReplicaState.PENDING:
                raise PutInProgress("another put of this key is in progress")
            if (item.checksum_at_end or entry.checksum == item.checksum) and \
                    entry.size_bytes == item.size_bytes:
                self.counters[C.PUTS_ALREADY_PRESENT] += 1
                return PutPlan(entry.object_id, already_present=True)
            raise KeyConflict(f"key holds different bytes ({entry.size_bytes} B, checksum "
                              f"{entry.checksum:#x}); objects are immutable")
        if self.num_pending >= self.max_pending_puts:
            self.counters[C.PUTS_BUSY] += 1
            raise Unavailable(f"{self.num_pending} puts in progress on this shard, the most it "
                              f"holds (--max-pending-puts); retry once some complete")
        self._check_room(key)
        nodes = self._place(item.size_bytes, replica_num, preferred, now_ms)
        entry = Entry(key=key, size_bytes=item.size_bytes, checksum=item.checksum,
                      object_id=self._new_id(), state=ReplicaState.PENDING,
                      targets=[n.node_id for n in nodes], created_ms=now_ms,
                      deadline_ms=now_ms + self.put_timeout_ms, replica_num=replica_num,
                      checksum_at_end=item.checksum_at_end)
        for n in nodes:
            self.membership.reserve(n.node_id, item.size_bytes)
        self.table.add(entry)
        self._awaiting.add(key)
        self.num_pending += 1
        self.counters[C.PUT_STARTS] += 1
        return PutPlan(entry.object_id, tuple(n.address for n in nodes))

    def grant(self, replica_num: int, num_ids: int, now_ms: int,
              key: str = "") -> tuple[Grant, list[NodeInfo]]:
        """A placement grant (:mod:`kvstore.master.grants`): ``num_ids`` fresh object
        ids (at most MAX_IDS_PER_GRANT) and the nodes new bytes may go to,
        most free space first.

        Raises:
            Unavailable: no live store node.
            WrongShard: ``key`` (when given) is another shard's.
        """
        if key:
            self._check_key(key)
        alive = self.membership.alive_nodes()
        if not alive:
            raise self.membership.no_live_node(now_ms)
        nodes = self.membership.healthy_nodes(now_ms) or alive
        nodes = sorted(nodes, key=lambda n: (-n.free_bytes, n.node_id))
        n = max(1, min(num_ids, MAX_IDS_PER_GRANT))
        g = self.grants.issue(self._next_id, n, replica_num, now_ms)
        self._next_id += n
        self.counters[C.GRANTS] += 1
        return g, nodes

    def put_revoke(self, items: Sequence[tuple[str, ObjectId]]) -> Results:
        """The writer gives up the targets that did not acknowledge its bytes: a put
        no target stored is undone; a stored one keeps its replicas and releases
        the rest. Per (key, object_id) None or NotFound."""
        return self._each(items, lambda it: self._put_revoke_one(*it))

    def _put_revoke_one(self, key: str, object_id: ObjectId) -> None:
        entry = self.entries.get(key)
        if entry is None or entry.object_id != object_id:
            raise NotFound("no put with this object_id", key=key)
        if entry.state is ReplicaState.PENDING:
            self._delete(entry, self._unreported_drops(entry.targets))
            self.counters[C.PUTS_REVOKED] += 1
        else:
            self._release_targets(entry)
        return None

    def expire_puts(self, now_ms: int) -> int:
        """Past their deadline, revoke PENDING puts and release the targets of
        COMPLETE ones that never reported (drop orders to them); returns the
        number of puts revoked."""
        expired = 0
        for key in list(self._awaiting):
            entry = self.entries.get(key)
            if entry is None or not entry.targets:
                self._awaiting.discard(key)
                continue
            if now_ms <= entry.deadline_ms:
                continue
            self._awaiting.discard(key)
            if entry.state is ReplicaState.PENDING:
                self._delete(entry, self._unreported_drops(entry.targets))
                expired += 1
            else:
                self._release_targets(entry)
        self.counters[C.PUTS_EXPIRED] += expired
        self.grants.expire(now_ms)
        return expired

    def _release_targets(self, entry: Entry) -> None:
        """Give up waiting for the targets that have not reported the object."""
        for node_id in entry.targets:
            self.membership.unreserve(node_id, entry.size_bytes)
        for node_id in self._unreported_drops(entry.targets):
            self.membership.order_drop(node_id, entry.key, entry.object_id)
        entry.targets = []
        entry.deadline_ms = 0

    def _stored_placed(self, node_id: NodeId, event: NodeEvent, entry: Entry | None,
                       grant: Grant, now_ms: int) -> None:
        """The first STORED of a version placed through a grant decides the put
        (the rules in :mod:`kvstore.master.grants`).

        Raises:
            AlreadyPresent: the key holds equal bytes under another version.
            KeyConflict: the key holds other bytes.
            PutInProgress: a put of the first protocol is placing this key.
        """
        if entry is not None and entry.state is ReplicaState.PENDING and now_ms > entry.deadline_ms:
            self.counters[C.PUTS_EXPIRED] += 1
            self._delete(entry, self._unreported_drops(entry.targets))
            entry = None
        if entry is not None and entry.state is ReplicaState.COMPLETE and \
                not self._live_replicas(entry):
            self._delete(entry, [])          # every replica died: the key is free again
            entry = None
        if entry is not None:
            if entry.state is ReplicaState.PENDING:
                raise PutInProgress("another put of this key is in progress", key=event.key)
            grant.decided_ids.add(event.object_id)
            if entry.checksum == event.checksum and entry.size_bytes == event.size_bytes:
                self.counters[C.PUTS_ALREADY_PRESENT] += 1
                raise AlreadyPresent("equal bytes are stored", key=event.key)
            raise KeyConflict(f"key holds different bytes ({entry.size_bytes} B, checksum "
                              f"{entry.checksum:#x}); objects are immutable", key=event.key)
        self._check_room(event.key)
        self.table.add(Entry(
            key=event.key, size_bytes=event.size_bytes, checksum=event.checksum,
            object_id=event.object_id, state=ReplicaState.COMPLETE, targets=[],
            replicas=[node_id], created_ms=now_ms, replica_num=grant.replica_num,
            tiers={node_id: event.tier or TierKind.DRAM}))
        grant.decided_ids.add(event.object_id)
        self.key_order.add(event.key)
        self.complete_bytes += event.size_bytes
        if grant.replica_num > 1:
            self.repair_hint = True
        self.membership.account_stored(node_id, event.size_bytes)
        self.counters[C.PUTS] += 1
        self.counters[C.PUTS_PLACED] += 1

    def _stored(self, node_id: NodeId, event: NodeEvent, now_ms: int) -> None:
        """``node_id`` holds this version, complete and checksum-verified (STORED).

        Raises:
            NotFound: no put of this version is known (revoked, timed out,
                replaced, or never placed): the node must drop it.
            KeyConflict: the node verified other bytes than this put announced.
        """
        entry = self.entries.get(event.key)
        if entry is None or entry.object_id != event.object_id:
            grant = self.grants.find(event.object_id, now_ms)
            if grant is not None and event.object_id not in grant.decided_ids:
                self._stored_placed(node_id, event, entry, grant, now_ms)
                return
            # Revoked, timed out, replaced, an id of no live grant (a previous
            # master's, or expired; the writer asks for a new grant), or a decided
            # id whose version is gone (a late copy: see grants.py).
            raise NotFound("no put of this object_id (revoked, timed out or replaced, or "
                           "its placement grant is unknown here)", key=event.key)
        if entry.state is ReplicaState.PENDING and entry.checksum_at_end \
                and event.size_bytes == entry.size_bytes:
            entry.checksum = event.checksum     # the first complete copy decides it
        if event.checksum != entry.checksum or event.size_bytes != entry.size_bytes:
            raise KeyConflict(f"stored {event.size_bytes} B with checksum {event.checksum:#x}; "
                              f"the put announced {entry.size_bytes} B, {entry.checksum:#x}",
                              key=event.key)
        if node_id in entry.replicas:
            return                        # reported again (at-least-once delivery)
        if node_id in entry.targets:
            entry.targets.remove(node_id)
            self.membership.unreserve(node_id, entry.size_bytes)
            if not entry.targets:
                entry.deadline_ms = 0
        elif entry.repair_target != node_id and self.grants.find(entry.object_id, now_ms) is None:
            # Released (its writer gave it up, or its deadline passed): a drop is on its way.
            # (A placed put's further replicas come while its grant lives.)
            raise NotFound("this node is no longer a target of the put", key=event.key)
        entry.replicas.append(node_id)
        if entry.replica_num > 1:
            self.repair_hint = True
        entry.tiers[node_id] = event.tier or TierKind.DRAM
        self.membership.account_stored(node_id, entry.size_bytes)
        if entry.state is ReplicaState.PENDING:
            entry.state = ReplicaState.COMPLETE
            self.num_pending -= 1
            self.complete_bytes += entry.size_bytes
            self.key_order.add(entry.key)
            self.counters[C.PUTS] += 1
        elif entry.repair_target == node_id:
            entry.repair_target = None     # a repair copy landed
            self.counters[C.REPAIRS] += 1

    # ---- read side ----
    def _visible_entry(self, key: str) -> Entry:
        """The complete, readable entry of ``key`` on this shard.

        Raises:
            InvalidArgument: a bad key. WrongShard: another shard's key. NotFound.
        """
        entry = self.entries.get(self._check_key(key))
        if not self._visible(entry):
            lost = entry is not None and entry.state is ReplicaState.COMPLETE  # with its nodes
            raise NotFound("no such key" + (f": its replicas were on dead node(s) "
                                            f"{', '.join(entry.replicas)}" if lost else ""),
                           key=key)
        return entry

    def lookup(self, keys: Sequence[str], now_ms: int) -> Results:
        """Per key its :class:`ObjectMeta` (live replicas only), or the error; counts an access."""
        def one(key: str) -> ObjectMeta:
            try:
                entry = self._visible_entry(key)
            except KVStoreError:
                self.counters[C.LOOKUP_MISSES] += 1
                raise
            entry.access_count += 1
            entry.last_access_ms = now_ms
            self.counters[C.LOOKUP_HITS] += 1
            return self._meta(entry)
        return self._each(keys, one)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Visibility only; never refreshes access stats (it must not block eviction)."""
        return self.exists_checked(keys)[0]

    def exists_checked(self, keys: Sequence[str]) -> tuple[list[bool], list[KVStoreError | None]]:
        """Visibility per key, with an error per key: WrongShard (and False) for a key
        this shard does not own, never a False that means "absent". The errors
        are an empty list when every key was answered (the common case: no 1000
        OK statuses to build and parse)."""
        self.counters[C.EXISTS_KEYS] += len(keys)
        entries = self.entries
        out: list[bool] = []
        errors: list[KVStoreError | None] = []
        failed = False
        for key in keys:
            try:
                self._check_key(key)
            except KVStoreError as err:
                out.append(False)
                errors.append(err)
                failed = True
                continue
            out.append(self._visible(entries.get(key)))
            errors.append(None)
        return out, errors if failed else []

    def remove(self, keys: Sequence[str], reason: RemoveReason = RemoveReason.REMOVE) -> Results:
        """Remove each visible key (drop orders to its nodes): per key the removed
        object's metadata (its version and live replicas) or the error."""
        def one(key: str) -> ObjectMeta:
            entry = self._visible_entry(key)
            meta = self._meta(entry)
            self._delete(entry, entry.replicas)
            self.counters[C.EVICTS if reason is RemoveReason.EVICT else C.REMOVES] += 1
            return meta
        return self._each(keys, one)

    def list(self, prefix: str, start_after: str, limit: int) -> tuple[list[ObjectMeta], str]:
        """Visible objects whose key starts with ``prefix``, in key order, after
        ``start_after``; at most ``limit`` (0: 1000). Returns (page, next cursor or "")."""
        limit = limit or 1000
        keys = self.key_order.iterate(
            start_after or prefix, bool(start_after), num_live=len(self.entries) - self.num_pending,
            live=lambda: (k for k, e in self.entries.items() if e.state is ReplicaState.COMPLETE))
        out: list[ObjectMeta] = []
        more = False
        for key in keys:
            if not key.startswith(prefix):
                if key > prefix:
                    break
                continue
            entry = self.entries.get(key)
            if not self._visible(entry):
                continue
            if len(out) == limit:
                more = True               # a next visible key: the page has a cursor
                break
            out.append(self._meta(entry))
        return out, out[-1].key if out and more else ""

    def _meta(self, entry: Entry) -> ObjectMeta:
        replicas = tuple(Replica(self.membership.nodes[n].address,
                                 entry.tiers.get(n, TierKind.DRAM))
                         for n in self._live_replicas(entry))
        return ObjectMeta(key=entry.key, size_bytes=entry.size_bytes, checksum=entry.checksum,
                          object_id=entry.object_id, replicas=replicas,
                          created_ms=entry.created_ms, access_count=entry.access_count,
                          last_access_ms=entry.last_access_ms)

    def stat(self) -> ShardStatus:
        nodes = tuple(NodeStatus(address=info.address, alive=info.alive,
                                 capacity_bytes=info.capacity_bytes, used_bytes=info.used_bytes,
                                 num_objects=info.num_objects,
                                 last_heartbeat_ms=info.last_heartbeat_ms, tiers=info.tiers,
                                 counters=dict(info.counters), syncing=info.syncing)
                      for info in self.membership.nodes.values())
        return ShardStatus(shard_id=self.shard_id, shard_map_version=self.shard_map.version,
                           nodes=nodes, num_objects=len(self.entries) - self.num_pending,
                           total_bytes=self.complete_bytes, pending_puts=self.num_pending,
                           counters={c.value: v for c, v in self.counters.items()})

    # ---- what the nodes report: events and inventories ----
    def node_event(self, node_id: NodeId, event: NodeEvent, now_ms: int = 0) -> KVStoreError | None:
        """Apply one of a node's events (kvstore/store/events.py), in the order it sent them.

        ``now_ms`` dates it (grants expire); 0: no grant has expired.

        Returns:
            None, or for a STORED event the reason the node must drop the
            object (see :meth:`_stored`); the node fails the write with it.
        """
        if event.kind is EventKind.STORED:
            try:
                self._stored(node_id, event, now_ms)
            except KVStoreError as err:
                self.membership.order_drop(node_id, event.key, event.object_id)
                self.counters[C.STORED_REFUSED] += 1
                return err
            return None
        entry = self.entries.get(event.key)
        if entry is None or entry.object_id != event.object_id or node_id not in entry.replicas:
            return None
        if event.kind is EventKind.EVICTED:
            entry.replicas.remove(node_id)
            entry.tiers.pop(node_id, None)
            self.repair_hint = True
            self.counters[C.REPLICAS_EVICTED] += 1
            if not entry.replicas:
                self._delete(entry, [])
        elif event.kind in (EventKind.DEMOTED, EventKind.PROMOTED) and event.tier is not None:
            entry.tiers[node_id] = event.tier
            self.counters[C.REPLICAS_PROMOTED if event.kind is EventKind.PROMOTED
                          else C.REPLICAS_DEMOTED] += 1
        return None

    def sync_node_inventory(self, node_id: NodeId, items: Sequence[InventoryItem],
                            now_ms: int) -> tuple[int, int]:
        """Make the index agree with what a (re)registering node holds; see
        :func:`kvstore.master.inventory.sync_node_inventory`.

        Returns:
            (entries that lost their last replica, entries indexed from the inventory).
        """
        self.repair_hint = True
        return sync_node_inventory(self, node_id, items, now_ms)
