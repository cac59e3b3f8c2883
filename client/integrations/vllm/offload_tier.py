"""kvstore as a secondary tier of vLLM's OffloadingConnector.

vLLM's OffloadingConnector keeps offloaded KV in a CPU (primary) tier and
cascades it to secondary tiers (``vllm.v1.kv_offload.tiering``): GPU -> CPU ->
secondary on store, secondary -> CPU -> GPU on load. :class:`KVStoreTier` is
such a tier, loaded out of tree by module path, with no vLLM change::

    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": ..., "secondary_tiers": [
            {"type": "KVStoreTier",
             "module_path": "kvstore.client.integrations.vllm.offload_tier",
             "master": "HOST:PORT"}]}

vLLM builds it with ``SecondaryTierFactory.create_secondary_tier``,
which passes the tier's other fields as keyword arguments (``master``,
``timeout_s``, ``threads``, ``tenant``, ``locality``).

The CPU tier is one buffer of fixed-size chunks; vLLM hands the tier a
memoryview of it (``primary_kv_view``, chunk ``c`` at byte ``c *
block_size_bytes``). A chunk is one kvstore object of ``block_size_bytes``:
stores ``batch_put`` the chunks' bytes straight from that view, loads
``batch_get_into`` them straight into it (no copy of their own). vLLM names
a chunk by its ``OffloadKey`` (the chained block hash, which covers the
parent blocks, LoRA and cache salt, plus the KV group); its kvstore key is
``xxh3_128(namespace id || offload key)`` in a namespace of the model, its
dtype, the chunk's size and tokens, the TP rank and size and the tenant, so
two models or layouts never share a chunk; with a ``tenant`` the key is
``@tenant/`` before that (the tenant's key: :mod:`kvstore.tenants`).
Instances share chunks when their
block hashes agree across processes (vLLM's default sha256 prefix hash; with
a builtin-hash algorithm set PYTHONHASHSEED alike everywhere).

All methods run on vLLM's scheduler thread and return at once: lookups are
answered from vLLM's :class:`AsyncLookupManager` (``batch_exists`` on its
thread; RETRY until the answer comes), transfers run on a thread pool and
are reported by :meth:`KVStoreTier.get_finished_jobs`. A store that is
down is never raised into vLLM: lookups miss, jobs fail (vLLM recomputes).

Thread safety: vLLM calls every method from its scheduler thread; the pool
threads only read/write the primary view's chunks their job was given and
append results under ``_lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, ClassVar

import xxhash
from vllm.v1.kv_offload.base import (Locality, LookupResult, Medium, OffloadKey, ReqContext,
                                     RequestOffloadingContext, ScheduleEndContext)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstore.client.client import KVClient
from kvstore.errors import KeyConflict
from kvstore.keys import Namespace
from kvstore.tenants import tenant_key

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("vllm.kvstore_offload_tier")

#: The chunk layout this tier writes (part of the namespace's dtype field).
CHUNK_LAYOUT = "vllm-offload-chunk"


def tier_namespace(spec: "OffloadingSpec", chunk_bytes: int, tenant: str = "") -> Namespace:
    """The namespace of the chunks an engine offloads: everything besides the block
    hashes that decides a chunk's bytes."""
    cfg = spec.config
    par = cfg.parallel
    agnostic = par.is_parallelism_agnostic or cfg.replicated_layout
    return Namespace(model=cfg.model.name, kv_dtype=f"{cfg.model.dtype};{CHUNK_LAYOUT};"
                     f"{chunk_bytes}B;{cfg.kv_cache_layout or ''}",
                     block_tokens=cfg.cache.tokens_per_hash * cfg.cache.blocks_per_chunk,
                     tp_rank=0 if agnostic else par.rank,
                     tp_size=1 if agnostic else par.world_size, tenant=tenant)


