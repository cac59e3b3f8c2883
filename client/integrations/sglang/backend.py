"""KVStoreHiCacheStorage: SGLang's HiCache storage (its L3 tier) backed by kvstore.

SGLang loads it out of tree::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.client.integrations.sglang.backend",
        "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
        "master": "HOST:PORT"}'

(optional keys: ``tenant``, ``salt``, ``revision`` (more of the namespace),
``replica_num``, ``timeout_s``; ``master`` defaults to ``$KVSTORE_MASTER``,
the token to ``$KVSTORE_TOKEN``). SGLang's ``StorageBackendFactory`` calls
``KVStoreHiCacheStorage(storage_config, kwargs)``, then
``register_mem_pool_host(pool)``; ``interface_v1`` makes it use the zero-copy
``batch_get_v1`` / ``batch_set_v1``. This module imports SGLang and torch;
``kvstore.client`` never imports it. Keys: :mod:`.keys`; the pool's page
views: :mod:`.pool`.

Each page is one kvstore object per part (MHA: K and V, MLA: one), read with
one ``batch_get_into`` straight into the host pool and written with one
``batch_put`` straight from it, after one ``batch_exists`` that skips the
parts already stored (SGLang backs up every page it computed; most are
there already in a shared store).

Tensor parallelism: each rank runs its own backend with its own keys (the
rank is in the namespace) and answers for its own pages only; SGLang itself
reduces the ranks' ``batch_exists`` counts with an all-reduce MIN
(``HiCacheController._sync_prefetch_hit_query``) and loads only that prefix
on every rank. An MLA model's KV is the same on every rank: its keys carry
no rank, only SGLang's storage writer (``is_storage_writer``, rank 0 without
decode context parallelism) writes, the other ranks' ``batch_set_v1``
report success without writing, and every rank reads the one copy.

Failures are never raised into SGLang: a store that is down, a node that
died, a page that is gone are misses (``False`` per page, a count of 0);
the first of each kind is logged and every one counted in :meth:`stats`.
The client is made at the first call (SGLang starts while the store is
down), and every call ends within ``timeout_s``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvstore.client.client import KVClient
from kvstore.client.integrations.sglang.keys import (FLAT_PART, StorageIdentity, leading_pages,
                                                     page_keys)
from kvstore.client.integrations.sglang.pool import PoolPages
from kvstore.errors import KeyConflict, KVStoreError, NotFound, Unavailable

# SGLang shows INFO of loggers under its own name.
log = logging.getLogger("sglang.kvstore_hicache")

_COUNTERS = ("pages_read", "pages_missed", "pages_written", "pages_present", "parts_conflict",
             "pages_not_written", "bytes_read", "bytes_written", "exists_calls", "errors")


def identity_from_config(cfg: HiCacheStorageConfig, extra: dict) -> StorageIdentity:
    """The key identity of one rank, before its host pool is registered."""
    return StorageIdentity(model=cfg.model_name or "", page_size=0, tp_rank=cfg.tp_rank,
                           tp_size=cfg.tp_size, is_mla=bool(cfg.is_mla_model),
                           pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
                           cp_rank=getattr(cfg, "attn_cp_rank", 0),
                           cp_size=getattr(cfg, "attn_cp_size", 1),
                           revision=str(extra.get("revision", "")),
                           tenant=str(extra.get("tenant", "")), salt=str(extra.get("salt", "")))


@dataclass
class _StorageMetrics:
    """SGLang's StorageMetrics fields, for where its module cannot be imported."""

    prefetch_pgs: list = field(default_factory=list)
    backup_pgs: list = field(default_factory=list)
    prefetch_bandwidth: list = field(default_factory=list)
    backup_bandwidth: list = field(default_factory=list)


