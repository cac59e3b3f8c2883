"""Trace replay against a running conductor: arrivals on the trace's clock.

Each scaled trace request is sent to the conductor's ``Generate`` at its
(scaled) arrival time; tokens stream back; the conductor's per-request
metrics (TTFT, TBT, cached tokens) and the output digest are collected
into :class:`kvstore.tools.demo.report.RequestResult` rows. A progress bar shows the run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Optional

import grpc
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstore import rpc
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.tools.demo.report import RequestResult, output_digest
from kvstore.tools.demo.trace import ScaledRequest


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    results: list[RequestResult]
    duration_s: float
    hit_blocks: int       # full prompt blocks whose KV came from the store
    total_blocks: int     # full prompt blocks of completed requests

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


async def _dispatch(requests: list[ScaledRequest], go: list[asyncio.Future], t0: float) -> None:
    """Releases each request at its arrival time, in arrival order (trace order among
    equal times): one sleeper, so a burst of equal arrival times reaches the
    conductor in the order the trace (and the simulator) has it."""
    for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms):
        delay = requests[i].arrival_ms / 1000.0 - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        if not go[i].done():
            go[i].set_result(None)


async def _one(stub, req: ScaledRequest, run_id: str, go: asyncio.Future, timeout_s: float
               ) -> tuple[RequestResult, int, int]:
    await go
    result = RequestResult(index=req.index, prompt_tokens=len(req.prompt_tokens))
    tokens: list[int] = []
    hits = total = 0
    try:
        call = stub.Generate(spb.GenerateRequest(
            request_id=f"{run_id}-{req.index}", prompt_tokens=[int(t) for t in req.prompt_tokens],
            max_tokens=req.max_tokens), timeout=timeout_s)
        async for chunk in call:
            tokens.extend(chunk.tokens)
            if chunk.done:
                m = chunk.metrics
                result.rejected = chunk.rejected
                result.error = None if chunk.rejected else (chunk.error or None)
                result.cached_tokens = m.cached_tokens
                result.prefill_instance = m.prefill_instance or None
                result.decode_instance = m.decode_instance or None
                if not chunk.error and not chunk.rejected:
                    result.ttft_ms = m.ttft_ms
                    result.prefill_ms, result.prefill_queue_ms = m.prefill_ms, m.queue_ms
                    result.tbt_ms = m.tbt_ms if m.output_tokens > 1 else None
                hits, total = m.hit_blocks, m.total_blocks
        if result.error is None and not result.rejected and len(tokens) != req.max_tokens:
            result.error = f"got {len(tokens)} tokens, expected {req.max_tokens}"
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    result.output_tokens = len(tokens)
    result.output_digest = output_digest(tokens)
    return result, hits, total


async def replay(conductor: str, requests: list[ScaledRequest], *, timeout_s: float = 300.0,
                 show_progress: bool = True,
                 creds: rpc.ClientCredentials | None = None) -> ReplayOutcome:
    """Replay ``requests`` against the conductor at ``conductor`` (host:port), with
    ``creds`` (a ``client`` token, TLS files) when it is secured."""
    run_id = uuid.uuid4().hex[:8]
    async with rpc.aio_channel(conductor, creds) as channel:
        stub = spb_grpc.ConductorStub(channel)
        t0 = time.perf_counter()
        with Progress(TextColumn("[bold]replay"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                      disable=not show_progress, transient=False) as progress:
            task = progress.add_task("replay", total=len(requests), status="")
            errors = 0
            loop = asyncio.get_running_loop()
            go = [loop.create_future() for _ in requests]
            tasks = [asyncio.create_task(_one(stub, r, run_id, g, timeout_s))
                     for r, g in zip(requests, go)]
            dispatcher = asyncio.create_task(_dispatch(requests, go, t0))
            done = []
            try:
                for fut in asyncio.as_completed(tasks):
                    res = await fut
                    done.append(res)
                    errors += res[0].error is not None
                    progress.update(task, advance=1, status=f"errors {errors}")
            finally:
                dispatcher.cancel()
                for t in tasks:
                    t.cancel()
        duration = time.perf_counter() - t0
    done.sort(key=lambda x: x[0].index)
    ok = [(h, t) for r, h, t in done if r.error is None and not r.rejected]
    return ReplayOutcome(results=[r for r, _, _ in done], duration_s=duration,
                         hit_blocks=sum(h for h, _ in ok), total_blocks=sum(t for _, t in ok))


def replay_command(
    conductor: Annotated[str, typer.Option(help="the conductor's gRPC address host:port")],
    requests: Annotated[int, typer.Option("--requests", "-n", help="first N requests")] = 200,
    trace: Annotated[Optional[str], typer.Option(help="trace JSONL (default: bundled "
                                                      "conversation trace)")] = None,
    out: Annotated[Optional[str], typer.Option(help="write the JSON summary here")] = None,
    time_scale: Annotated[float, typer.Option(help="arrival-time multiplier")] = 0.25,
    block_tokens: Annotated[int, typer.Option(help="tokens per KV block")] = 16,
    max_output_tokens: Annotated[int, typer.Option(help="cap on generated tokens")] = 16,
    token_file: Annotated[Optional[str], typer.Option(
        help="a client token (default: $KVSTORE_TOKEN / $KVSTORE_TOKEN_FILE); TLS from "
             "$KVSTORE_TLS_CA, _CERT, _KEY")] = None,
) -> None:
    """Replay the trace against a running conductor (e.g. another host's); the summary
    is ``kvstore demo``'s, so output digests can be compared between runs."""
    import json
    from pathlib import Path

    from rich.console import Console

    from kvstore.tools.demo.report import render_summary, summarize
    from kvstore.tools.demo.trace import ScaleConfig, default_trace_path, load_trace, scale_trace

    path = Path(trace) if trace else default_trace_path("conversation")
    reqs = scale_trace(load_trace(path, limit=requests),
                       ScaleConfig(block_tokens=block_tokens, time_scale=time_scale,
                                   max_output_tokens=max_output_tokens))
    try:
        creds = rpc.ClientCredentials.resolve(token_file=token_file)
    except OSError as exc:
        typer.echo(f"kvstore replay: error: {exc}", err=True)
        raise typer.Exit(2)
    outcome = asyncio.run(replay(conductor, reqs, creds=creds))
    summary = summarize(outcome.results, outcome.duration_s,
                        block_hit_rate=outcome.block_hit_rate, total_blocks=outcome.total_blocks,
                        hit_blocks=outcome.hit_blocks, mode="cache")
    summary["trace"] = path.name
    summary["block_tokens"] = block_tokens
    console = Console()
    console.print(render_summary(summary))
    if out:
        Path(out).write_text(json.dumps(summary, indent=2))
        console.print(f"summary written to {out}")
    if summary["errors"]:
        first = next((r.error for r in outcome.results if r.error is not None), "")
        console.print(f"{summary['errors']} request(s) failed; the first: {first}", markup=False)
        raise typer.Exit(1)
