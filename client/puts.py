"""The put protocol: PutStart, the writes to every target node, PutRevoke when one fails.

Every put of the SDK runs it, whole values (:meth:`PutProtocol.put_many`,
behind ``put`` / ``batch_put`` / ``put_tensor``) and values written part by
part (:class:`kvstore.client.parts.PartsWriter`, through :meth:`start`,
:meth:`stored` and :meth:`revoke`)::

    PutStart      master: a new object id and the target nodes (or "already
                  present", KeyConflict, PutInProgress, ...)
    write         each target node stores the bytes, verifies the checksum,
                  reports them STORED to its master shard and acknowledges
                  once the shard applied the report: the key is visible
    PutRevoke     gives back the targets that failed (the whole put when no
                  target took it)

Ordering: a target acknowledges a write only after its master shard made the
object visible, and a put returns only after every target answered, so a
returned put is visible to every reader (read-your-writes for everyone); no
client call sits between the bytes and the acknowledgement.

This module holds the protocol's only master calls (PutStart, PutRevoke),
routed like every call (:meth:`Control.routed`). A key
repeated in one batch is put in waves, one occurrence per wave; a key another
client is putting (PUT_IN_PROGRESS) is retried with backoff for up to
``put_wait_s``. A value this client stored goes into its metadata cache.

Thread safety: a PutProtocol may be shared by threads (its writes go through
the calling thread's transports).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

from kvstore import wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.connections import Connections
from kvstore.client.control import Control
from kvstore.client.meta_cache import MetaCache
from kvstore.errors import (InvalidArgument, KVStoreError, PutInProgress, Unavailable,
                            error_for_code)
from kvstore.keys import validate_key, value_checksum
from kvstore.transfer.base import WriteItem
from kvstore.transfer.buffers import readable_view
from kvstore.types import (NodeAddress, NodeId, ObjectId, ObjectKey, ObjectMeta, Replica,
                           TierKind)


#: Most replicas one put may ask for.
MAX_REPLICAS = 16


@dataclass(frozen=True, slots=True)
class Placement:
    """PutStart's answer for one key: write the value under ``object_id`` to
    ``targets``, or nothing at all when equal bytes are ``already_present``."""

    object_id: ObjectId
    targets: tuple[NodeAddress, ...]
    already_present: bool = False


@dataclass(frozen=True, slots=True)
class Written:
    """A value some target nodes acknowledged (so it is visible): what
    :meth:`PutProtocol.stored` remembers."""

    key: ObjectKey
    object_id: ObjectId
    size_bytes: int
    checksum: int                    # xxh3-64 of the value
    nodes: tuple[NodeAddress, ...]   # the targets that acknowledged the bytes


class PutProtocol:
    """Runs puts against the masters and the nodes.

    Args:
        control: the client's control plane (routing, failover).
        connections: the data connections the values are written through.
        meta: the metadata cache that learns each stored value.
        replica_num: default number of replicas per put.
        put_wait_s: how long a put waits for another in-flight put of the same
            key to finish before failing with PutInProgress.

    Attributes:
        connections: as given (a :class:`PartsWriter` reserves through them).
    """

    def __init__(self, control: Control, connections: Connections, meta: MetaCache, *,
                 replica_num: int, put_wait_s: float):
        self._control = control
        self.connections = connections
        self._meta = meta
        self.replica_num = replica_num
        self.put_wait_s = put_wait_s

    # ---- whole values ----
    def put_many(self, keys: Sequence[str], values: Sequence[Any], replica_num: int | None,
                 parents: Sequence[str]) -> list[bool | KVStoreError]:
        """Put each value (bytes-like, numpy array or CPU tensor) under its key.

        Args:
            replica_num: replicas per value (None: the default).
            parents: per key the previous block of its prefix chain, or "".

        Returns:
            Per key True (written), False (equal bytes already stored) or the error.

        Raises:
            InvalidArgument: the lengths differ.
            Unavailable: a master cannot be reached.
        """
        if not len(keys) == len(values) == len(parents):
            raise InvalidArgument(f"{len(keys)} keys, {len(values)} values, {len(parents)} parents")
        n = len(keys)
        results: list[bool | KVStoreError] = [False] * n
        views: list[memoryview | None] = [None] * n
        checksums = [0] * n
        todo = []
        for i, (k, v) in enumerate(zip(keys, values)):
            try:
                validate_key(k)
                views[i] = readable_view(v)
                checksums[i] = value_checksum(views[i])
                todo.append(i)
            except KVStoreError as err:
                results[i] = err
        replicas = replica_num or self.replica_num
        # A key repeated in one batch is put in waves, one occurrence per wave:
        # the first wins, later ones are "already present" or KeyConflict, as
        # for any second put (one PutStart request never names a key twice).
        waves: list[list[int]] = []
        seen: dict[str, int] = {}
        for i in todo:
            w = seen[keys[i]] = seen.get(keys[i], -1) + 1
            if w == len(waves):
                waves.append([])
            waves[w].append(i)
        for wave in waves:
            deadline = time.monotonic() + self.put_wait_s
            backoff = 0.005
            while wave:
                retry = self._round(keys, views, checksums, parents, wave, replicas, results,
                                    time.monotonic() < deadline)
                if not retry:
                    break
                time.sleep(backoff)
                backoff = min(backoff * 2, 0.2)
                wave = retry
        return results

    def _round(self, keys, views, checksums, parents, todo: list[int], replica_num: int,
               results: list, may_wait: bool) -> list[int]:
        """One PutStart -> write (-> PutRevoke) round; returns indices to retry."""
        placements = self.start([keys[i] for i in todo], [len(views[i]) for i in todo],
                                replica_num, [checksums[i] for i in todo])
        retry: list[int] = []
        by_node: dict[NodeId, list[tuple[int, NodeAddress]]] = defaultdict(list)
        started: list[tuple[int, ObjectId]] = []
        for i, p in zip(todo, placements):
            if isinstance(p, PutInProgress) and may_wait:
                retry.append(i)
            elif isinstance(p, KVStoreError):
                results[i] = p
            elif p.already_present:
                results[i] = False
            else:
                started.append((i, p.object_id))
                for t in p.targets:
                    by_node[t.node_id].append((i, t))
        object_ids = dict(started)
        written: dict[int, list[NodeAddress]] = defaultdict(list)
        errors: dict[int, KVStoreError] = {}
        for node_id, lst in by_node.items():
            items = [WriteItem(keys[i], object_ids[i], views[i], checksums[i], parents[i])
                     for i, _ in lst]
            try:
                outcome = self.connections.transport(lst[0][1]).write_many(items)
            except Unavailable as err:
                self.connections.drop(node_id)
                self.connections.node_failed(lst[0][1], keys[lst[0][0]], err)
                outcome = [err] * len(items)
            for (i, node), err in zip(lst, outcome):
                if err is None:
                    written[i].append(node)
                else:
                    errors.setdefault(i, err)
        wanted: dict[int, int] = defaultdict(int)
        for lst in by_node.values():
            for i, _ in lst:
                wanted[i] += 1
        self.stored([Written(keys[i], object_ids[i], len(views[i]), checksums[i],
                             tuple(written[i])) for i, _ in started if written[i]])
        for i, _ in started:
            results[i] = True if written[i] else errors.get(i) or Unavailable(
                "no target node accepted the value", key=keys[i])
        self.revoke([(keys[i], object_ids[i]) for i, _ in started if len(written[i]) < wanted[i]])
        return retry

    # ---- the master's side of a put ----
    def start(self, keys: Sequence[str], sizes_bytes: Sequence[int], replica_num: int,
              checksums: Sequence[int] | None = None) -> list[Placement | KVStoreError]:
        """PutStart of distinct ``str`` keys.

        Args:
            checksums: per key the value's xxh3-64; None: the values are written
                part by part, and the nodes' STORED reports bring the checksum
                (``checksum_at_end``).

        Returns:
            Per key its placement or the error (KeyConflict, PutInProgress, NoSpace, ...).

        Raises:
            InvalidArgument: ``replica_num`` outside [1, MAX_REPLICAS].
        """
        if not 1 <= replica_num <= MAX_REPLICAS:
            raise InvalidArgument(f"replica_num must be in [1, {MAX_REPLICAS}], got {replica_num}")
        at = {k: j for j, k in enumerate(keys)}
        config = pb.PutConfig(replica_num=replica_num)

        def call(addresses: tuple[str, ...], ks: list[str]) -> list[Placement | KVStoreError]:
            if checksums is None:
                items = [pb.PutStartItem(key=k, size_bytes=sizes_bytes[at[k]],
                                         checksum_at_end=True) for k in ks]
            else:
                items = [pb.PutStartItem(key=k, size_bytes=sizes_bytes[at[k]],
                                         checksum=checksums[at[k]]) for k in ks]
            resp = self._control.call(addresses, "PutStart",
                                      pb.PutStartRequest(items=items, config=config))
            return [error_for_code(r.status.code, r.status.message, key=k,
                                   redirect=r.status.redirect) if r.status.code != pb.OK else
                    Placement(ObjectId(r.object_id),
                              tuple(wire.node_address(t) for t in r.targets), r.already_present)
                    for k, r in zip(ks, resp.results)]
        return self._control.routed(keys, call)

    def stored(self, items: Sequence[Written]) -> None:
        """Values some targets acknowledged: visible now; their metadata goes into the
        cache (replicas on the nodes that acknowledged, in DRAM)."""
        for it in items:
            self._meta.put(ObjectMeta(it.key, it.size_bytes, it.checksum, it.object_id,
                                      tuple(Replica(n, TierKind.DRAM) for n in it.nodes)))

    def revoke(self, items: Sequence[tuple[str, int]]) -> None:
        """PutRevoke of ``(key, object_id)`` items: some or all of their targets failed.

        A shard that cannot be told revokes its pending puts and releases silent
        targets at their deadline (30 s by default) instead.
        """
        if not items:
            return
        oids = dict(items)

        def call(addresses: tuple[str, ...], ks: list[str]) -> list[KVStoreError | None]:
            req = pb.PutRevokeRequest(items=[pb.PutRevokeItem(key=k, object_id=oids[k])
                                             for k in ks])
            resp = self._control.call(addresses, "PutRevoke", req)
            return [None if st.code == pb.OK else
                    error_for_code(st.code, st.message, key=k, redirect=st.redirect)
                    for k, st in zip(ks, resp.statuses)]

        self._control.routed(list(oids), call)
