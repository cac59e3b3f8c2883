"""The read plan: which replica a read tries, how long it waits, what a failure means.

An object's replicas are tried one at a time in :func:`read_order`: nodes that
failed lately (suspects) last, then a node on this host first, then the
fastest tier. A read that has another replica to try waits for one only
``fallback_after_s`` (:func:`kvstore.client.suspects.fallback_after_s`), the
last one ``timeout_s``; both cut to what is left of the call's deadline::

    replica 1 --fails/late--> replica 2 --fails/late--> ... --> Unavailable (or the
       |                         |                             last error)
       +-- answers: done; the replicas that failed before leave the cached entry

A bad destination (InvalidArgument) fails the same everywhere: no fallback.
A node that fails a transfer, when the call's deadline is not what cut it,
is suspect and reported to the key's shard (:func:`report_node`). A read made
through a cached entry that fails is tried once more with fresh metadata
(:func:`stale`).

Thread safety: a ReadPlan belongs to one read.
"""

from __future__ import annotations

import time
from typing import Mapping, Sequence

from kvstore.client.deadline import Deadline
from kvstore.client.meta_cache import MetaCache
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable
from kvstore.types import TIER_READ_RANK, NodeAddress, NodeId, ObjectMeta, Replica


def read_order(meta: ObjectMeta, suspect_until: Mapping[NodeId, float], host_id: str | None,
               now: float | None = None) -> list[Replica]:
    """``meta``'s replicas in the order reads try them: suspects last, then a node on
    host ``host_id`` first, then by tier speed (DRAM, GPU, SSD)."""
    now = time.monotonic() if now is None else now
    return sorted(meta.replicas, key=lambda r: (
        suspect_until.get(r.node.node_id, 0.0) > now, r.node.host_id != host_id,
        TIER_READ_RANK.get(r.tier, len(TIER_READ_RANK))))


def report_node(err: KVStoreError, deadline: Deadline) -> bool:
    """Whether a transfer that failed with ``err`` makes its node suspect and is
    reported to the master: an Unavailable, when the call still had time (a wait the
    call's deadline cut is the call's doing, not the node's)."""
    return isinstance(err, Unavailable) and deadline.left_s() > 0


def stale(cached: Sequence[bool], results: Sequence) -> list[int]:
    """The indices read through a cached entry that failed (removed, evicted,
    replaced): read once more with fresh metadata. A bad destination is not stale."""
    return [i for i, r in enumerate(results) if cached[i] and isinstance(r, KVStoreError)
            and not isinstance(r, InvalidArgument)]


class ReadPlan:
    """One object's read across its replicas.

    Args:
        meta: the object (or its lookup error: the plan is done at once).
        order: its replicas in read order (:func:`read_order`).
        dest_bytes: the size of the caller's destination, or None (a new buffer).

    Attributes:
        error: the read's error so far (None: none yet, or read).
        done: nothing more to try: read (error None) or failed (error set).
    """

    __slots__ = ("meta", "order", "at", "error", "done", "failed")

    def __init__(self, meta: ObjectMeta | KVStoreError, order: Sequence[Replica] = (),
                 dest_bytes: int | None = None):
        self.meta = meta
        self.order = list(order)
        self.at = 0
        self.failed: set[NodeId] = set()
        self.error: KVStoreError | None = meta if isinstance(meta, KVStoreError) else None
        if self.error is None and dest_bytes is not None and dest_bytes < meta.size_bytes:
            self.error = InvalidArgument(f"destination of {dest_bytes} B for a value of "
                                         f"{meta.size_bytes} B", key=meta.key)
        self.done = self.error is not None
        if not self.done and not self.order:
            self._exhausted()

    @property
    def node(self) -> NodeAddress:
        """The node the next attempt reads from (while not :attr:`done`)."""
        return self.order[self.at].node

    @property
    def has_fallback(self) -> bool:
        """Whether another replica is left after the current one."""
        return self.at + 1 < len(self.order)

    def wait_s(self, deadline: Deadline, fallback_after_s: float, timeout_s: float) -> float:
        """How long the next attempt waits for its node (0.0: the deadline passed;
        then the plan is done with Unavailable)."""
        wait_s = deadline.bound(fallback_after_s if self.has_fallback else timeout_s)
        if wait_s <= 0:
            self.error = self.error or Unavailable(
                "the call's deadline passed before a replica answered", key=self.meta.key)
            self.done = True
        return wait_s

    def answered(self, err: KVStoreError | None) -> None:
        """The current replica read the value (None) or failed with ``err``."""
        self.error = err
        if err is None or isinstance(err, InvalidArgument):
            self.done = True
            return
        self.failed.add(self.node.node_id)
        self.at += 1
        if self.at >= len(self.order):
            self._exhausted()

    def stale_replicas(self) -> set[NodeId]:
        """The replicas to drop from the cached entry: those that failed before
        another answered (later reads do not wait for them again)."""
        return self.failed if self.done and self.error is None else set()

    def _exhausted(self) -> None:
        self.done = True
        self.error = self.error or Unavailable("no replica could be read", key=self.meta.key)


def from_cache(cache: MetaCache, keys: Sequence[str]) -> tuple[list, list[bool], list[int]]:
    """Per key its cached metadata or None, whether it came from the cache, and the
    indices of the misses (the driver looks them up, one Lookup per shard)."""
    metas: list = [cache.get(k) if isinstance(k, str) else None for k in keys]
    return metas, [m is not None for m in metas], [i for i, m in enumerate(metas) if m is None]
