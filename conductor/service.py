"""Conductor process: accepts requests, schedules prefill and decode, streams tokens.

``Generate`` (gRPC, server streaming) runs one request through the
disaggregated pipeline::

    prefix keys -> store hits -> pick prefill -> Prefill (first token: TTFT)
                -> pick decode -> Decode stream (later tokens: TBT) -> metrics

TTFT and TBT are measured here, from the moment the request reaches the
conductor. Thread safety: everything runs on the conductor's event loop;
the blocking store client is called through ``asyncio.to_thread``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time

import grpc

from client import KVClient, Namespace, prefix_keys
from conductor.scheduler import DecodeInstance, PrefillInstance, Scheduler
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.process import announce_ready, setup_logging

log = logging.getLogger(__name__)


def _ms() -> float:
    return time.perf_counter() * 1000.0


class ConductorServicer(spb_grpc.ConductorServicer):
    """Thin over :class:`Scheduler`; owns the engine stubs and the store client.

    Args:
        scheduler: instance choice.
        kv: store client (prefix hit lookups).
        namespace: the model's KV namespace (same as the engines').
        use_cache: False runs every request without reading the prefix cache.
    """

    def __init__(self, scheduler: Scheduler, kv: KVClient, namespace: Namespace,
                 use_cache: bool = True):
        self.scheduler = scheduler
        self.kv = kv
        self.namespace = namespace
        self.use_cache = use_cache
        self._prefill_stubs = {p.instance_id: spb_grpc.PrefillEngineStub(
            grpc.aio.insecure_channel(p.address)) for p in scheduler.prefill}
        self._decode_stubs = {d.instance_id: spb_grpc.DecodeEngineStub(
            grpc.aio.insecure_channel(d.address)) for d in scheduler.decode}

    async def _cached_prefix_tokens(self, prompt: list[int]) -> tuple[int, str | None]:
        keys = prefix_keys(prompt, self.namespace)
        if not keys or not self.use_cache:
            return 0, keys[0] if keys else None
        hits = await asyncio.to_thread(self.kv.batch_exists, keys)
        n = 0
        while n < len(hits) and hits[n]:
            n += 1
        return n * self.namespace.block_tokens, keys[0]

    async def Generate(self, request, context):
        t0 = _ms()
        prompt = list(request.prompt_tokens)
        metrics = spb.RequestMetrics(prompt_tokens=len(prompt))
        if not prompt or request.max_tokens < 1:
            yield spb.GenerateChunk(done=True, rejected=True, metrics=metrics,
                                    error="prompt must be non-empty and max_tokens >= 1")
            return
        try:
            cached, first_key = await self._cached_prefix_tokens(prompt)
            choice = self.scheduler.pick_prefill(len(prompt), cached, first_key)
            inst = choice.instance
            inst.queued_requests += 1
            inst.queued_tokens += choice.tokens_to_compute
            try:
                pre = await self._prefill_stubs[inst.instance_id].Prefill(spb.PrefillRequest(
                    request_id=request.request_id, prompt_tokens=prompt, use_cache=self.use_cache))
            finally:
                inst.queued_requests -= 1
                inst.queued_tokens -= choice.tokens_to_compute
            t_first = _ms()
            metrics.ttft_ms = t_first - t0
            metrics.cached_tokens = pre.cached_tokens
            metrics.saved_blocks = pre.saved_blocks
            metrics.hit_blocks = pre.hit_blocks
            metrics.total_blocks = pre.total_blocks
            metrics.queue_ms = pre.queue_ms
            metrics.prefill_ms = pre.compute_ms
            metrics.prefill_instance = inst.instance_id
            yield spb.GenerateChunk(tokens=[pre.first_token])
            produced = 1
            t_last = t_first
            if request.max_tokens > 1:
                dec = self.scheduler.pick_decode()
                metrics.decode_instance = dec.instance_id
                dec.active_requests += 1
                try:
                    stream = self._decode_stubs[dec.instance_id].Decode(spb.DecodeRequest(
                        request_id=request.request_id, prompt_tokens=prompt,
                        first_token=pre.first_token, max_tokens=request.max_tokens,
                        block_keys=pre.block_keys, tail_key=pre.tail_key))
                    async for chunk in stream:
                        if chunk.tokens:
                            produced += len(chunk.tokens)
                            t_last = _ms()
                            yield spb.GenerateChunk(tokens=chunk.tokens)
                finally:
                    dec.active_requests -= 1
            metrics.output_tokens = produced
            metrics.tbt_ms = (t_last - t_first) / (produced - 1) if produced > 1 else 0.0
            yield spb.GenerateChunk(done=True, metrics=metrics)
        except grpc.aio.AioRpcError as exc:
            log.warning("request %s failed: %s %s", request.request_id, exc.code(), exc.details())
            yield spb.GenerateChunk(done=True, metrics=metrics,
                                    error=f"{exc.code().name}: {exc.details()}")
        except RuntimeError as exc:   # no live instance
            yield spb.GenerateChunk(done=True, rejected=True, metrics=metrics, error=str(exc))


def _parse_instances(specs: list[str], cls):
    out = []
    for i, spec in enumerate(specs):
        name, _, addr = spec.rpartition("=")
        out.append(cls(instance_id=name or f"{cls.__name__[:1].lower()}{i}", address=addr))
    return out


async def serve(args) -> None:
    from engines.namespace import namespace_for_model

    namespace = namespace_for_model(args.model, args.block_tokens)
    scheduler = Scheduler(_parse_instances(args.prefill, PrefillInstance),
                          _parse_instances(args.decode, DecodeInstance))
    kv = KVClient(args.master)
    server = grpc.aio.server()
    port = server.add_insecure_port(f"{args.host}:{args.port}")
    spb_grpc.add_ConductorServicer_to_server(
        ConductorServicer(scheduler, kv, namespace, use_cache=not args.no_cache), server)
    await server.start()
    announce_ready({"role": "conductor", "address": f"{args.host}:{port}", "port": port})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)
    kv.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="kvstore conductor", description="Run the conductor.")
    p.add_argument("--master", required=True)
    p.add_argument("--prefill", action="append", required=True,
                   help="prefill engine as [ID=]host:port (repeatable)")
    p.add_argument("--decode", action="append", required=True,
                   help="decode engine as [ID=]host:port (repeatable)")
    p.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face style folder")
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--no-cache", action="store_true", help="never read the prefix cache")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
