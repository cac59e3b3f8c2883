"""Decode engine process: load a request's KV blocks, generate greedily with continuous batching.

A request ends after ``max_tokens`` tokens or after one of its
``stop_token_ids`` (the model's EOS, streamed like any token).

One worker thread owns the model and the KV pages. Each iteration it admits
the requests that arrived (loading their blocks from the store straight into
pages), runs one batched decode step for every running request, streams each
new token to its caller, and retires finished requests. Decode is
batch-invariant (see :mod:`kvstore.engines.model`), so a request's tokens do not
depend on what it was batched with.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc

from kvstore.client import KVClient, KVStoreError
from kvstore.engines.generate import greedy_token
from kvstore.engines.kv_cache import Sequence
from kvstore.engines.metrics import EngineMetrics
from kvstore.client.transfer_keys import is_transfer_key
from kvstore.engines.server_common import (EngineConfig, abort_code, load_engine,
                                           serve_until_signal, start_engine_server)
from kvstore.metrics import ProcessMetrics
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc

log = logging.getLogger(__name__)
_DONE = object()
#: At most this many DecodeRequest.stop_token_ids (the conductor's bound too).
MAX_STOP_TOKENS = 64


@dataclass(eq=False)
class DecodeJob:
    req: spb.DecodeRequest
    out: asyncio.Queue                     # tokens, then _DONE or an Exception
    loop: asyncio.AbstractEventLoop
    seq: Sequence = field(default_factory=Sequence)
    produced: int = 1                      # the first token came from prefill
    last_token: int = 0
    stops: frozenset = frozenset()         # req.stop_token_ids

    def emit(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class DecodeWorker:
    """The continuous-batching loop (runs on its own thread)."""

    def __init__(self, model, cache, kv: KVClient, instance_id: str, max_batch: int = 32,
                 metrics: EngineMetrics | None = None):
        self.model = model
        self.metrics = metrics
        self.cache = cache
        self.kv = kv
        self.instance_id = instance_id
        self.max_batch = max_batch
        self.inbox: queue.Queue[DecodeJob] = queue.Queue()
        self.running: list[DecodeJob] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._admit(block=not self.running)
            if self.running:
                self._step()

    def _admit(self, block: bool) -> None:
        while len(self.running) < self.max_batch:
            try:
                job = self.inbox.get(timeout=0.05) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            try:
                self._load(job)
            except (KVStoreError, ValueError) as exc:
                log.warning("decode of %s could not start: %s", job.req.request_id, exc)
                if job.seq.page_ids:
                    self.cache.free(job.seq)
                job.emit(exc)
                continue
            self.running.append(job)

    def _load(self, job: DecodeJob) -> None:
        """Reserve pages and fill them with the prompt's KV from the store."""
        req = job.req
        n = len(req.prompt_tokens)
        job.seq = Sequence(req.request_id)
        self.cache.reserve(job.seq, n + req.max_tokens - 1)
        keys = list(req.block_keys) + ([req.tail_key] if req.tail_key else [])
        if len(keys) != self.cache.pages_for(n):
            raise ValueError(f"{len(keys)} KV blocks for a {n}-token prompt")
        pages = [self.cache.page(p) for p in job.seq.page_ids[:len(keys)]]
        t0 = time.perf_counter()
        for key, r in zip(keys, self.kv.batch_get_into(keys, pages)):
            if isinstance(r, KVStoreError):
                raise r
        if self.metrics is not None:
            self.metrics.kv_load.observe(time.perf_counter() - t0)
        self.cache.mark_computed(job.seq, n)
        self.drop_transfer_keys(req)
        job.last_token = req.first_token

    def drop_transfer_keys(self, req: spb.DecodeRequest) -> None:
        """Remove the request's hand-over keys (read once, never cached)."""
        transient = [k for k in [*req.block_keys, req.tail_key] if k and is_transfer_key(k)]
        if transient:
            for err in self.kv.batch_remove(transient):
                if err is not None:
                    log.warning("could not remove transfer key: %s", err)

    def _step(self) -> None:
        jobs = self.running
        if self.metrics is not None:
            self.metrics.decode_batch.observe(len(jobs))
        logits = self.model.decode([j.seq for j in jobs], self.cache, [j.last_token for j in jobs])
        still = []
        for j, row in zip(jobs, logits):
            tok = greedy_token(row)
            j.last_token = tok
            j.produced += 1
            j.emit(tok)
            if j.produced >= j.req.max_tokens or tok in j.stops:
                self.cache.free(j.seq)
                j.emit(_DONE)
            else:
                still.append(j)
        self.running = still


class DecodeServicer(spb_grpc.DecodeEngineServicer):
    def __init__(self, worker: DecodeWorker):
        self.worker = worker

    async def Decode(self, request, context):
        if len(request.stop_token_ids) > MAX_STOP_TOKENS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"at most {MAX_STOP_TOKENS} stop_token_ids")
        stops = frozenset(request.stop_token_ids)
        if request.max_tokens <= 1:
            return
        if request.first_token in stops:     # done at its first token: nothing to decode
            try:
                await asyncio.to_thread(self.worker.drop_transfer_keys, request)
            except KVStoreError as exc:
                log.warning("could not remove the transfer keys of %s: %s", request.request_id, exc)
            return
        job = DecodeJob(request, asyncio.Queue(), asyncio.get_running_loop(), stops=stops)
        self.worker.inbox.put(job)
        while True:
            item = await job.out.get()
            if item is _DONE:
                return
            if isinstance(item, Exception):
                await context.abort(abort_code(item), f"decode of {request.request_id} failed: {item}")
            yield spb.DecodeChunk(tokens=[item])

    async def Status(self, request, context):
        return spb.EngineStatus(instance_id=self.worker.instance_id, role="decode",
                                queued=self.worker.inbox.qsize(), running=len(self.worker.running))


async def serve(cfg: EngineConfig) -> None:
    """Serve decode requests until SIGTERM / SIGINT (announces READY once listening)."""
    model, cache = load_engine(cfg, "decode")
    kv = KVClient(cfg.master, token=cfg.creds.token, tls=cfg.creds.tls)
    instance_id = cfg.instance_id or f"decode-{uuid.uuid4().hex[:6]}"
    metrics = ProcessMetrics("decode")
    worker = None
    engine_metrics = EngineMetrics(metrics, lambda: worker.inbox.qsize() if worker else 0)
    worker = DecodeWorker(model, cache, kv, instance_id, metrics=engine_metrics)
    worker.start()
    served = await start_engine_server(
        cfg, "decode", lambda srv: spb_grpc.add_DecodeEngineServicer_to_server(
            DecodeServicer(worker), srv), metrics)

    def stop() -> None:
        worker.stop()
        kv.close()

    await serve_until_signal(served, {"instance_id": instance_id}, on_stop=stop)
