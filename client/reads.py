"""The sync SDK's read path: the blocking driver of the client core's read plan.

A read resolves each key's metadata (the metadata cache first, then one
Lookup per shard for the misses), then reads each object by its
:class:`~kvstore.client.core.reads.ReadPlan` (the replica order, the wait per
replica, the fallback, the stale-cache retry: all of it decided there), the
reads of one round batched per node.

The single-key fast path (:meth:`Reads.get_into` on a cached key) skips
the master and the batch machinery: one read of the first replica.

Thread safety: a Reads may be shared by threads (the cache takes its lock;
the transports are per thread).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

from kvstore.client.connections import Connections
from kvstore.client.control import Control
from kvstore.client.core.reads import ReadPlan, from_cache, read_order, stale
from kvstore.client.meta_cache import MetaCache
from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.transfer.base import ReadItem
from kvstore.transfer.buffers import writable_view
from kvstore.types import NodeAddress, NodeId, ObjectMeta, Replica, TransportKind

#: Where a read puts index ``i``'s value: a view, or a KVStoreError raised (a bad destination).
ViewFor = Callable[[int, ObjectMeta], memoryview]


class Reads:
    """Reads of values, by key, into new buffers or the caller's.

    Args:
        control: the client's control plane (Lookup).
        connections: the data connections reads go through (they report failed nodes).
        meta: the metadata cache, shared with the put protocol.
        verify_checksum: check each value read against its checksum; None:
            only what crossed a socket (TCP).
    """

    def __init__(self, control: Control, connections: Connections, meta: MetaCache,
                 verify_checksum: bool | None):
        self._control = control
        self._connections = connections
        self._meta = meta
        self._suspect = connections.suspect_until
        self._host_id = connections.host_id
        self.verify_checksum = verify_checksum

    # ---- metadata ----
    def lookup(self, keys: Sequence[str]) -> list[ObjectMeta | KVStoreError]:
        """Metadata per key from the master (counts an access), or the error.

        What it finds goes into the metadata cache.
        """
        out = self._control.lookup(keys)
        self._meta.put_found(out)
        return out

    def _resolve(self, keys: Sequence[str]) -> tuple[list, list[bool]]:
        """Metadata per key from the cache, asking the master only for misses.

        Returns:
            (metas or errors, from_cache flags), in input order.
        """
        metas, cached, miss = from_cache(self._meta, keys)
        if miss:
            for i, r in zip(miss, self.lookup([keys[i] for i in miss])):
                metas[i] = r
        return metas, cached

    def read_order(self, meta: ObjectMeta) -> list[Replica]:
        """Replicas in the order reads try them: nodes that failed lately last,
        then same host first, then by tier speed."""
        return read_order(meta, self._suspect, self._host_id)

    # ---- reads ----
    def get_many(self, keys: Sequence[str]) -> list[bytearray | KVStoreError]:
        """Values (new bytearrays) or errors per key, in input order."""
        bufs: list[bytearray | None] = [None] * len(keys)

        def view_for(i: int, meta: ObjectMeta) -> memoryview:
            bufs[i] = bytearray(meta.size_bytes)
            return memoryview(bufs[i])

        _metas, res = self._read_resolved(keys, view_for)
        return [r if isinstance(r, KVStoreError) else bufs[i] for i, r in enumerate(res)]

    def get_into(self, key: str, view: memoryview) -> int:
        """Read ``key`` into ``view``; the fast path when its metadata is cached.

        Returns:
            The value's size in bytes.

        Raises:
            NotFound, InvalidArgument (``view`` too small), ChecksumMismatch, Unavailable.
        """
        meta = self._meta.get(key) if type(key) is str else None
        if meta is not None:
            size = self._read_cached(meta, view)
            if size is not None:
                return size
        (res,) = self.get_many_into([key], [view])
        if isinstance(res, KVStoreError):
            raise res
        return res

    def get_known(self, key: str, view: memoryview) -> int | None:
        """The fastest get: a cached key whose replica this thread read before
        through this host's shared memory, copied from the location learnt then
        and checked in the node's read slots (no master, no round trip, no wait:
        :meth:`~kvstore.transfer.shm.ShmTransport.read_known`).

        Returns:
            The value's size in bytes, or None: not that case, and nothing is
            known about ``view`` (read it with :meth:`get_into`).

        Raises:
            Unavailable: the client is closed.
        """
        meta = self._meta.get(key) if type(key) is str else None
        if meta is None or not meta.replicas:
            return None
        reps = meta.replicas
        node = (reps[0].node if len(reps) == 1 and not self._suspect
                else self.read_order(meta)[0].node)
        if node.node_id in self._suspect:          # a read through transfer() clears that
            return None
        tr = self._connections.shm_transport(node.node_id)
        if tr is None or not tr.read_known(ReadItem(key, meta.object_id, meta.size_bytes,
                                                    meta.checksum, view),
                                           bool(self.verify_checksum)):
            return None
        return meta.size_bytes

    def get_many_into(self, keys: Sequence[str], dests: Sequence[Any]) -> list[int | KVStoreError]:
        """Read each key into its destination; per key the size in bytes or the error."""
        if len(keys) != len(dests):
            raise InvalidArgument(f"{len(keys)} keys but {len(dests)} destinations")
        metas, res = self._read_resolved(keys, lambda i, meta: writable_view(dests[i]))
        return [r if isinstance(r, KVStoreError) else metas[i].size_bytes
                for i, r in enumerate(res)]

    def _read_cached(self, meta: ObjectMeta, view: memoryview) -> int | None:
        """The single-key fast path: one read of the first replica named by a
        cached entry. Returns the size, or None when anything goes wrong (the
        entry is dropped and the caller takes the general path, which looks the
        key up again and falls back across replicas).

        Raises:
            InvalidArgument: ``view`` is too small (the same everywhere).
        """
        reps = meta.replicas
        if not reps:
            return None
        node = (reps[0].node if len(reps) == 1 and not self._suspect
                else self.read_order(meta)[0].node)
        item = ReadItem(meta.key, meta.object_id, meta.size_bytes, meta.checksum, view)
        err = self._read_node(node, [item], len(reps) > 1)[0]
        if err is None:
            return meta.size_bytes
        if isinstance(err, InvalidArgument):
            raise err
        self._meta.drop(meta.key)
        return None

    def _read_resolved(self, keys: Sequence[str], view_for: ViewFor) -> tuple[list, list]:
        """Resolve metadata, then read each object into ``view_for(i, meta)``.

        A read through a cached entry that misses is tried once more with fresh
        metadata from the master (the entry is dropped).

        Returns:
            (metas or errors, per-index read error or None).
        """
        metas, cached = self._resolve(keys)
        idx = list(range(len(keys)))
        res: list = [None] * len(keys)
        for attempt in range(2):
            views: list[memoryview | None] = []
            for i in idx:
                views.append(None)
                if isinstance(metas[i], ObjectMeta):
                    try:
                        views[-1] = view_for(i, metas[i])
                    except KVStoreError as err:
                        metas[i] = err
            for i, r in zip(idx, self._read([metas[i] for i in idx], views)):
                res[i] = r
            idx = [idx[j] for j in stale([cached[i] for i in idx], [res[i] for i in idx])]
            if attempt or not idx:
                break
            for i in idx:
                self._meta.drop(keys[i])
                cached[i] = False
            for i, m in zip(idx, self.lookup([keys[i] for i in idx])):
                metas[i] = m
        return metas, res

    def _read(self, metas: list, views: list[memoryview | None]) -> list[KVStoreError | None]:
        """Read found objects into views, each by its plan; one round per replica rank,
        the reads of a round batched per node."""
        plans = [ReadPlan(m, () if isinstance(m, KVStoreError) else self.read_order(m))
                 for m in metas]
        todo = [i for i, p in enumerate(plans) if not p.done]
        while todo:
            by_node: dict[NodeId, list[int]] = defaultdict(list)
            for i in todo:
                by_node[plans[i].node.node_id].append(i)
            for idxs in by_node.values():
                items = [ReadItem(metas[i].key, metas[i].object_id, metas[i].size_bytes,
                                  metas[i].checksum, views[i]) for i in idxs]
                res = self._read_node(plans[idxs[0]].node, items,
                                      all(plans[i].has_fallback for i in idxs))
                for i, err in zip(idxs, res):
                    plans[i].answered(err)
            todo = [i for i in todo if not plans[i].done]
        for i, p in enumerate(plans):
            if p.stale_replicas():
                self._meta.drop_replicas(metas[i].key, metas[i].object_id, p.stale_replicas())
        return [p.error for p in plans]

    def _read_node(self, node: NodeAddress, items: list[ReadItem],
                   fallback: bool) -> list[KVStoreError | None]:
        """Read ``items`` from ``node``, waiting ``fallback_after_s`` when each has
        another replica to try (``fallback``), else ``read_timeout_s``; either cut to
        what is left of the call's deadline. A node that fails is suspect and
        reported (not when the call's deadline cut the wait); one that answers is not."""
        c = self._connections

        def read(tr) -> list[KVStoreError | None]:
            verify = (tr.kind is TransportKind.TCP if self.verify_checksum is None
                      else self.verify_checksum)
            return tr.read_many(items, verify)
        return c.transfer(node, items, c.fallback_after_s if fallback else c.read_timeout_s,
                          "read", read)
