"""Client-side cache of object metadata (size, checksum, object_id, replicas).

Objects are immutable and every read names the exact version it wants
(``object_id``): a node answers NotFound for any other version. So a stale
entry can never yield wrong bytes -- at worst the read misses, the entry is
dropped, and the client asks the master again. A value removed by *another*
client is not readable through this client's entry either once the remove
returned: the remover's SDK has the nodes drop that version first. What the
cache trades away is the narrow case of a node the remover could not reach:
it drops the value with its next heartbeat reply (<= 500 ms by default), or,
cut off from its master too, stops serving before its master may declare it
dead (:mod:`kvstore.store.lease`). Reads skip the master round trip, which
dominates small and medium gets (``kvstore bench``). A replica that failed a
read another replica then answered is dropped from the entry
(:meth:`MetaCache.drop_replicas`), so readers do not keep going back to a node
they cannot reach while its master still lists it.

Thread safety: all methods take the cache's lock.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict

from kvstore.types import ObjectMeta, Replica, TierKind


class MetaCache:
    """A bounded LRU map key -> :class:`kvstore.types.ObjectMeta`.

    Args:
        max_entries: capacity; 0 disables the cache.
    """

    def __init__(self, max_entries: int = 65536):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, ObjectMeta] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> ObjectMeta | None:
        with self._lock:
            meta = self._entries.get(key)
            if meta is not None:
                self._entries.move_to_end(key)
            return meta

    def put(self, meta: ObjectMeta) -> None:
        if not self.max_entries:
            return
        with self._lock:
            self._entries[meta.key] = meta
            self._entries.move_to_end(meta.key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def put_found(self, results) -> None:
        """Every :class:`ObjectMeta` among a lookup's per-key ``results`` (errors skipped)."""
        for r in results:
            if isinstance(r, ObjectMeta):
                self.put(r)

    def put_written(self, key: str, size_bytes: int, checksum: int, object_id: int,
                    nodes) -> None:
        """A value just written: its replicas on the ``nodes`` (:class:`NodeAddress`)
        that acknowledged it, in DRAM."""
        self.put(ObjectMeta(key, size_bytes, checksum, object_id,
                            tuple(Replica(n, TierKind.DRAM) for n in nodes)))

    def drop(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def drop_replicas(self, key: str, object_id: int, node_ids) -> None:
        """Forget the replicas on ``node_ids`` of ``key``'s entry (they failed a read
        another replica answered), if it still names version ``object_id``; an entry
        left without replicas goes."""
        with self._lock:
            meta = self._entries.get(key)
            if meta is None or meta.object_id != object_id:
                return
            keep = tuple(r for r in meta.replicas if r.node.node_id not in node_ids)
            if keep:
                self._entries[key] = dataclasses.replace(meta, replicas=keep)
            else:
                del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
