"""The master shard's object index: the put protocol, lookups, removal, listing.

An entry goes through::

    grant (ids, nodes) --the first STORED of a granted id applied--> entry --remove--> gone
                          (a new key; the entry is visible at once)  (more STOREDs:  (drop orders
                                                                      more replicas)  to its nodes)

The node that holds the bytes makes an object visible, not the client: a
client writes under an object id of a placement grant (:mod:`.grants`), the
node commits the value (its checksum verified), reports STORED in its
ordered event stream (:meth:`ObjectIndex.node_event`), and acknowledges the
client's write only once this shard has applied the report, which decides
the put. So when a put returns, the entry is here and every reader's lookup
finds it (read-your-writes for everyone), and no client can make the index
claim a node holds what it does not. Nothing is held here while the bytes
move: a writer that dies mid-put leaves no entry, and blocks no one.

Rules: objects are immutable; a second put of a key with equal bytes (same
size and xxh3-64) is "already present", with different bytes KeyConflict
(the first STORED applied wins); a value larger than every node is TooLarge
(refused by the grant's node list, client side, before bytes move); nothing
half-created is ever an entry: lookup, exists and list report entries with
a live replica.

The index is a cache of what the nodes hold (DESIGN.md): node events
(:meth:`ObjectIndex.node_event`) and inventories
(:meth:`ObjectIndex.sync_node_inventory`) keep it true. It speaks
:mod:`kvstore.types` records; only the servicer sees protobuf.

Thread safety: owned by the master's event loop; not locked. Pure: time is
passed in as ``now_ms``, so tests drive it without a network or clock. It is
monotonic ms (:mod:`kvstore.clock`): every deadline, ttl and age here is measured
on it; the servicer shows its instants (created, last access, last heartbeat)
as unix ms in replies.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Callable, Iterator, Sequence

from kvstore.errors import (AlreadyPresent, KeyConflict, KVStoreError, NoSpace, NotFound,
                            Unavailable, WrongShard)
from kvstore.keys import key_slot, validate_key
from kvstore.master.counters import MasterCounter as C
from kvstore.master.entries import (PROBE_ABSENT, PROBE_OTHER_BYTES, PROBE_OTHER_VERSION,
                                    PROBE_REPLICA, SCAN_SLICE, TIERS, EntriesView, EntryTable)
from kvstore.master.entry import Entry
from kvstore.master.event_feed import StoreEventKind
from kvstore.master.grants import MAX_IDS_PER_GRANT, Grant, Grants
from kvstore.master.inventory import sync_node_inventory
from kvstore.master.limits import MASTER_BYTES_PER_OBJECT
from kvstore.master.membership import Membership, NodeInfo
from kvstore.master.superseded import Superseded
from kvstore.master.tenant_book import TenantBook, TenantCounter as TC, bump
from kvstore.shardmap import ShardMap
from kvstore.tenants import tenant_of
from kvstore.types import (EventKind, InventoryItem, NodeEvent, NodeId, ObjectId, ObjectKey,
                           ObjectMeta, RemoveReason, Replica, ShardStatus, NodeStatus,
                           TierKind)

log = logging.getLogger(__name__)


Results = list  # per input item, in order: a record (or None) for success, a KVStoreError


class ObjectIndex:
    """Index of one master shard.

    Args:
        membership: the shard's node registry.
        shard_map: the current map; keys of other shards get WrongShard.
        shard_id: this shard's id in the map.
        put_timeout_ms: how long past a grant's validity a put of its ids may still
            report STORED (a put started just before the grant ran out).
        max_objects: objects indexed at most; a new key beyond is NoSpace (:mod:`.limits`).
    """

    def __init__(self, membership: Membership, shard_map: ShardMap, shard_id: int = 0,
                 put_timeout_ms: int = 30_000, max_objects: int = 2**63 - 1):
        self.membership = membership
        self.shard_map = shard_map
        self.shard_id = shard_id
        self.max_objects = max_objects
        self.complete_bytes = 0        # bytes of the entries (stat is O(1))
        self.table = EntryTable()      # the entries (native), by key and by slot (scans)
        self.entries: EntriesView = self.table.view()   # key -> Entry snapshots (tests)
        self._next_id = 1              # object ids; above every id seen in an inventory
        self.counters: Counter[C] = Counter()
        self.grants = Grants(grace_ms=put_timeout_ms)    # placement grants: how puts are placed
        # Something may have left an entry with fewer live replicas than wanted
        # (a replica evicted or forgotten, an inventory synced, a put with
        # replica_num > 1 completed by its first replica, a repair failed): the
        # repair planner scans every entry only then or when membership changes.
        self.repair_hint = True
        # Nodes forgotten whose replicas may still be listed in entries (forget_steps).
        self.forgetting: set[NodeId] = set()
        # Keys replaced while an older version was on a dead node (kvstore.master.superseded).
        self.superseded = Superseded(keep_ms=membership.forget_ms)
        # No id at or above this is handed out (None: no bound; kvstore.master.roster).
        self.ids_below: int | None = None
        # The shard's event log (kvstore.master.event_feed.EventFeed.record): told of
        # each key that becomes readable or goes away. None: nobody listens.
        self.on_event: Callable[..., object] | None = None
        # Tenants' hard limits and counters (kvstore.master.tenant_book); usage is the table's.
        own = [r for r in shard_map.ranges if r.shard_id == shard_id]
        self.tenants = TenantBook(fraction=min(1.0, sum(r.last_slot - r.first_slot + 1
                                                        for r in own) / shard_map.num_slots)
                                  if own else 1.0)

    def _emit(self, kind: StoreEventKind, key: str, object_id: int, size_bytes: int,
              node_id: str = "") -> None:
        if self.on_event is not None:
            self.on_event(kind, key, object_id, size_bytes, node_id)

    def _check_key(self, key: str) -> ObjectKey:
        validate_key(key)
        shard = self.shard_map.shard_for_slot(key_slot(key))
        if shard.shard_id != self.shard_id:
            raise WrongShard(f"slot owned by shard {shard.shard_id}", key=key,
                             redirect=str(shard))
        return ObjectKey(key)

    def _check_room(self, key: str) -> None:
        """Raises NoSpace when a new key would pass ``max_objects``."""
        if len(self.table) >= self.max_objects:
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
        return entry is not None and bool(self._live_replicas(entry))

    def _alive(self) -> bytes:
        """The alive mask by node number (:meth:`EntryTable.alive_mask`)."""
        return self.table.alive_mask(self.membership.is_alive)

    def _delete(self, slot: int, drop_on: Sequence[NodeId]) -> None:
        """Delete the entry at ``slot``, ordering its version dropped on ``drop_on``."""
        native = self.table.native
        object_id, size_bytes, _ = native.head(slot)
        if drop_on:
            key = ObjectKey(native.key(slot))
            for node_id in drop_on:
                self.membership.order_drop(node_id, key, object_id)
        native.remove(slot)
        self.complete_bytes -= size_bytes

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
        native = self.table.native
        for start in range(0, native.positions(), SCAN_SLICE):
            gone -= self.membership.nodes.keys()
            _, deleted, deleted_bytes = native.forget_slice(start, SCAN_SLICE,
                                                            self.table.mask_of(gone))
            self.complete_bytes -= deleted_bytes
            self.counters[C.FORGOTTEN] += deleted
            yield
        self.forgetting -= forgotten

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

    # ---- put (kvstore.master.grants) ----
    def grant(self, replica_num: int, num_ids: int, now_ms: int,
              key: str = "") -> tuple[Grant, list[NodeInfo]]:
        """A placement grant (:mod:`kvstore.master.grants`): ``num_ids`` fresh object
        ids (at most MAX_IDS_PER_GRANT) and the nodes new bytes may go to, in node id
        order: which of them a value goes to is the one placement policy, the SDK's
        rendezvous hash of the key over them (:mod:`kvstore.client.placement`).

        Raises:
            Unavailable: no live store node, or the ids are being reserved (retry).
            WrongShard: ``key`` (when given) is another shard's.
        """
        if key:
            self._check_key(key)
            if self.tenants.quotas:
                self.tenants.check_grant(self, key)
        n = max(1, min(num_ids, MAX_IDS_PER_GRANT))
        if self.ids_below is not None and self._next_id + n > self.ids_below:
            raise Unavailable("the shard is reserving object ids (kvstore/master/roster.py); "
                              "retry")
        alive = self.membership.alive_nodes()
        if not alive:
            raise self.membership.no_live_node(now_ms)
        nodes = self.membership.healthy_nodes(now_ms) or alive
        nodes = sorted(nodes, key=lambda n: n.node_id)
        g = self.grants.issue(self._next_id, n, replica_num, now_ms)
        self._next_id += n
        self.counters[C.GRANTS] += 1
        return g, nodes

    def expire_grants(self, now_ms: int) -> int:
        """Forget the grants past their expiry (their ids' STOREDs are refused from
        then on), and the superseded notes past theirs; returns the grants forgotten."""
        self.superseded.expire(now_ms)
        return self.grants.expire(now_ms)

    def _stored_placed(self, node_id: NodeId, node: int, event: NodeEvent, slot: int,
                       grant: Grant, now_ms: int) -> None:
        """The first STORED of a version placed through a grant decides the put
        (the rules in :mod:`kvstore.master.grants`); ``slot`` is the key's entry
        of another version, or -1.

        Raises:
            AlreadyPresent: the key holds equal bytes under another version.
            KeyConflict: the key holds other bytes.
            InvalidArgument, WrongShard: a key no put may make (the node took it
                from its client unchecked).
        """
        self._check_key(event.key)
        native = self.table.native
        replaced_dead = False
        if slot >= 0 and not native.visible(slot, self._alive()):
            self._delete(slot, [])           # every replica died: the key is free again ...
            slot = -1                        # ... but a dead node may bring the old one back
            replaced_dead = True
        if slot >= 0:
            grant.decided_ids.add(event.object_id)
            _, size_bytes, checksum = native.head(slot)
            if size_bytes == event.size_bytes and checksum == event.checksum:
                self.counters[C.PUTS_ALREADY_PRESENT] += 1
                raise AlreadyPresent("equal bytes are stored", key=event.key)
            raise KeyConflict(f"key holds different bytes ({size_bytes} B, checksum "
                              f"{checksum:#x}); objects are immutable", key=event.key)
        self._check_room(event.key)
        book = self.tenants
        if book.quotas:
            book.check_put(self, event.key, event.size_bytes)
        native.insert(event.key, event.size_bytes, event.checksum, event.object_id, now_ms,
                      grant.replica_num, node, event.tier or TierKind.DRAM)
        grant.decided_ids.add(event.object_id)
        if replaced_dead:
            self.superseded.note(event.key, event.object_id, now_ms)
        else:
            self.superseded.renew(event.key, event.object_id, now_ms)
        self.complete_bytes += event.size_bytes
        if grant.replica_num > 1:
            self.repair_hint = True
        self.membership.account_stored(node_id, event.size_bytes)
        self.counters[C.PUTS] += 1
        if event.key[0] == "@":              # a named tenant's (the default's: the rest)
            bump(book.puts, event.key)
        self._emit(StoreEventKind.KEY_STORED, event.key, event.object_id, event.size_bytes,
                   node_id)

    def _stored(self, node_id: NodeId, event: NodeEvent, now_ms: int) -> None:
        """``node_id`` holds this version, complete and checksum-verified (STORED).

        Raises:
            NotFound: no put of this version is known (its grant expired or is a
                previous leader's, or the version was removed or replaced): the
                node must drop it.
            KeyConflict: the node verified other bytes than the version's first copy.
        """
        native = self.table.native
        node = self.table.ix(node_id)
        code, slot = native.stored_probe(event.key, event.object_id, event.size_bytes,
                                         event.checksum, node)
        if code <= PROBE_OTHER_VERSION:      # no entry, or one of another version
            grant = self.grants.find(event.object_id, now_ms)
            if grant is not None and event.object_id not in grant.decided_ids:
                self._stored_placed(node_id, node, event,
                                    -1 if code == PROBE_ABSENT else slot, grant, now_ms)
                return
            # An id of no live grant (a previous master's, or expired; the writer
            # asks for a new grant), or a decided id whose version is gone (removed
            # or replaced: a late copy, see grants.py).
            raise NotFound("no put of this object_id (removed or replaced, or its placement "
                           "grant is unknown here)", key=event.key)
        if code == PROBE_OTHER_BYTES:
            _, size_bytes, checksum = native.head(slot)
            raise KeyConflict(f"stored {event.size_bytes} B with checksum {event.checksum:#x}; "
                              f"the put announced {size_bytes} B, {checksum:#x}",
                              key=event.key)
        if code == PROBE_REPLICA:
            return                        # reported again (at-least-once delivery)
        target, _ = native.repair(slot)
        if target != node and self.grants.find(event.object_id, now_ms) is None:
            # A put's further replicas come while its grant lives; later, only the
            # copy the repair planner ordered is one.
            raise NotFound("no put or repair of this version is in flight to this node",
                           key=event.key)
        native.add_replica(slot, node, event.tier or TierKind.DRAM)
        if native.replica_num(slot) > 1:
            self.repair_hint = True
        self.membership.account_stored(node_id, event.size_bytes)
        if target == node:
            native.set_repair(slot, -1, 0)      # a repair copy landed
            self.counters[C.REPAIRS] += 1

    # ---- read side ----
    def _not_found(self, key: str, dead: list[int] | None) -> NotFound:
        """NotFound of ``key``: absent, or held only by the ``dead`` nodes (numbers)."""
        return NotFound("no such key" + (f": its replicas were on dead node(s) "
                                         f"{', '.join(self.table.names(dead))}"
                                         if dead is not None else ""), key=key)

    def _visible_slot(self, key: str) -> int:
        """The slot of the complete, readable entry of ``key`` on this shard.

        Raises:
            InvalidArgument: a bad key. WrongShard: another shard's key. NotFound.
        """
        native = self.table.native
        slot = native.find(self._check_key(key))
        if slot < 0:
            raise self._not_found(key, None)
        if not native.visible(slot, self._alive()):
            raise self._not_found(key, native.nodes(slot))
        return slot

    def _checked(self, keys: Sequence[str], errors: list) -> list[str]:
        """The keys this shard may answer; per key of ``keys`` its error (or None) is
        appended to ``errors``."""
        ok: list[str] = []
        for key in keys:
            try:
                self._check_key(key)
            except KVStoreError as err:
                if err.key is None:
                    err.key = key
                errors.append(err)
                continue
            ok.append(key)
            errors.append(None)
        return ok

    def lookup(self, keys: Sequence[str], now_ms: int) -> Results:
        """Per key its :class:`ObjectMeta` (live replicas only), or the error; counts an
        access. The table's part runs in one native call for the batch."""
        out: Results = []
        ok = self._checked(keys, out)
        rows = iter(self.table.native.lookup(ok, now_ms, self._alive()))
        nodes, names = self.membership.nodes, self.table.node_ids
        hits = 0
        for i, key in enumerate(keys):
            if out[i] is not None:
                continue                   # its key's error
            row = next(rows)
            if type(row) is tuple:
                size, checksum, object_id, created, count, last, reps = row
                out[i] = ObjectMeta(
                    key=key, size_bytes=size, checksum=checksum, object_id=object_id,
                    replicas=tuple(Replica(nodes[names[n]].address, TIERS[t]) for n, t in reps),
                    created_ms=created, access_count=count, last_access_ms=last)
                hits += 1
                if key[0] == "@":            # a named tenant's (the default's: the rest)
                    bump(self.tenants.hits, key)
            else:
                out[i] = self._not_found(key, row)
                if key[0] == "@":
                    bump(self.tenants.misses, key)
        self.counters[C.LOOKUP_HITS] += hits
        self.counters[C.LOOKUP_MISSES] += len(keys) - hits
        return out

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Visibility only; never refreshes access stats (it must not block eviction)."""
        return self.exists_checked(keys)[0]

    def exists_checked(self, keys: Sequence[str]) -> tuple[list[bool], list[KVStoreError | None]]:
        """Visibility per key, with an error per key: WrongShard (and False) for a key
        this shard does not own, never a False that means "absent". The errors
        are an empty list when every key was answered (the common case: no 1000
        OK statuses to build and parse)."""
        self.counters[C.EXISTS_KEYS] += len(keys)
        errors: list[KVStoreError | None] = []
        ok = self._checked(keys, errors)
        found = self.table.native.exists(ok, self._alive())
        if len(ok) == len(keys):
            return found, []
        it = iter(found)
        return [False if e is not None else next(it) for e in errors], errors

    def hidden(self, keys: Sequence[str]) -> Results:
        """What a caller outside these keys' tenants is told (:mod:`kvstore.tenants`):
        per key the NotFound of a key that never existed (or its WrongShard /
        InvalidArgument, which say nothing of existence), after the same table probe
        a miss costs, so neither the answer nor its time tells whether the key
        exists. Nothing is changed (no access counted on the entry); counted as
        lookup misses."""
        out: Results = []
        ok = self._checked(keys, out)
        self.table.native.exists(ok, self._alive())   # a lookup's probe; the answer is a miss
        for i, key in enumerate(keys):
            if out[i] is None:
                out[i] = self._not_found(key, None)
        self.counters[C.LOOKUP_MISSES] += len(keys)
        return out

    def remove(self, keys: Sequence[str], reason: RemoveReason = RemoveReason.REMOVE) -> Results:
        """Remove each visible key (drop orders to its nodes): per key the removed
        object's metadata (its version and live replicas) or the error."""
        def one(key: str) -> ObjectMeta:
            slot = self._visible_slot(key)
            meta = self._meta(slot)
            self._delete(slot, self.table.names(self.table.native.nodes(slot)))
            evict = reason is RemoveReason.EVICT
            self.counters[C.EVICTS if evict else C.REMOVES] += 1
            self._emit(StoreEventKind.KEY_EVICTED if evict else StoreEventKind.KEY_REMOVED,
                       key, meta.object_id, meta.size_bytes)
            return meta
        return self._each(keys, one)

    def list(self, prefix: str, start_after: str, limit: int) -> tuple[list[ObjectMeta], str]:
        """Visible objects whose key starts with ``prefix``, in key order, after
        ``start_after``; at most ``limit`` (0: 1000). Returns (page, next cursor or "").

        A page is one native scan of every entry (no key order is kept: it would
        cost a pointer or more per entry): about 0.1-0.3 s at 10M entries."""
        limit = limit or 1000
        slots = self.table.native.list(prefix, start_after, limit + 1, self._alive())
        out = [self._meta(s) for s in slots[:limit]]
        return out, out[-1].key if out and len(slots) > limit else ""

    def _meta(self, slot: int) -> ObjectMeta:
        """The reply's view of the entry at ``slot`` (live replicas only)."""
        (key, size, checksum, object_id, created, count, last, _, reps, _,
         _) = self.table.native.record(slot)
        nodes, names, alive = self.membership.nodes, self.table.node_ids, self.membership.is_alive
        replicas = tuple(Replica(nodes[names[n]].address, TIERS[t]) for n, t in reps
                         if alive(names[n]))
        return ObjectMeta(key=ObjectKey(key), size_bytes=size, checksum=checksum,
                          object_id=object_id, replicas=replicas, created_ms=created,
                          access_count=count, last_access_ms=last)

    def stat(self) -> ShardStatus:
        nodes = tuple(NodeStatus(address=info.address, alive=info.alive,
                                 capacity_bytes=info.capacity_bytes, used_bytes=info.used_bytes,
                                 num_objects=info.num_objects,
                                 last_heartbeat_ms=info.last_heartbeat_ms, tiers=info.tiers,
                                 counters=dict(info.counters), syncing=info.syncing)
                      for info in self.membership.nodes.values())
        # One rule everywhere: an object counts while it is readable (a live replica).
        gone, gone_bytes = self.table.unavailable(self.membership.is_alive)
        return ShardStatus(shard_id=self.shard_id, shard_map_version=self.shard_map.version,
                           nodes=nodes, num_objects=len(self.table) - gone,
                           total_bytes=self.complete_bytes - gone_bytes,
                           unavailable_objects=gone, unavailable_bytes=gone_bytes,
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
        native = self.table.native
        slot, node = native.find(event.key), self.table.ix_of(node_id)
        if (slot < 0 or node is None or native.head(slot)[0] != event.object_id
                or not native.has_replica(slot, node)):
            return None
        if event.kind is EventKind.EVICTED:
            native.remove_replica(slot, node)
            self.repair_hint = True
            self.counters[C.REPLICAS_EVICTED] += 1
            if not native.nodes(slot):
                size_bytes = native.head(slot)[1]
                self._delete(slot, [])
                self.tenants.count(tenant_of(event.key), TC.EVICTIONS)
                self._emit(StoreEventKind.KEY_EVICTED, event.key, event.object_id, size_bytes,
                           node_id)
        elif event.kind in (EventKind.DEMOTED, EventKind.PROMOTED) and event.tier is not None:
            native.set_tier(slot, node, event.tier)
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

