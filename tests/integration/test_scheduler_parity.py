"""One face of the scheduler: the live conductor's choices are the simulator's.

A real cluster (master, 2 store nodes, 2 prefill and 2 decode engines, the
conductor with a TTFT SLO and ``--decision-log``) serves three waves of
concurrent requests that share prefixes, so the choices depend on queues,
cached blocks and decode load. Every recorded decision is then recomputed by
the scheduler the simulator builds, fed the recorded state
(``kvstore.tools.sim.parity``): the prefill and decode instance, the
rejection and the estimated TTFT must be equal for every request.
"""

from __future__ import annotations

import asyncio
import json
import random

import grpc

from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.tools.cluster.launcher import ClusterSpec, LocalCluster
from kvstore.tools.sim.parity import recompute

BLOCK_TOKENS = 16


async def _generate(stub, rid: str, prompt: list[int]) -> spb.GenerateChunk:
    last = None
    async for chunk in stub.Generate(spb.GenerateRequest(request_id=rid, prompt_tokens=prompt,
                                                         max_tokens=3), timeout=60):
        if chunk.done:
            last = chunk
    return last


async def _waves(address: str) -> list[spb.GenerateChunk]:
    rng = random.Random(7)
    bases = [[rng.randrange(2048) for _ in range(96)] for _ in range(3)]
    done = []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = spb_grpc.ConductorStub(ch)
        for wave in range(3):
            prompts = [bases[i % 3] + [rng.randrange(2048) for _ in range(rng.randrange(8, 200))]
                       for i in range(6)]
            done += await asyncio.gather(*(_generate(stub, f"w{wave}-{i}", p)
                                           for i, p in enumerate(prompts)))
    return done


def test_the_live_conductors_choices_are_the_simulators(tmp_path):
    log = tmp_path / "decisions.jsonl"
    spec = ClusterSpec(num_prefill=2, num_decode=2, node_dram="64MiB", kv_pages=512,
                       block_tokens=BLOCK_TOKENS, log_dir=str(tmp_path / "logs"),
                       conductor_args=("--decision-log", str(log), "--ttft-slo-ms", "20000"))
    with LocalCluster(spec) as cluster:
        chunks = asyncio.run(_waves(cluster.conductor))
    assert all(c is not None and not c.error for c in chunks), [c.error for c in chunks if c]
    lines = [json.loads(x) for x in log.read_text().splitlines()[1:]]
    assert len(lines) == 18
    # The choices were not trivial: both prefill instances ran work, some with a
    # cached prefix, some behind queued work.
    assert {ln["choice"]["prefill"] for ln in lines} == {"prefill0", "prefill1"}
    assert any(ln["cached_blocks"] > 0 for ln in lines)
    assert any(p["busy_until_ms"] > ln["t_ms"] for ln in lines for p in ln["prefill"])
    results = recompute(log)
    assert len(results) == 18
    assert [r.request_id for r in results if not r.equal] == []
