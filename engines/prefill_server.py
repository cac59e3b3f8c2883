"""Prefill engine process: cached prefix from the store, compute the rest, save new blocks.

For each request (FIFO, one worker thread owns the model and its KV pages)::

    keys = prefix_keys(prompt)                      # chained block hashes
    hit  = leading keys that exist                  # the cached prefix
    load hit blocks straight into KV pages          # get_into, zero copy
    prefill the rest in block-aligned chunks        # first token (greedy)
    save new full blocks under their prefix keys    # the shared cache
    hand every block to decode: prefix keys, or request-scoped transfer keys
    for blocks the cache could not keep (and the partial last block)

Saving is done by a saver from :mod:`kvstore.engines.kv_saver` (``--save-mode``):
``sync`` (default) puts every new block in one batch after prefill;
``streamed`` puts blocks from a background thread as soon as the model
completes them, overlapping the store's round trips with the next
chunks' compute (slower on the CPU-only tiny model: see that module). Each
response reports the save time and the part of it hidden behind compute
(``save_ms``, ``save_hidden_ms``); :meth:`PrefillServicer.Status` reports
the totals.

With ``use_cache=False`` nothing is read from or written to the prefix
cache; the KV still reaches decode through transfer keys (streamed the
same way).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid


from kvstore.client import KVClient, KVStoreError, prefix_keys
from kvstore.engines.generate import greedy_token
from kvstore.engines.kv_cache import Sequence
from kvstore.engines.kv_saver import (DEFAULT_SAVE_MODE, BlockSaver, SaveJob, SaveReport,
                                      make_saver)
from kvstore.engines.metrics import EngineMetrics
from kvstore.engines.model import max_cached_blocks
from kvstore.client.transfer_keys import transfer_key
from kvstore.engines.server_common import (EngineConfig, abort_code, load_engine, namespace_of,
                                           serve_until_signal, start_engine_server)
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.errors import InvalidArgument, KeyConflict
from kvstore.keys import tenant_namespace, valid_tenant
from kvstore.metrics import ProcessMetrics

log = logging.getLogger(__name__)


#: SaveJob tag of the partial last block.
_TAIL = -1


class PrefillWorker:
    """Runs prefill requests one at a time on its own thread (it owns model and pages).

    Args:
        model: the model.
        cache: the worker's KV pages (``page_tokens`` = the namespace's block size).
        kv: the store client (thread-safe; the streamed saver uses it from its thread).
        namespace: the store namespace of ``model``.
        instance_id: name in logs and metrics.
        save_mode: a name in :data:`kvstore.engines.kv_saver.SAVE_MODES`.
        saver: a ready saver instead (tests and benchmarks tune it); the
            worker owns it either way and closes it in :meth:`close`.
        metrics: tokens computed and loaded, save and load times.
    """

    def __init__(self, model, cache, kv: KVClient, namespace, instance_id: str,
                 save_mode: str = DEFAULT_SAVE_MODE, saver: BlockSaver | None = None,
                 metrics: EngineMetrics | None = None):
        self.model = model
        self.metrics = metrics
        self.cache = cache
        self.kv = kv
        self.namespace = namespace
        self.instance_id = instance_id
        self.block_tokens = cache.page_tokens
        self.saver = saver or make_saver(save_mode, kv)
        self.counters = {"requests": 0, "hit_blocks": 0, "saved_blocks": 0, "save_failures": 0}
        # Totals over finished requests, in milliseconds (Status reports them).
        self.times_ms = {"compute": 0.0, "save": 0.0, "save_hidden": 0.0}

    def close(self) -> None:
        self.saver.close()

    def run(self, req: spb.PrefillRequest, submitted_s: float) -> spb.PrefillResponse:
        started = time.perf_counter()
        prompt = list(req.prompt_tokens)
        if not prompt:
            raise InvalidArgument("empty prompt")
        b = self.block_tokens
        if not valid_tenant(req.tenant):
            raise InvalidArgument(f"bad tenant {req.tenant[:80]!r}: 1-64 of A-Z a-z 0-9 _ . -")
        keys = prefix_keys(prompt, tenant_namespace(self.namespace, req.tenant))
        nonce = uuid.uuid4().hex[:8]
        seq = Sequence(req.request_id)
        self.cache.reserve(seq, len(prompt))
        session = self.saver.begin()
        try:
            t_load = time.perf_counter()
            hit = self._load_prefix(seq, keys, len(prompt)) if req.use_cache else 0
            load_s = time.perf_counter() - t_load
            self.cache.mark_computed(seq, hit * b)
            # Where each new full block goes: its prefix key (the shared cache),
            # or a transfer key when the cache is bypassed.
            if req.use_cache:
                dest = {i: (keys[i], keys[i - 1] if i else None) for i in range(hit, len(keys))}
            else:
                dest = {i: (transfer_key(req.request_id, nonce, i), None) for i in range(len(keys))}

            def on_block(i: int, page_id: int) -> None:
                key, parent = dest[i]
                session.submit(SaveJob(i, key, self.cache.page(page_id), parent))

            if self.saver.layered:
                full = len(prompt) // b
                session.expect([SaveJob(i, dest[i][0], self.cache.page(seq.page_ids[i]),
                                        dest[i][1]) for i in range(hit, full)])

            def on_layer(i: int, layer: int, page_id: int) -> None:
                key, parent = dest[i]
                session.submit_layer(SaveJob(i, key, self.cache.page(page_id), parent),
                                     layer, self.cache.num_layers)

            first = greedy_token(self.model.prefill(
                seq, self.cache, prompt, on_block=on_block,
                on_layer=on_layer if self.saver.layered else None))
            tail_key = ""
            if len(prompt) % b:
                tail_key = transfer_key(req.request_id, nonce, "tail")
                session.submit(SaveJob(_TAIL, tail_key, self.cache.page(seq.page_ids[-1])))
            report = session.finish()
            block_keys, saved, fallback_ms = self._hand_over(req, seq, keys, hit, nonce, report)
        finally:
            session.abandon()   # nothing may read the pages once they are free
            self.cache.free(seq)
        compute_ms = (time.perf_counter() - started) * 1000
        save_ms = report.save_ms + fallback_ms
        self.counters["requests"] += 1
        self.counters["hit_blocks"] += hit
        self.counters["saved_blocks"] += saved
        self.times_ms["compute"] += compute_ms
        self.times_ms["save"] += save_ms
        self.times_ms["save_hidden"] += report.hidden_ms
        if self.metrics is not None:
            self.metrics.loaded.inc(hit * b)
            self.metrics.computed.inc(len(prompt) - hit * b)
            self.metrics.kv_save.observe(save_ms / 1000)
            if hit:
                self.metrics.kv_load.observe(load_s)
        return spb.PrefillResponse(
            first_token=first, cached_tokens=hit * b, saved_blocks=saved, tail_key=tail_key,
            block_keys=block_keys, hit_blocks=hit, total_blocks=len(keys),
            queue_ms=(started - submitted_s) * 1000, compute_ms=compute_ms,
            save_mode=report.mode, save_ms=save_ms, save_hidden_ms=report.hidden_ms)

    def _load_prefix(self, seq: Sequence, keys: list[str], num_tokens: int) -> int:
        """Load the longest cached prefix into the sequence's pages; returns blocks loaded.

        At least one prompt token is always computed (its logits give the first token).
        """
        limit = min(len(keys), max_cached_blocks(num_tokens, self.block_tokens))
        exists = self.kv.batch_exists(keys[:limit])
        n = 0
        while n < len(exists) and exists[n]:
            n += 1
        if not n:
            return 0
        res = self.kv.batch_get_into(keys[:n], [self.cache.page(p) for p in seq.page_ids[:n]])
        for i, r in enumerate(res):
            if isinstance(r, KVStoreError):
                # Gone between exists and get (removed or evicted): a shorter prefix.
                return i
        return n

    def _hand_over(self, req, seq: Sequence, keys: list[str], hit: int, nonce: str,
                   report: SaveReport) -> tuple[list[str], int, float]:
        """Make every full block readable by decode, given what the saver did.

        Blocks ``< hit`` are in the cache already; the saver put the others
        under their prefix keys (``use_cache``) or transfer keys. A prefix
        block the cache refused (full, or different bytes) goes by a
        transfer key instead, put here.

        Returns:
            (block keys for decode, prefix blocks saved, fallback put time in ms).

        Raises:
            KVStoreError: a transfer key (or the tail) could not be stored.
        """
        tail = report.results.get(_TAIL)
        if tail is not None:
            raise tail
        if not req.use_cache:
            block_keys = [transfer_key(req.request_id, nonce, i) for i in range(len(keys))]
            for i in range(len(keys)):
                if report.results[i] is not None:
                    raise report.results[i]
            return block_keys, 0, 0.0
        block_keys = list(keys)
        saved = 0
        for i in range(hit, len(keys)):
            err = report.results[i]
            if err is None:
                saved += 1
                continue
            if isinstance(err, KeyConflict):
                # Same prefix, different KV bytes: the model is not deterministic
                # or the namespace is wrong. A bug: say so loudly.
                log.error("prefix block %s holds different KV: %s", keys[i], err)
            self.counters["save_failures"] += 1
            block_keys[i] = ""     # hand this block over by transfer key instead
        missing = [i for i, k in enumerate(block_keys) if not k]
        if not missing:
            return block_keys, saved, 0.0
        t0 = time.perf_counter()
        pages = [self.cache.page(p) for p in seq.page_ids[:len(keys)]]
        xkeys = [transfer_key(req.request_id, nonce, i) for i in missing]
        res = self.kv.batch_put(xkeys, [pages[i] for i in missing])
        for i, k, err in zip(missing, xkeys, res):
            if err is not None:
                raise err
            block_keys[i] = k
        return block_keys, saved, (time.perf_counter() - t0) * 1000


class PrefillServicer(spb_grpc.PrefillEngineServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill")
        self.queued = 0
        self.queued_tokens = 0

    async def Prefill(self, request, context):
        loop = asyncio.get_running_loop()
        self.queued += 1
        self.queued_tokens += len(request.prompt_tokens)
        try:
            return await loop.run_in_executor(self.pool, self.worker.run, request, time.perf_counter())
        except (KVStoreError, ValueError) as exc:
            await context.abort(abort_code(exc), f"prefill of {request.request_id} failed: {exc}")
        finally:
            self.queued -= 1
            self.queued_tokens -= len(request.prompt_tokens)

    async def Status(self, request, context):
        w = self.worker
        return spb.EngineStatus(instance_id=w.instance_id, role="prefill",
                                queued=self.queued, queued_tokens=self.queued_tokens,
                                save_mode=w.saver.name, requests_done=w.counters["requests"],
                                compute_ms_total=w.times_ms["compute"],
                                save_ms_total=w.times_ms["save"],
                                save_hidden_ms_total=w.times_ms["save_hidden"])


async def serve(cfg: EngineConfig) -> None:
    """Serve prefill requests until SIGTERM / SIGINT (announces READY once listening)."""
    model, cache = load_engine(cfg, "prefill")
    kv = KVClient(cfg.master, token=cfg.creds.token, tls=cfg.creds.tls)
    instance_id = cfg.instance_id or f"prefill-{uuid.uuid4().hex[:6]}"
    metrics = ProcessMetrics("prefill")
    servicer = None
    engine_metrics = EngineMetrics(metrics, lambda: servicer.queued if servicer else 0)
    worker = PrefillWorker(model, cache, kv, namespace_of(cfg), instance_id,
                           cfg.save_mode or DEFAULT_SAVE_MODE, metrics=engine_metrics)
    servicer = PrefillServicer(worker)
    served = await start_engine_server(
        cfg, "prefill", lambda srv: spb_grpc.add_PrefillEngineServicer_to_server(servicer, srv),
        metrics)
    await serve_until_signal(served, {"instance_id": instance_id},
                             on_stop=lambda: _close(worker, kv))


def _close(worker: PrefillWorker, kv: KVClient) -> None:
    worker.close()   # the saver thread first: it uses the client
    kv.close()