class KVStoreHiCacheStorage(HiCacheStorage):
    """SGLang HiCache storage over a kvstore cluster (see the module doc).

    Args:
        storage_config: SGLang's ``HiCacheStorageConfig`` (ranks, MLA, model
            name, ``extra_config``: the JSON of
            ``--hicache-storage-backend-extra-config``).
        kwargs: the factory's extra arguments (unused).

    Raises:
        ValueError: no master address, or decode context parallelism.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        extra = dict(storage_config.extra_config or {})
        master = extra.get("master") or os.environ.get("KVSTORE_MASTER")
        if not master:
            raise ValueError("kvstore HiCache backend: no master address; put \"master\": "
                             "\"HOST:PORT\" in --hicache-storage-backend-extra-config "
                             "or set KVSTORE_MASTER")
        if getattr(storage_config, "dcp_size", 1) > 1:
            # DCP ranks hold slices of a widened logical page: other host indices,
            # other keys (Mooncake's backend has a layout of its own for them).
            raise ValueError("kvstore HiCache backend: decode context parallelism "
                             "(dcp_size > 1) is not supported")
        self.storage_config = storage_config
        self.identity = identity_from_config(storage_config, extra)
        writer = getattr(storage_config, "is_storage_writer", None)
        self.is_writer = bool(writer if writer is not None
                              else not storage_config.is_mla_model or storage_config.tp_rank == 0)
        self.enable_storage_metrics = bool(storage_config.enable_storage_metrics)
        self._master = master
        self._timeout_s = float(extra.get("timeout_s", 5.0))
        self._replica_num = int(extra.get("replica_num", 1))
        self._token = extra.get("token")
        self._client: KVClient | None = None
        self._retry_at = 0.0
        self.pages: PoolPages | None = None
        self._lock = threading.Lock()            # the counters and metrics
        self._client_lock = threading.Lock()     # making the client (may take timeout_s)
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._logged: set[str] = set()
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [],
                                          "prefetch_bandwidth": [], "backup_bandwidth": []}

    # ---- registration ----
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Take SGLang's host pool: its geometry completes the namespace, its
        buffer is where pages are read into and written from.

        Raises:
            kvstore.client.integrations.sglang.pool.UnsupportedPool: a layout
                or buffer this backend cannot serve zero-copy (SGLang fails the attach).
        """
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        self.identity = replace(
            self.identity, page_size=int(pool.page_size),
            kv_dtype=str(getattr(pool, "dtype", "")).removeprefix("torch."),
            layout=str(getattr(pool, "layout", "")),
            num_layers=int(getattr(pool, "layer_num", 0)),
            num_kv_heads=int(getattr(pool, "head_num", 0) or 1),
            # MLA pools have no head_dim: their latent KV is kv_lora_rank + the rope part
            head_dim=int(getattr(pool, "head_dim", 0) or getattr(pool, "kv_lora_rank", 0)
                         + getattr(pool, "qk_rope_head_dim", 0)))
        self.pages = PoolPages(pool, len(self.identity.parts))
        log.info("kvstore HiCache backend: rank %d/%d%s, keys %s*", self.identity.tp_rank,
                 self.identity.tp_size, " (MLA)" if self.identity.is_mla else "",
                 self.identity.key_prefix())

    # ---- the zero-copy interface (interface_v1) ----
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        """Read each page's parts into the host pool at ``host_indices``.

        Returns:
            Per page: True if every part was read whole into the pool.
        """
        if not keys:
            return []
        views = self._views(keys, host_indices, "get")
        if views is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        try:
            res = self._store().batch_get_into(page_keys(self.identity, keys), views)
        except KVStoreError as e:
            self._failed("get", e)
            return [False] * len(keys)
        got = [isinstance(r, int) and r == len(v) for r, v in zip(res, views)]
        for r in res:
            if isinstance(r, KVStoreError) and not isinstance(r, NotFound):
                self._failed("get", r)
                break
        out = self._per_page(got)
        n_ok = sum(out)
        self._count(pages_read=n_ok, pages_missed=len(out) - n_ok,
                    bytes_read=sum(len(v) for v, ok in zip(views, got) if ok))
        self._metric("prefetch", len(keys), sum(len(v) for v in views), t0)
        return out

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor,
                     extra_info: Any = None) -> List[bool]:
        """Write each page's parts from the host pool at ``host_indices`` (those
        not stored yet). An MLA rank that is not the storage writer writes nothing.

        Returns:
            Per page: True if every part is stored (written now or before).
        """
        if not keys:
            return []
        if not self.is_writer:
            return [True] * len(keys)
        views = self._views(keys, host_indices, "set")
        if views is None:
            return [False] * len(keys)
        t0 = time.perf_counter()
        okeys = page_keys(self.identity, keys)
        try:
            present = self._store().batch_exists(okeys)
        except KVStoreError as e:
            self._failed("set", e)
            return [False] * len(keys)
        todo = [i for i, p in enumerate(present) if not p]
        stored = list(present)
        if todo:
            parents = self._parents(okeys, extra_info)
            try:
                res = self._store().batch_put([okeys[i] for i in todo],
                                              [views[i] for i in todo],
                                              parents=[parents[i] for i in todo])
            except KVStoreError as e:
                res = [e] * len(todo)          # counted once, below
            conflicts, failed = 0, None
            for i, r in zip(todo, res):
                # Another writer stored other bytes for this prefix (kernels are not
                # bit-exact across runs): that page is there, as usable as ours.
                conflicts += isinstance(r, KeyConflict)
                stored[i] = r is None or isinstance(r, KeyConflict)
                if isinstance(r, KVStoreError) and not isinstance(r, KeyConflict):
                    failed = failed or r
            self._count(parts_conflict=conflicts)
            if failed is not None:
                self._failed("set", failed)
        out = self._per_page(stored)
        already = self._per_page(present)
        self._count(pages_present=sum(already),
                    pages_written=sum(o and not a for o, a in zip(out, already)),
                    pages_not_written=len(out) - sum(out),
                    bytes_written=sum(len(views[i]) for i in todo if stored[i]))
        self._metric("backup", len(todo) // len(self.identity.parts),
                     sum(len(views[i]) for i in todo), t0)
        return out

    # ---- existence ----
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """How many pages from the start of ``keys`` this rank can load (every
        part stored); SGLang takes the MIN over the ranks."""
        if not keys:
            return 0
        self._count(exists_calls=1)
        try:
            present = self._store().batch_exists(page_keys(self.identity, keys))
        except KVStoreError as e:
            self._failed("exists", e)
            return 0
        return leading_pages(present, len(self.identity.parts))

    def exists(self, key: str) -> bool:
        """True iff every part of page ``key`` is stored."""
        return self.batch_exists([key]) == 1

    # ---- the legacy interface: a flat page per key, copied by SGLang ----
    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> torch.Tensor | None:
        """Read flat page ``key`` into ``target_location`` (a CPU tensor of its
        size), or as a new uint8 tensor; None when it cannot be read."""
        (out,) = self.batch_get([key], [target_location] if target_location is not None else None)
        return out

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[torch.Tensor | None]:
        """:meth:`get` for each key (one batch)."""
        okeys = page_keys(self.identity, keys, (FLAT_PART,))
        try:
            if target_locations is None:
                vals = self._store().batch_get(okeys)
                return [None if isinstance(v, KVStoreError)
                        else torch.frombuffer(v, dtype=torch.uint8) if v else
                        torch.empty(0, dtype=torch.uint8) for v in vals]
            sizes = self._store().batch_get_into(okeys, target_locations)
        except KVStoreError as e:
            self._failed("get", e)
            return [None] * len(keys)
        return [t if isinstance(n, int) and n == t.numel() * t.element_size() else None
                for t, n in zip(target_locations, sizes)]

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """Store ``value`` (a contiguous CPU tensor) as flat page ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None,
                  target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Store each value as its flat page; True iff all are stored."""
        if not keys or values is None or len(values) != len(keys):
            return False
        if not self.is_writer:
            return True
        okeys = page_keys(self.identity, keys, (FLAT_PART,))
        try:
            res = self._store().batch_put(okeys, [v.contiguous() for v in values])
        except KVStoreError as e:
            self._failed("set", e)
            return False
        return all(r is None or isinstance(r, KeyConflict) for r in res)

    # ---- upkeep ----
    def clear(self) -> bool:
        """Remove every object of this rank's namespace (a ``client`` token lists its
        tenants' keys, an ``admin`` one every key); True when done."""
        prefix = self.identity.key_prefix()
        try:
            keys = [m.key for m in self._store().list(prefix)]
            for i in range(0, len(keys), 1000):
                self._store().batch_remove(keys[i:i + 1000])
        except KVStoreError as e:
            self._failed("clear", e)
            return False
        log.info("kvstore HiCache backend: removed %d objects under %s", len(keys), prefix)
        return True

    def stats(self) -> dict[str, int]:
        """Cumulative counters of this backend: ``pages_read`` / ``pages_missed``
        (``batch_get_v1``), ``pages_written`` / ``pages_present`` (stored before) /
        ``pages_not_written`` (``batch_set_v1``), ``parts_conflict`` (another
        writer's bytes were there), ``bytes_read`` / ``bytes_written``,
        ``exists_calls``, and ``errors``: calls that met a failure other than a
        missing page (the store unreachable, a node gone; each answered as misses)."""
        with self._lock:
            return dict(self._counters)

    def get_stats(self):
        """SGLang's ``StorageMetrics`` of the calls since the last one (pages per
        call, GB/s), with :meth:`stats` as its ``kvstore`` attribute. (SGLang's
        metrics module imports its model configs, so transformers; where that
        cannot be imported, an object with the same four lists.)"""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            StorageMetrics = _StorageMetrics
        with self._lock:
            m = StorageMetrics(**{k: list(v) for k, v in self._metrics.items()})
            for v in self._metrics.values():
                v.clear()
            m.kvstore = dict(self._counters)
        return m

    def close(self) -> None:
        """Close the client's connections."""
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # ---- helpers ----
    def _store(self) -> KVClient:
        """The client, made at first use: SGLang starts (and answers misses) while
        the store is down. After a failed connect, calls answer misses at once
        for ``timeout_s`` before the next try, so a dead master costs one
        timeout per ``timeout_s``, not one per call.

        Raises:
            kvstore.errors.Unavailable: the master cannot be reached (now or lately).
        """
        with self._client_lock:
            if self._client is not None:
                return self._client
            if time.monotonic() < self._retry_at:
                raise Unavailable(f"kvstore master {self._master} unreachable; retrying later")
            try:
                # One deadline per call, failover waits included: a miss costs a
                # recompute, a stalled prefetch or backup thread costs more.
                self._client = KVClient(self._master, replica_num=self._replica_num,
                                        timeout_s=self._timeout_s,
                                        failover_wait_s=self._timeout_s, token=self._token)
            except KVStoreError:
                self._retry_at = time.monotonic() + self._timeout_s
                raise
            return self._client

    def _views(self, keys: List[str], host_indices, op: str) -> list[memoryview] | None:
        if self.pages is None:
            self._failed(op, RuntimeError("no host pool registered (register_mem_pool_host)"))
            return None
        try:
            return self.pages.views(host_indices, len(keys))
        except ValueError as e:
            self._failed(op, e)
            return None

    def _per_page(self, part_ok: list[bool]) -> list[bool]:
        n = len(self.identity.parts)
        return [all(part_ok[i:i + n]) for i in range(0, len(part_ok), n)]

    def _parents(self, okeys: list[str], extra_info: Any) -> list[str | None]:
        """Each part's previous page's same part: a chain's tail is evicted before its head."""
        n = len(self.identity.parts)
        before = getattr(extra_info, "prefix_keys", None) or []
        first = page_keys(self.identity, before[-1:]) if before else [None] * n
        return first + okeys[:-n]

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._counters[k] += v

    def _metric(self, kind: str, pages: int, nbytes: int, t0: float) -> None:
        if not self.enable_storage_metrics or pages <= 0:
            return
        dt = max(time.perf_counter() - t0, 1e-9)
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / dt / (1 << 30))

    def _failed(self, op: str, err: Exception) -> None:
        self._count(errors=1)
        kind = f"{op}:{type(err).__name__}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("kvstore HiCache backend: %s failed (%s: %s); answering misses "
                        "(logged once per kind, counted in stats())", op,
                        type(err).__name__, err)
