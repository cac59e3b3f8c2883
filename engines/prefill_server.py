"""Prefill engine process: cached prefix from the store, compute the rest, save new blocks.

For each request (FIFO, one worker thread owns the model and its KV pages)::

    keys = prefix_keys(prompt)                      # chained block hashes
    hit  = leading keys that exist                  # the cached prefix
    load hit blocks straight into KV pages          # get_into, zero copy
    prefill the rest in block-aligned chunks        # first token (greedy)
    save new full blocks under their prefix keys    # the shared cache
    hand every block to decode: prefix keys, or request-scoped transfer keys
    for blocks the cache could not keep (and the partial last block)

With ``use_cache=False`` nothing is read from or written to the prefix
cache; the KV still reaches decode through transfer keys.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
import uuid

import grpc

from client import KVClient, KVStoreError, prefix_keys
from engines.generate import greedy_token
from engines.kv_cache import OutOfPages, Sequence
from engines.model import max_cached_blocks
from engines.namespace import transfer_key
from engines.server_common import engine_args, load_engine, namespace_of, serve_until_signal
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.errors import InvalidArgument, KeyConflict, NoSpace

log = logging.getLogger(__name__)


class PrefillWorker:
    """Runs prefill requests one at a time on its own thread (it owns model and pages)."""

    def __init__(self, model, cache, kv: KVClient, namespace, instance_id: str):
        self.model = model
        self.cache = cache
        self.kv = kv
        self.namespace = namespace
        self.instance_id = instance_id
        self.block_tokens = cache.page_tokens
        self.counters = {"requests": 0, "hit_blocks": 0, "saved_blocks": 0, "save_failures": 0}

    def run(self, req: spb.PrefillRequest, submitted_s: float) -> spb.PrefillResponse:
        started = time.perf_counter()
        prompt = list(req.prompt_tokens)
        if not prompt:
            raise InvalidArgument("empty prompt")
        b = self.block_tokens
        keys = prefix_keys(prompt, self.namespace)
        seq = Sequence(req.request_id)
        self.cache.reserve(seq, len(prompt))
        try:
            hit = self._load_prefix(seq, keys, len(prompt)) if req.use_cache else 0
            self.cache.mark_computed(seq, hit * b)
            first = greedy_token(self.model.prefill(seq, self.cache, prompt))
            nonce = uuid.uuid4().hex[:8]
            block_keys, saved = self._hand_over(req, seq, keys, hit, nonce)
            tail_key = ""
            if len(prompt) % b:
                tail_key = transfer_key(req.request_id, nonce, "tail")
                self.kv.put(tail_key, self.cache.page(seq.page_ids[-1]))
        finally:
            self.cache.free(seq)
        self.counters["requests"] += 1
        self.counters["hit_blocks"] += hit
        self.counters["saved_blocks"] += saved
        return spb.PrefillResponse(
            first_token=first, cached_tokens=hit * b, saved_blocks=saved, tail_key=tail_key,
            block_keys=block_keys, hit_blocks=hit, total_blocks=len(keys),
            queue_ms=(started - submitted_s) * 1000, compute_ms=(time.perf_counter() - started) * 1000)

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

    def _hand_over(self, req, seq: Sequence, keys: list[str], hit: int, nonce: str
                   ) -> tuple[list[str], int]:
        """Make every full block readable by decode; returns (block keys, blocks saved)."""
        pages = [self.cache.page(p) for p in seq.page_ids[:len(keys)]]
        block_keys = list(keys)
        saved = 0
        todo = list(range(hit, len(keys))) if req.use_cache else []
        if todo:
            res = self.kv.batch_put([keys[i] for i in todo], [pages[i] for i in todo],
                                    parents=[keys[i - 1] if i else None for i in todo])
            for i, err in zip(todo, res):
                if err is None:
                    saved += 1
                    continue
                if isinstance(err, KeyConflict):
                    # Same prefix, different KV bytes: the model is not deterministic
                    # or the namespace is wrong. A bug: say so loudly.
                    log.error("prefix block %s holds different KV: %s", keys[i], err)
                self.counters["save_failures"] += 1
                block_keys[i] = ""     # hand this block over by transfer key instead
        missing = [i for i, k in enumerate(block_keys) if not k] if req.use_cache else list(range(len(keys)))
        if missing:
            xkeys = [transfer_key(req.request_id, nonce, i) for i in missing]
            res = self.kv.batch_put(xkeys, [pages[i] for i in missing])
            for i, k, err in zip(missing, xkeys, res):
                if err is not None:
                    raise err
                block_keys[i] = k
        return block_keys, saved


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
        except (KVStoreError, OutOfPages, ValueError) as exc:
            code = grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(exc, (OutOfPages, NoSpace)) \
                else grpc.StatusCode.INVALID_ARGUMENT if isinstance(exc, (ValueError, InvalidArgument)) \
                else grpc.StatusCode.UNAVAILABLE
            await context.abort(code, f"prefill of {request.request_id} failed: {exc}")
        finally:
            self.queued -= 1
            self.queued_tokens -= len(request.prompt_tokens)

    async def Status(self, request, context):
        return spb.EngineStatus(instance_id=self.worker.instance_id, role="prefill",
                                queued=self.queued, queued_tokens=self.queued_tokens)


async def serve(args) -> None:
    model, cache = load_engine(args)
    kv = KVClient(args.master)
    instance_id = args.instance_id or f"prefill-{uuid.uuid4().hex[:6]}"
    servicer = PrefillServicer(PrefillWorker(model, cache, kv, namespace_of(args), instance_id))
    server = grpc.aio.server()
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    spb_grpc.add_PrefillEngineServicer_to_server(servicer, server)
    await server.start()
    await serve_until_signal(server, port, {"role": "prefill", "instance_id": instance_id,
                                            "address": f"{args.host}:{port}", "port": port},
                             on_stop=kv.close)


def main(argv: list[str] | None = None) -> None:
    args = engine_args("kvstore prefill", "Run a prefill engine.").parse_args(argv)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
