"""End to end: the demo cluster (real processes) with and without the cache.

Greedy outputs must be identical with and without the prefix cache, and equal
to a plain single-process greedy run of the same model (no store, no RPC).
"""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvstore.engines.generate import greedy_generate
from kvstore.engines.model import LlamaModel
from kvstore.client.models import model_config
from kvstore.tools.demo.run import run_demo
from kvstore.tools.demo.report import output_digest
from kvstore.tools.demo.trace import ScaleConfig, default_trace_path, load_trace, scale_trace

N = 30


def _demo(tmp_path, use_cache: bool) -> dict:
    return run_demo(requests=N, trace=None, use_cache=use_cache, out=None, time_scale=0.0,
                    block_tokens=16, max_output_tokens=8, node_dram="128MiB",
                    log_dir=str(tmp_path / ("cache" if use_cache else "nocache")),
                    console=Console(file=io.StringIO()))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo")
    return _demo(tmp, True), _demo(tmp, False)


def test_no_errors_and_cache_hits(runs):
    cached, uncached = runs
    for s in runs:
        assert s["requests"] == N and s["completed"] == N and s["errors"] == 0
    assert cached["prefill_tokens_saved"] > 0 and cached["block_hit_rate"] > 0
    assert uncached["prefill_tokens_saved"] == 0


def test_outputs_identical_with_and_without_cache(runs):
    cached, uncached = runs
    a = {r["index"]: r["output_digest"] for r in cached["per_request"]}
    b = {r["index"]: r["output_digest"] for r in uncached["per_request"]}
    assert a == b


def test_pipeline_equals_single_process_greedy(runs):
    cached, _ = runs
    model = LlamaModel.random(model_config("tiny"))
    reqs = scale_trace(load_trace(default_trace_path(), limit=N),
                       ScaleConfig(block_tokens=16, max_output_tokens=8))
    got = {r["index"]: r["output_digest"] for r in cached["per_request"]}
    for req in reqs[:8]:   # the reference is slow-ish on 2 cores; 8 requests cover hits and misses
        ref = greedy_generate(model, [int(t) for t in req.prompt_tokens], req.max_tokens, page_tokens=16)
        assert output_digest(ref) == got[req.index], f"request {req.index}"