def chunk_key(namespace_id: bytes, key: OffloadKey) -> str:
    """The kvstore key of one chunk (32 hex digits; a pure function of its inputs)."""
    return xxhash.xxh3_128_hexdigest(namespace_id + bytes(key))


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup, answered by one ``batch_exists`` per request and step."""

    def __init__(self, tier: "KVStoreTier"):
        self._tier = tier
        super().__init__(tier_type=tier.tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._client.batch_exists([self._tier.key(k) for k in keys])


class KVStoreTier(SecondaryTierManager):
    """A secondary offloading tier whose chunks are kvstore objects (see the module doc).

    Args:
        master: the kvstore master, ``host:port``.
        timeout_s: deadline of each store call.
        threads: transfers that may run at once.
        tenant: the namespace's tenant (tenants share no chunk).
        locality: ``"LOCAL"`` or ``"REMOTE"`` for vLLM's KV events (default unset).

    Raises:
        Unavailable: the master cannot be reached.
        ValueError: a bad ``locality``, or a primary view whose chunks are not
            contiguous bytes.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: "OffloadingSpec", primary_kv_view: memoryview,
                 tier_type: str, master: str, timeout_s: float = 5.0, threads: int = 4,
                 tenant: str = "", locality: str | None = None,
                 backpressure_detector: "BackpressureDetector | None" = None):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        if not primary_kv_view.c_contiguous:
            raise ValueError("the primary tier's view must be C-contiguous")
        self._bytes = primary_kv_view.cast("B") if primary_kv_view.format != "B" or \
            primary_kv_view.ndim != 1 else primary_kv_view
        self._ns_id = tier_namespace(offloading_spec, self.block_size_bytes, tenant).id()
        # "@tenant/" before each chunk's key: the tenant's keys (kvstore.tenants); none
        # without a tenant (the keys of before are unchanged).
        self._key_head = tenant_key(tenant, "") if tenant else ""
        self._client = KVClient(master, timeout_s=timeout_s, failover_wait_s=timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads),
                                        thread_name_prefix="kvstore-tier")
        self._lock = threading.Lock()
        self._finished: list[JobResult] = []
        self._futures: set[Future] = set()     # scheduler thread only
        self._loading: dict[int, list[OffloadKey]] = {}   # load job -> keys; scheduler thread
        self._warned = False
        self._lookups = _Lookups(self)

    def key(self, key: OffloadKey) -> str:
        """The kvstore key of chunk ``key``."""
        return self._key_head + chunk_key(self._ns_id, key)

    def _chunk(self, chunk_id) -> memoryview:
        start = int(chunk_id) * self.block_size_bytes
        return self._bytes[start:start + self.block_size_bytes]

    # ---- lookups ----
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """A kvstore lookup counts an access: the chunks become recent for the
        nodes' eviction (in the background; a failure only loses the hint)."""
        names = [self.key(k) for k in keys]
        if names:
            self._submit(lambda: self._client.lookup(names))

    # ---- transfers ----
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunks = [self._chunk(c) for c in job_metadata.chunk_ids]
        self._submit(self._store, job_metadata.job_id, keys, chunks)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunks = [self._chunk(c) for c in job_metadata.chunk_ids]
        self._loading[job_metadata.job_id] = keys
        self._submit(self._load, job_metadata.job_id, keys, chunks)

    def _submit(self, fn, *args) -> None:
        fut = self._pool.submit(fn, *args)
        self._futures.add(fut)
        self._futures = {f for f in self._futures if not f.done()}

    def _store(self, job_id: int, keys: list[OffloadKey], chunks: list[memoryview]) -> None:
        """Put the chunks (pool thread). A key that holds other bytes counts as stored:
        it holds this prefix's KV already (bytes may differ across machines)."""
        t0 = time.perf_counter()
        try:
            errs = self._client.batch_put([self.key(k) for k in keys], chunks)
            bad = [e for e in errs if e is not None and not isinstance(e, KeyConflict)]
        except Exception as e:  # noqa: BLE001 - a job fails, vLLM goes on
            bad = [e]
        if bad:
            self._warn("store", bad[0])
        self._finish(JobResult(job_id=job_id, success=not bad,
                               transfer_time=time.perf_counter() - t0,
                               transfer_bytes=len(keys) * self.block_size_bytes))

    def _load(self, job_id: int, keys: list[OffloadKey], chunks: list[memoryview]) -> None:
        """Read the chunks into their primary slots (pool thread)."""
        t0 = time.perf_counter()
        try:
            sizes = self._client.batch_get_into([self.key(k) for k in keys], chunks)
        except Exception as e:  # noqa: BLE001 - a job fails, vLLM recomputes
            sizes = [e] * len(keys)
        ok = [k for k, s in zip(keys, sizes) if s == self.block_size_bytes]
        failed = [k for k, s in zip(keys, sizes) if s != self.block_size_bytes]
        if failed:
            err = next(s for s in sizes if s != self.block_size_bytes)
            self._warn("load", err if isinstance(err, BaseException)
                       else ValueError(f"a chunk of {err} B, not {self.block_size_bytes}"))
        self._finish(JobResult(job_id=job_id, success=not failed,
                               # None: every key shares the job's fate
                               successful_keys=tuple(ok) if failed and ok else None,
                               transfer_time=time.perf_counter() - t0,
                               transfer_bytes=len(ok) * self.block_size_bytes))

    def _finish(self, result: JobResult) -> None:
        with self._lock:
            self._finished.append(result)

    def _warn(self, what: str, err: BaseException) -> None:
        if not self._warned:
            self._warned = True
            log.warning("kvstore tier %s failed (%s: %s); vLLM recomputes, later failures "
                        "are not logged", what, type(err).__name__, err)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """The jobs done since the last call. The chunks of a load that failed are
        misses from now on: the master may still list chunks whose node is gone,
        and vLLM would otherwise load them again and again."""
        with self._lock:
            done, self._finished = self._finished, []
        for r in done:
            keys = self._loading.pop(r.job_id, None)
            if keys is not None and not r.success:
                ok = set(r.successful_keys or ())
                self._lookups.mark_miss([k for k in keys if k not in ok])
        return done

    def has_pending_work(self) -> bool:
        return any(not f.done() for f in self._futures)

    def drain_jobs(self) -> None:
        wait(list(self._futures))
        self._futures = set()

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self._client.close()
