"""The demo's warm-up: earlier trace requests that fill the store, not measured.

Before its window (:mod:`kvstore.tools.demo.window`) the cached mode puts
into the store what the ``warmup`` requests before the window would leave
there for later requests to read. Computing every warm-up prompt in full
would cost more than the window itself (on the bundled trace about 80 % of
their blocks are never read again), so :func:`store_fill` keeps, per
request, only the leading full blocks that a later request shares, and drops
a request whose kept blocks an earlier one already puts there::

    request i of the warm-up:  [b0 b1 b2 b3 b4 b5 b6]      b0..b2 shared later
    sent:                      [b0 b1 b2]                   (b3.. never read: not computed)

With the store's capacity above what the run writes (no eviction), the
window then finds exactly the blocks it would after the full warm-up.
The last ENGINE_WARMUP_REQUESTS requests before the window are sent whole, in
both modes, to get the engines past their first, slower calls.

Requests go in trace order with at most ``in_flight`` outstanding: one
computing and one queued keeps the prefill engine busy, while a later
request still finds the blocks an earlier one saved. Each asks for at most
2 tokens, so one decode step runs and removes the request's transfer keys,
as every measured request's decode does.

Thread safety: one coroutine on the caller's event loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Sequence

import grpc

from kvstore import rpc
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.tools.demo.trace import ScaledRequest, TraceRecord, intern_chains

ENGINE_WARMUP_REQUESTS = 8
"""Whole requests right before the window that warm the engines, in both modes."""

WARMUP_MAX_TOKENS = 2
"""Tokens each warm-up request generates (prefill's first, one decode step)."""


def store_fill(records: Sequence[TraceRecord], fill_end: int, until: int,
               begin: int = 0) -> list[tuple[int, int]]:
    """Which warm-up requests to send, and how many leading blocks of each.

    Args:
        records: the trace.
        begin: first warm-up request.
        fill_end: one past the last request that is cut (later ones are sent whole).
        until: one past the last request whose reads count (the window's end).

    Returns:
        ``(index, num_blocks)`` of each request of ``begin..fill_end-1`` to
        send, in trace order: its leading blocks up to the last one that a
        request of ``index+1..until-1`` shares, when they hold a block no
        earlier kept request has.
    """
    chains = intern_chains(records[begin:until])
    read_later: set[int] = set()
    keep: dict[int, int] = {}
    for i in range(len(chains) - 1, -1, -1):      # backwards: what is read after i
        chain = chains[i]
        if i < fill_end - begin:
            keep[i] = next((j + 1 for j in range(len(chain) - 1, -1, -1)
                            if chain[j] in read_later), 0)
        read_later.update(chain)
    stored: set[int] = set()
    out = []
    for i in range(fill_end - begin):
        blocks = chains[i][:keep[i]]
        if blocks and not stored.issuperset(blocks):
            out.append((begin + i, len(blocks)))
            stored.update(blocks)
    return out


@dataclass(frozen=True, slots=True)
class WarmupOutcome:
    """What the warm-up did."""

    requests: int  # warm-up requests sent
    errors: int  # of them, failed or rejected
    hit_blocks: int  # prompt blocks they loaded from the store
    total_blocks: int  # full prompt blocks they looked up
    duration_s: float  # wall time of the warm-up
    first_error: str  # message of the first failure ("" when none)

    def to_dict(self) -> dict:
        """JSON-ready."""
        return {"requests": self.requests, "errors": self.errors, "hit_blocks": self.hit_blocks,
                "total_blocks": self.total_blocks, "duration_s": self.duration_s,
                "first_error": self.first_error}


async def warm_up(conductor: str, requests: Sequence[ScaledRequest], in_flight: int = 2,
                  timeout_s: float = 300.0) -> WarmupOutcome:
    """Send ``requests`` to the conductor at ``conductor`` (host:port) in order,
    at most ``in_flight`` at a time, each generating WARMUP_MAX_TOKENS tokens.

    Failures are counted, not raised: the caller decides whether a warm-up
    with errors still makes a fair comparison.
    """
    run_id = uuid.uuid4().hex[:8]
    gate = asyncio.Semaphore(max(in_flight, 1))
    hits = total = errors = 0
    first_error = ""

    async def one(stub, req: ScaledRequest) -> None:
        nonlocal hits, total, errors, first_error
        error = ""
        try:
            call = stub.Generate(spb.GenerateRequest(
                request_id=f"warmup-{run_id}-{req.index}",
                prompt_tokens=[int(t) for t in req.prompt_tokens],
                max_tokens=min(req.max_tokens, WARMUP_MAX_TOKENS)), timeout=timeout_s)
            async for chunk in call:
                if chunk.done:
                    error = chunk.error or ("rejected" if chunk.rejected else "")
                    hits += chunk.metrics.hit_blocks
                    total += chunk.metrics.total_blocks
        except grpc.aio.AioRpcError as exc:
            error = f"{exc.code().name}: {exc.details()}"
        finally:
            gate.release()
        if error:
            errors += 1
            first_error = first_error or f"request {req.index}: {error}"

    t0 = time.perf_counter()
    async with rpc.aio_channel(conductor) as channel:
        stub = spb_grpc.ConductorStub(channel)
        tasks = []
        for req in requests:
            await gate.acquire()    # in trace order: the next starts when one ends
            tasks.append(asyncio.create_task(one(stub, req)))
        await asyncio.gather(*tasks)
    return WarmupOutcome(len(requests), errors, hits, total, time.perf_counter() - t0,
                         first_error)


__all__ = ["ENGINE_WARMUP_REQUESTS", "WARMUP_MAX_TOKENS", "WarmupOutcome", "store_fill", "warm_up"]
