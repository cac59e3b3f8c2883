"""KVStoreConnector: vLLM's v1 KV connector backed by kvstore.

Load it out of tree with ``kvstore vllm-config --master HOST:PORT`` (the
``kv_transfer_config`` JSON). This module imports vLLM; ``kvstore.client``
itself never imports it. Key namespacing is :mod:`kvstore.client.integrations.vllm.keys`.

Scheduler side: one ``batch_exists`` per request over the prompt's full-block
keys (all but the last token, which vLLM always computes) says how many
tokens beyond vLLM's own prefix cache can be loaded. The worker side loads
those blocks with one ``batch_get`` per request before the forward and
copies each layer's slice into vLLM's paged tensors, and it copies each
layer's slice of the newly computed full prompt blocks as vLLM produces
them and writes them with one ``batch_put`` per step, handed to a
background thread in ``wait_for_save`` (``save_async``, the default), so the
engine step does not wait for the store; the blocks are copied out of
vLLM's cache by then, so vLLM may free them at once (``request_finished``
holds nothing and ``get_finished`` has nothing to report). At most
``MAX_PENDING_SAVES`` batches wait; then the step waits for the oldest; at
shutdown every pending save is finished (``save_mode: parts``: each layer goes
straight into values reserved on their nodes, committed in the background,
:mod:`.layerwise`). Loads are synchronous by default; with ``load_async`` a
request's blocks are read on a thread while vLLM steps the others and it is
reported in ``get_finished`` once they are in (:mod:`.loads`); KV events of
the blocks in kvstore go to vLLM's publisher (:mod:`.kv_events`). The copies
go through reusable host buffers (pinned where CUDA is), one copy per layer slice
each way, so vLLM's KV tensors may be on any device (:mod:`.staging`). A store
that is down, or a block that cannot be read, is never raised into vLLM: the
scheduler reports no hit, the worker reports the blocks in ``get_block_ids_with_load_errors``
so vLLM recomputes them; the first failure is logged, every one counted in
:meth:`KVStoreConnector.stats` (and in the JSON file ``stats_path`` of the
extra config, when given). vLLM's own stats path gets the same counters:
``get_kv_connector_stats`` hands over what changed since its last call (a
:class:`KVStoreConnectorStats`; vLLM sums the scheduler's and the worker's
and prints them as "KV Transfer metrics").
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvstore.client.client import KVClient
from kvstore.client.integrations.vllm import kv_events
from kvstore.client.integrations.vllm.keys import EngineIdentity, matched_blocks, request_keys
from kvstore.client.integrations.vllm.layerwise import LayerwiseSave
from kvstore.client.integrations.vllm.loads import Loader, LoadJob
from kvstore.client.integrations.vllm.staging import (BlockLayout, HostBuffers, StagedSave,
                                                    copies_done, copy_between, rows)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput

# vLLM shows INFO of out-of-tree modules only under a logger named vllm.*.
log = logging.getLogger("vllm.kvstore_connector")

#: Save batches (one per step) queued for the background thread before a step waits.
MAX_PENDING_SAVES = 16


@dataclass
class _ReqPlan:
    """One request's work for this step, sent from scheduler to worker."""

    req_id: str
    tokens: list[int]
    lora_name: str
    cache_salt: str
    load_blocks: list[tuple[int, int]] = field(default_factory=list)  # (block index, block id)
    save_blocks: list[tuple[int, int]] = field(default_factory=list)
    load_async: bool = False    # load_blocks are read in the background (get_finished)


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    requests: list[_ReqPlan] = field(default_factory=list)


