"""The put protocol: one client round trip per put, the one protocol of every put.

Whole values (:meth:`PutProtocol.put_many`, behind ``put`` / ``batch_put`` /
``put_tensor``) and values written part by part
(:class:`kvstore.client.parts.PartsWriter`, through :meth:`PutProtocol.place`
and :meth:`PutProtocol.stored`) go straight to nodes picked from a placement grant
(:mod:`kvstore.client.placement`; the protocol and its ordering argument
are in :mod:`kvstore.master.grants`)::

    place         an object id and ``replica_num`` distinct target nodes from the
                  shard's grant: no master call (one in the background now and then)
    write         each target node stores the bytes, verifies the checksum,
                  reports them STORED to its master shard and acknowledges once
                  the shard applied the report, which decides the put there:
                  visible (OK), ALREADY_PRESENT (equal bytes stored: the put
                  answers False), KEY_CONFLICT
    retry         a target that could not take the bytes (down, fenced, full) is
                  replaced by the next node of the grant, for a few rounds; an id
                  the shard does not know (a new leader) gets a new grant

Every decision of a put (the targets, what its answers mean, what it does
next) is the client core's (:mod:`kvstore.client.core.placement`,
:mod:`kvstore.client.core.puts`); this module performs them with the sync
SDK's transports, the writes of a round batched per node.

Ordering: a target acknowledges a write only after its master shard made the
object visible, and a put returns only after every target answered, so a
returned put is visible to every reader (read-your-writes for everyone); no
master call sits between the bytes and the acknowledgement. A put that some
targets acknowledged succeeds (the shard repairs the missing replicas); one
that none acknowledged left nothing behind (a node drops what its shard
refused, and never reports what it did not receive whole).

A key repeated in one batch is put in waves, one occurrence per wave. No put
waits for another: the shard holds nothing while a put's bytes move, and
decides between two writers of a key when their STORED reports arrive. A
value this client stored goes into its metadata cache.

Deadline: a put (a batch put: all its waves) is one SDK call, with one deadline
(:mod:`kvstore.client.deadline`): its master calls, its waits on nodes, its
rounds and its waits for the shard to stop granting a node that failed it all
end by it. A grant the shard refuses, or that its masters cannot be asked for
(after the one retry rule of master calls,
:class:`kvstore.client.core.failover.MasterRetry`), fails the put at once.

Thread safety: a PutProtocol may be shared by threads (its writes go through
the calling thread's transports).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

from kvstore.client.connections import Connections
from kvstore.client.control import Control
from kvstore.client.core.puts import WAIT_S, PutAttempt, Step, replica_count, waves
from kvstore.client.deadline import of_call
from kvstore.client.meta_cache import MetaCache
from kvstore.client.placement import Placements
from kvstore.errors import InvalidArgument, KVStoreError, WrongShard
from kvstore.keys import validate_key
from kvstore.transfer.base import WriteItem
from kvstore.transfer.buffers import readable_view
from kvstore.types import NodeAddress, NodeId, ObjectId, ObjectKey


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
        prefer_local: a value's first replica goes to a node on this host when
            it has room (shared memory).

    Attributes:
        connections: as given (a :class:`PartsWriter` reserves through them).
    """

    def __init__(self, control: Control, connections: Connections, meta: MetaCache, *,
                 replica_num: int, prefer_local: bool = True):
        self._control = control
        self.connections = connections
        self._placements = Placements(control, connections.host_id, prefer_local)
        self._meta = meta
        self.replica_num = replica_num

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
        # None until a transport computes it: the shared-memory one while copying.
        checksums: list[int | None] = [None] * n
        todo = []
        for i, (k, v) in enumerate(zip(keys, values)):
            try:
                validate_key(k)
                views[i] = readable_view(v)
                todo.append(i)
            except KVStoreError as err:
                results[i] = err
        replicas = replica_count(replica_num, self.replica_num)
        dl = of_call(self._control.timeout_s, self._control.failover_wait_s)
        for wave in waves(keys, todo):
            attempts = {i: PutAttempt(keys[i]) for i in wave}
            while wave:
                wave = self._round(keys, views, checksums, parents, wave, replicas, attempts, dl)
            for i, a in attempts.items():
                results[i] = a.result
        return results

    def _round(self, keys, views, checksums, parents, todo: list[int], replica_num: int,
               attempts: dict[int, PutAttempt], dl) -> list[int]:
        """One place -> write round, each value's next step by its
        :class:`~kvstore.client.core.puts.PutAttempt`; returns the indices to place again."""
        steps: dict[int, Step] = {}
        by_node: dict[NodeId, list[tuple[int, NodeAddress]]] = defaultdict(list)
        oids: dict[int, ObjectId] = {}
        for i in todo:
            try:
                oids[i], targets = self._placements.place(
                    self._control.shard_for_key(keys[i]).addresses, keys[i], len(views[i]),
                    replica_num, attempts[i].exclude)
            except KVStoreError as err:
                steps[i] = attempts[i].place_failed(err, dl)
                continue
            for t in targets:
                by_node[t.node_id].append((i, t))
        written: dict[int, list[NodeAddress]] = defaultdict(list)
        outcomes: dict[int, list[tuple[NodeAddress, KVStoreError]]] = defaultdict(list)
        for node_id, lst in by_node.items():
            items = [WriteItem(keys[i], oids[i], views[i], checksums[i], parents[i], replica_num)
                     for i, _ in lst]
            outcome = self._write(lst[0][1], items)
            for (i, node), it, err in zip(lst, items, outcome):
                if checksums[i] is None:
                    checksums[i] = it.checksum     # computed by the transport (or still None)
                if err is None:
                    written[i].append(node)
                else:
                    outcomes[i].append((node, err))
        self.stored([Written(keys[i], oids[i], len(views[i]), checksums[i], tuple(written[i]))
                     for i in oids if written[i]])
        for i in oids:
            steps[i] = attempts[i].answered(written[i], outcomes[i], dl)
        return self._perform(keys, steps, attempts, dl)

    def _perform(self, keys, steps: dict[int, Step], attempts: dict[int, PutAttempt],
                 dl) -> list[int]:
        """Do what the values' steps ask (refresh the map, forget grants, wait) and
        return the indices to place again. A WAIT is done only when no value can go
        on at once: then every waiting value goes again after one pause."""
        if Step.REFRESH_MAP in steps.values():
            self._control.refresh_shard_map()
        again = [i for i, s in steps.items() if s not in (Step.DONE, Step.WAIT)]
        waiting = [i for i, s in steps.items() if s is Step.WAIT]
        if waiting and not again:
            time.sleep(min(WAIT_S, max(0.0, dl.left_s())))
            for i in waiting:
                attempts[i].waited()
        forget = [i for i, s in steps.items() if s in (Step.REGRANT, Step.REFRESH_MAP)]
        if waiting and not again:
            forget += waiting
        for shard in {self._control.shard_for_key(keys[i]).addresses for i in forget}:
            self._placements.invalidate(shard)
        return again + waiting

    def _write(self, node: NodeAddress, items: list[WriteItem]) -> list[KVStoreError | None]:
        """Write ``items`` to ``node``, waiting for its answers ``read_timeout_s`` at most,
        cut to what is left of the call's deadline; per item None or the error. A node
        that fails is suspect and reported (not when the deadline cut the wait)."""
        c = self.connections
        return c.transfer(node, items, c.read_timeout_s, "written",
                          lambda tr: tr.write_many(items))

    # ---- one value at a time (PartsWriter) ----
    def place(self, key: str, size_bytes: int, replica_num: int,
              exclude: frozenset[NodeId] = frozenset()) -> tuple[ObjectId, list[NodeAddress]]:
        """An object id and up to ``replica_num`` target nodes for one value, from its
        shard's placement grant (no master call while the grant is fresh); a stale
        shard map is refreshed once.

        Raises:
            TooLarge: no granted node could ever hold ``size_bytes``.
            Unavailable: no node left that ``exclude`` does not name, or no grant.
            WrongShard: the key's shard moved, even after a refresh of the map.
        """
        addresses = self._control.shard_for_key(key).addresses
        try:
            return self._placements.place(addresses, key, size_bytes, replica_num, exclude)
        except WrongShard:
            self._control.refresh_shard_map()
            self._placements.invalidate(addresses)
        return self._placements.place(self._control.shard_for_key(key).addresses, key,
                                      size_bytes, replica_num, exclude)

    def stored(self, items: Sequence[Written]) -> None:
        """Values some targets acknowledged: visible now; their metadata goes into the
        cache (replicas on the nodes that acknowledged, in DRAM)."""
        for it in items:
            self._meta.put_written(it.key, it.size_bytes, it.checksum, it.object_id, it.nodes)