@dataclass
class KVStoreConnectorStats(KVConnectorStats):
    """The connector's counters over one interval (``data``: counter -> amount);
    aggregating sums them, so scheduler and worker counters add up."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KVStoreConnectorStats":
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass
class _Tracked:
    tokens: list[int]
    lora_name: str
    cache_salt: str
    block_ids: list[int]
    saved_upto: int  # blocks below this index need no save
    computed_at_lookup: int = 0     # vLLM's own prefix hit (tokens) at the last lookup
    loading: set[int] = field(default_factory=set)  # block ids of its async load under way
    no_load: bool = False   # an async load of it failed: vLLM recomputes, never loads again


def _identity(vllm_config: "VllmConfig", tp_rank: int) -> EngineIdentity:
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    dtype = cc.cache_dtype if cc.cache_dtype != "auto" else str(mc.dtype).removeprefix("torch.")
    return EngineIdentity(model=str(extra.get("model_id", mc.model)),
                          revision=str(extra.get("revision", mc.revision or "")),
                          kv_dtype=str(dtype), num_layers=mc.get_num_layers(pc),
                          num_kv_heads=mc.get_num_kv_heads(pc), head_dim=mc.get_head_size(),
                          block_size=cc.block_size, tp_rank=tp_rank,
                          tp_size=pc.tensor_parallel_size, tenant=str(extra.get("tenant", "")))


class KVStoreConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector whose cache is a kvstore cluster (see the module doc)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._master = str(extra["master"])
        self._stats_path = extra.get("stats_path")
        self._timeout_s = float(extra.get("timeout_s", 5.0))
        self._save_async = bool(extra.get("save_async", True))
        self._load_async = bool(extra.get("load_async", False))
        self._load_threads = int(extra.get("load_threads", 2))
        self._save_parts = extra.get("save_mode", "batch") == "parts"   # else one batch_put
        self._block_size = vllm_config.cache_config.block_size
        self._can_load = self._kv_transfer_config.kv_role in ("kv_both", "kv_consumer")
        self._can_save = self._kv_transfer_config.kv_role in ("kv_both", "kv_producer")
        tp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            try:
                tp_rank = get_tensor_model_parallel_rank()
            except Exception:  # noqa: BLE001 - no TP group (single process)
                tp_rank = 0
        self._identity = _identity(vllm_config, tp_rank)
        self._client: KVClient | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._stats = {"lookups": 0, "lookup_errors": 0, "hit_blocks": 0,
                       "loaded_blocks": 0, "load_errors": 0, "load_s": 0.0,
                       "saved_blocks": 0, "save_errors": 0, "save_s": 0.0,
                       "load_errors_reported": 0, "save_wait_s": 0.0,
                       "async_loads": 0, "load_wait_s": 0.0, "steps_during_loads": 0}
        self._reported: dict[str, int | float] = {}  # _stats at the last get_kv_connector_stats
        # scheduler state
        self._tracked: dict[str, _Tracked] = {}
        self._pending_loads: dict[str, list[tuple[int, int]]] = {}
        # worker state
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layout: BlockLayout | None = None
        self._host = HostBuffers()
        self._load_errors: set[int] = set()
        self._staged: StagedSave | None = None
        self._saver: ThreadPoolExecutor | None = None
        self._pending_saves: deque[Future] = deque()
        self._loader: Loader | None = None
        self._layerwise: LayerwiseSave | None = None
        # KV events of the blocks kept in kvstore (medium STORAGE), scheduler side
        self._kv_events = kv_events.for_connector(
            vllm_config, self._master, self._identity, self._block_size, extra) \
            if role == KVConnectorRole.SCHEDULER and self._can_save else None

    # ---- shared ----
    def _store(self) -> KVClient:
        with self._lock:  # the save thread and the engine's share one client
            if self._client is None:
                self._client = KVClient(self._master, timeout_s=self._timeout_s,
                                        failover_wait_s=self._timeout_s)
            return self._client

    def _count(self, counter: str, n: int | float) -> None:
        with self._lock:
            self._stats[counter] += n

    def _fail(self, what: str, counter: str, n: int, err: BaseException) -> None:
        self._count(counter, n)
        with self._lock:
            first = what not in self._warned
            self._warned.add(what)
        if first:
            log.warning("kvstore %s failed (%s: %s); vLLM recomputes, later failures are "
                        "only counted", what, type(err).__name__, err)
        self._dump_stats()

    def _dump_stats(self) -> None:
        if not self._stats_path:
            return
        path = f"{self._stats_path}.{self._role.name.lower()}.json"
        with self._lock:
            with open(path, "w") as f:
                json.dump(self._stats, f)

    def stats(self) -> dict:
        """Counters: lookups, hit/loaded/saved blocks, load/save errors and seconds (the
        background puts' ``save_s``, the engine's waits for them ``save_wait_s``; the
        store reads' ``load_s``), and the failed blocks handed to vLLM to recompute
        (``load_errors_reported``). Async loads: ``async_loads`` started, the engine
        thread's time on them ``load_wait_s`` (submitting, copying in), and
        ``steps_during_loads``, the engine steps that ended while a read was under way."""
        with self._lock:
            return dict(self._stats)

    def get_kv_connector_stats(self) -> KVStoreConnectorStats | None:
        """What the counters gained since the last call (vLLM calls it every step)."""
        now = self.stats()
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        delta = {k: v for k, v in delta.items() if v}
        return KVStoreConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict | None = None) -> KVStoreConnectorStats:
        return KVStoreConnectorStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._loader is not None:
            for job in self._loader.close():     # loads vLLM no longer waits for
                if job.buf is not None:
                    self._host.give(job.buf)
            self._loader = None
        if self._kv_events is not None:
            self._kv_events.close()
        self._drain_saves(0)
        if self._layerwise is not None:
            self._layerwise.close()
        if self._saver is not None:
            self._saver.shutdown(wait=True)
            self._saver = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # ---- scheduler side ----
    @staticmethod
    def _req_ns(request) -> tuple[str, str]:
        lora = getattr(request, "lora_request", None)
        return (lora.lora_name if lora is not None else ""), (request.cache_salt or "")

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        """Tokens beyond vLLM's own ``num_computed_tokens`` kvstore holds, and whether
        they are loaded in the background (``load_async``)."""
        if not self._can_load:
            return 0, False
        t = self._tracked.get(request.request_id)
        if t is not None:
            if t.no_load:
                return 0, False
            t.computed_at_lookup = num_computed_tokens   # where the loaded blocks start
        tokens = list(request.prompt_token_ids or [])
        usable = (len(tokens) - 1) // self._block_size  # the last token is always computed
        if usable * self._block_size <= num_computed_tokens:
            return 0, False
        lora, salt = self._req_ns(request)
        keys = request_keys(self._identity, tokens[:usable * self._block_size], lora, salt)
        self._count("lookups", 1)
        try:
            hits = matched_blocks(self._store().batch_exists(keys))
        except Exception as e:  # noqa: BLE001 - never raise into the engine loop
            self._fail("lookup", "lookup_errors", 1, e)
            return 0, False
        self._count("hit_blocks", hits)
        self._dump_stats()
        n = max(0, hits * self._block_size - num_computed_tokens)
        return n, self._load_async and n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        block_ids = blocks.get_block_ids()[0]
        # blocks holds the request's blocks from the first one; the external
        # tokens follow the locally computed ones (the hit vLLM gave the lookup).
        t = self._tracked.get(request.request_id)
        first = (t.computed_at_lookup if t is not None else 0) // self._block_size
        n = num_external_tokens // self._block_size
        self._pending_loads[request.request_id] = [(i, block_ids[i])
                                                   for i in range(first, first + n)]

    def on_new_request(self, request) -> None:
        lora, salt = self._req_ns(request)
        self._tracked[request.request_id] = _Tracked(list(request.prompt_token_ids or []),
                                                     lora, salt, [], 0)
        if self._kv_events is not None:
            self._kv_events.track(request)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        steps: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[0])
            loads = self._pending_loads.pop(new.req_id, [])
            # blocks vLLM already had or loaded (both in num_computed_tokens; after a
            # failed async load only those before its first failed block) need no save
            t.saved_upto = new.num_computed_tokens // self._block_size
            if loads:
                meta.requests.append(_ReqPlan(new.req_id, t.tokens, t.lora_name, t.cache_salt,
                                              load_blocks=loads))
            steps.append((new.req_id, new.num_computed_tokens))
        # Async loads: their requests wait (unscheduled) until get_finished reports them.
        for req_id in [r for r in self._pending_loads if self._load_async]:
            t, loads = self._tracked.get(req_id), self._pending_loads.pop(req_id)
            if t is not None:
                t.loading = {bid for _, bid in loads}
                meta.requests.append(_ReqPlan(req_id, t.tokens, t.lora_name, t.cache_salt,
                                              load_blocks=loads, load_async=True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._tracked.get(req_id)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                t.block_ids.extend(new_ids[0])
            steps.append((req_id, cached.num_computed_tokens[i]))
        if self._can_save:
            for req_id, computed in steps:
                t = self._tracked[req_id]
                done = min(len(t.tokens), computed + scheduler_output.num_scheduled_tokens.get(
                    req_id, 0)) // self._block_size
                if done > t.saved_upto:
                    plan = _ReqPlan(req_id, t.tokens, t.lora_name, t.cache_salt,
                                    save_blocks=[(b, t.block_ids[b])
                                                 for b in range(t.saved_upto, done)])
                    meta.requests.append(plan)
                    if self._kv_events is not None:
                        self._kv_events.planned(req_id, t.tokens, t.lora_name, t.cache_salt,
                                                range(t.saved_upto, done))
                    t.saved_upto = done
        return meta

    def update_connector_output(self, connector_output) -> None:
        """Blocks whose load failed are recomputed by vLLM: save them again then
        (the store lost or never had them), from a request's first failed block."""
        bad = getattr(connector_output, "invalid_block_ids", None)
        for req_id in getattr(connector_output, "finished_recving", None) or ():
            t = self._tracked.get(req_id)
            if t is not None:
                # A failed async load is not tried again: vLLM asks again when the
                # whole load failed, and the store may still list the blocks.
                t.no_load = bool(bad and t.loading & bad)
                t.loading = set()
        if not bad:
            return
        for t in self._tracked.values():
            for i, bid in enumerate(t.block_ids[:t.saved_upto]):
                if bid in bad:
                    t.saved_upto = i
                    break

    def request_finished(self, request, block_ids):
        if self._kv_events is not None:
            self._kv_events.untrack(request.request_id)
        self._tracked.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        return False, None

    def take_events(self):
        """vLLM KV events of the blocks in kvstore (:mod:`.kv_events`), since the last call."""
        return self._kv_events.take() if self._kv_events is not None else ()

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._kv_caches = dict(kv_caches)
        self._layout = BlockLayout.of(self._kv_caches, self._block_slice)

    def _block_slice(self, tensor: torch.Tensor, block_id: int) -> torch.Tensor:
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config else None
        if tensor.shape[0] == num_blocks or tensor.shape[0] != 2:
            return tensor[block_id]
        return tensor[:, block_id]  # a [2, num_blocks, ...] layout

    def _keys(self, plan: _ReqPlan, blocks: list[tuple[int, int]]) -> list[str]:
        n = max(b for b, _ in blocks) + 1
        keys = request_keys(self._identity, plan.tokens[:n * self._block_size],
                            plan.lora_name, plan.cache_salt)
        return [keys[b] for b, _ in blocks]

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Load this step's blocks: synchronous loads here, before the forward that
        needs them; asynchronous ones are handed to the load threads (get_finished
        reports them)."""
        meta = self._get_connector_metadata()
        t0 = time.perf_counter()
        for plan in meta.requests:
            if not plan.load_blocks:
                continue
            job = LoadJob(plan.req_id, self._keys(plan, plan.load_blocks),
                          [bid for _, bid in plan.load_blocks])
            if plan.load_async:
                if self._loader is None:
                    self._loader = Loader(self._read_blocks, self._host,
                                          self._layout.object_bytes, self._load_threads)
                self._loader.submit(job)
                self._count("async_loads", 1)
                continue
            job.read(self._read_blocks, self._host, self._layout.object_bytes)
            self._apply(job)
        if any(p.load_async for p in meta.requests):
            self._count("load_wait_s", time.perf_counter() - t0)
        self._dump_stats()

    def _read_blocks(self, keys: list[str], dests: list) -> list:
        """The store read of a load (on a load thread when asynchronous)."""
        return self._store().batch_get_into(keys, dests)

    def _apply(self, job: LoadJob) -> None:
        """Copy a read job's objects into vLLM's blocks (engine thread); a block that
        failed goes to get_block_ids_with_load_errors."""
        loaded, failed = job.copy_in(self._kv_caches, self._layout, self._block_slice,
                                     self._host)
        for bid, err in failed:
            self._load_errors.add(bid)
            self._fail("load", "load_errors", 1, err)
        self._count("loaded_blocks", loaded)
        self._count("load_s", job.read_s)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                               set[str] | None]:
        """``(None, requests whose async load is done)``: their blocks are copied in
        now, on the engine thread, and the failed ones are in the same pass's
        get_block_ids_with_load_errors. Saves hold no blocks, so nothing is sending."""
        if self._loader is None:
            return None, None
        t0 = time.perf_counter()
        done = self._loader.take_done()
        for job in done:
            self._apply(job)
        if self._loader.in_flight:
            self._count("steps_during_loads", 1)
        if done:
            self._count("load_wait_s", time.perf_counter() - t0)
            self._dump_stats()
        return None, ({job.req_id for job in done} or None)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        """Copy this layer's slice of the step's blocks to save into their objects' rows
        (one copy each, device to host). A failure is counted in ``wait_for_save``, never
        raised into vLLM's forward."""
        if self._save_parts:
            self._save_layer_parts(layer_name, kv_layer)
            return
        staged = self._staged
        if staged is None:
            plans = [p for p in self._get_connector_metadata().requests if p.save_blocks]
            if not plans:
                return
            staged = self._staged = StagedSave(plans)
        try:
            if staged.error is not None:
                return
            if staged.buf is None:
                size = self._layout.object_bytes
                staged.buf = self._host.take(staged.num_blocks * size)
                staged.objects = rows(staged.buf, staged.num_blocks, size)
            off, size = self._layout.place(layer_name)
            row = 0
            for plan in staged.plans:
                for _b, bid in plan.save_blocks:
                    staged.pending |= copy_between(
                        staged.objects[row, off:off + size], self._block_slice(kv_layer, bid),
                        to_host=True, pinned=self._host.pin)
                    row += 1
            staged.layers.add(layer_name)
        except Exception as e:  # noqa: BLE001 - never raise into the engine's forward
            staged.error = e

    def bind_connector_metadata(self, connector_metadata) -> None:
        """vLLM binds the step's plans before its forward: ``save_mode: parts`` reserves
        the step's values now, while the first layers compute."""
        super().bind_connector_metadata(connector_metadata)
        if self._save_parts and self._layout is not None:
            self._begin_parts()

    def _begin_parts(self) -> None:
        if self._layerwise is None:
            self._layerwise = LayerwiseSave(self._store, self._layout, self._block_slice,
                                            self._host, self._count, self._fail,
                                            self._dump_stats)
        plans = [p for p in self._get_connector_metadata().requests if p.save_blocks]
        if plans and self._layerwise.step is None:
            self._layerwise.begin([k for p in plans for k in self._keys(p, p.save_blocks)],
                                  [bid for p in plans for _, bid in p.save_blocks])

    def _save_layer_parts(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """``save_mode: parts``: each layer goes into the step's reserved values
        (:mod:`.layerwise`)."""
        if self._layerwise is None or self._layerwise.step is None:
            self._begin_parts()
        self._layerwise.layer(layer_name, kv_layer)

    def wait_for_save(self):
        if self._layerwise is not None and self._save_parts:
            t0 = time.perf_counter()
            self._drain_saves(MAX_PENDING_SAVES - 1)
            done = self._layerwise.finish()
            if done is not None:
                self._pending_saves.append(done)
            self._count("save_wait_s", time.perf_counter() - t0)
            return
        staged, self._staged = self._staged, None
        if staged is None:
            return
        ready = copies_done() if staged.pending else None
        if staged.error is None and len(staged.layers) != len(self._layout.names):
            staged.error = ValueError(f"{len(self._layout.names) - len(staged.layers)} layers "
                                      "were not saved this step")
        if staged.error is not None:
            if ready is not None:
                ready.synchronize()
            if staged.buf is not None:
                self._host.give(staged.buf)
            self._fail("save", "save_errors", staged.num_blocks, staged.error)
            return
        keys: list[str] = []
        for plan in staged.plans:
            keys += self._keys(plan, plan.save_blocks)
        # the rows, in the plans' order: the SDK reads them in place (no copy)
        values = list(staged.objects)
        t0 = time.perf_counter()
        if not self._save_async:
            self._put(keys, values, staged.buf, ready)
        else:
            self._drain_saves(MAX_PENDING_SAVES - 1)
            if self._saver is None:
                self._saver = ThreadPoolExecutor(max_workers=1,
                                                 thread_name_prefix="kvstore-save")
            self._pending_saves.append(self._saver.submit(self._put, keys, values, staged.buf,
                                                          ready))
        self._count("save_wait_s", time.perf_counter() - t0)

    def _drain_saves(self, keep: int) -> None:
        """Wait until at most ``keep`` background saves are pending."""
        while self._pending_saves and (len(self._pending_saves) > keep
                                       or self._pending_saves[0].done()):
            self._pending_saves.popleft().result()  # _put raises nothing

    def _put(self, keys: list[str], values: list, buf: torch.Tensor | None = None,
             ready=None) -> None:
        """One ``batch_put``, counted; never raises (it may run in the save thread).

        Args:
            values: the objects (rows of ``buf``).
            buf: the staging buffer, given back once the put is done.
            ready: the event of the copies into ``buf``, waited for first (CUDA).
        """
        t0 = time.perf_counter()
        try:
            try:
                if ready is not None:
                    ready.synchronize()
                errs = self._store().batch_put(keys, values)
            finally:
                if buf is not None:
                    self._host.give(buf)
        except Exception as e:  # noqa: BLE001
            self._fail("save", "save_errors", len(keys), e)
            return
        for err in errs:
            if err is None:
                self._count("saved_blocks", 1)
            else:
                self._fail("save", "save_errors", 1, err)
        self._count("save_s", time.perf_counter() - t0)
        self._dump_stats()

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        if out:
            self._count("load_errors_reported", len(out))
            self._dump_stats()
        return out
