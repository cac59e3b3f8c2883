"""The prefill worker's save modes against a real cluster (master + store nodes).

Every mode (sync, block-streamed, layer-wise) must store the same bytes
under the same keys, hand decode a readable key for every block (prefix
key, or a transfer key when the cache refused the block), and report their
save times.
"""

from __future__ import annotations

import uuid

import pytest
import torch

from kvstore.client import KVClient, prefix_keys
from kvstore.engines.generate import greedy_token
from kvstore.engines.kv_cache import PagedKVCache, Sequence
from kvstore.engines.kv_saver import LayerwiseSaver, StreamedSaver, SyncSaver
from kvstore.engines.model import LlamaModel
from kvstore.client.models import model_config, namespace_for_model
from kvstore.client.transfer_keys import is_transfer_key
from kvstore.engines.prefill_server import PrefillWorker
from kvstore._proto import serving_pb2 as spb

BLOCK = 16
PROMPT = [(31 * i + 7) % 2048 for i in range(40 * BLOCK + 5)]   # 40 full blocks + a tail


@pytest.fixture(scope="module")
def model():
    return LlamaModel.random(model_config("tiny"))


@pytest.fixture(scope="module")
def reference(model):
    """(first token, pages [n_pages, ...]) of a plain prefill of PROMPT, no store."""
    cache = PagedKVCache.for_model(model.cfg, 64, BLOCK)
    seq = Sequence("ref")
    cache.reserve(seq, len(PROMPT))
    first = greedy_token(model.prefill(seq, cache, PROMPT))
    return first, torch.stack([cache.page(p).clone() for p in seq.page_ids])


@pytest.fixture
def kv(master):
    c = KVClient(master)
    yield c
    c.close()


def _worker(model, kv, mode: str) -> PrefillWorker:
    ns = namespace_for_model("tiny", BLOCK, salt=uuid.uuid4().hex)
    # Small streamed puts, so that several of them overlap the 40 chunks.
    saver = {"streamed": lambda: StreamedSaver(kv, min_batch=4), "sync": lambda: SyncSaver(kv),
             "layerwise": lambda: LayerwiseSaver(kv)}[mode]()
    return PrefillWorker(model, PagedKVCache.for_model(model.cfg, 64, BLOCK), kv, ns, "t",
                         saver=saver)


def _run(worker: PrefillWorker, use_cache: bool = True) -> spb.PrefillResponse:
    return worker.run(spb.PrefillRequest(request_id=uuid.uuid4().hex[:8], prompt_tokens=PROMPT,
                                         use_cache=use_cache), 0.0)


def _check_handover(kv, resp, pages) -> None:
    """Every block key and the tail key hold the reference KV."""
    assert len(resp.block_keys) == 40 and resp.tail_key
    keys = list(resp.block_keys) + [resp.tail_key]
    got = kv.batch_get(keys)
    for i, value in enumerate(got):
        assert bytes(value) == pages[i].numpy().tobytes(), f"block {i}"


@pytest.mark.parametrize("mode", ["sync", "streamed", "layerwise"])
def test_save_modes_store_the_reference_kv(model, reference, kv, mode):
    first, pages = reference
    worker = _worker(model, kv, mode)
    keys: list[str] = []
    try:
        resp = _run(worker)
        keys += list(resp.block_keys) + [resp.tail_key]
        assert resp.first_token == first
        assert resp.saved_blocks == 40 and resp.hit_blocks == 0
        assert list(resp.block_keys) == prefix_keys(PROMPT, worker.namespace)
        _check_handover(kv, resp, pages)
        assert resp.save_mode == mode and resp.save_ms > 0
        if mode != "sync":
            assert 0 < resp.save_hidden_ms <= resp.save_ms
        else:
            assert resp.save_hidden_ms == 0
        again = _run(worker)                      # now a cache hit
        keys.append(again.tail_key)
        assert again.first_token == first and again.hit_blocks == 40
        assert worker.counters["save_failures"] == 0
        assert worker.times_ms["save"] >= resp.save_ms
    finally:
        worker.close()
        kv.batch_remove(keys)


@pytest.mark.parametrize("mode", ["sync", "streamed", "layerwise"])
def test_without_the_cache_every_block_goes_by_transfer_key(model, reference, kv, mode):
    first, pages = reference
    worker = _worker(model, kv, mode)
    keys: list[str] = []
    try:
        resp = _run(worker, use_cache=False)
        keys += list(resp.block_keys) + [resp.tail_key]
        assert resp.first_token == first and resp.saved_blocks == 0
        assert all(is_transfer_key(k) for k in resp.block_keys)
        _check_handover(kv, resp, pages)
        assert not any(kv.batch_exists(prefix_keys(PROMPT, worker.namespace)))
    finally:
        worker.close()
        kv.batch_remove(keys)


@pytest.mark.parametrize("mode", ["sync", "streamed", "layerwise"])
def test_a_refused_prefix_block_is_handed_over_by_transfer_key(model, reference, kv, mode):
    first, pages = reference
    worker = _worker(model, kv, mode)
    prefix = prefix_keys(PROMPT, worker.namespace)
    # Block 5's key already holds other bytes: the save gets KeyConflict.
    kv.put(prefix[5], bytes(pages[5].numpy().nbytes))
    keys = [prefix[5]]
    try:
        resp = _run(worker)
        keys += list(resp.block_keys) + [resp.tail_key]
        assert resp.first_token == first
        assert resp.saved_blocks == 39 and worker.counters["save_failures"] == 1
        assert is_transfer_key(resp.block_keys[5])
        assert [k for i, k in enumerate(resp.block_keys) if i != 5] == \
            [k for i, k in enumerate(prefix) if i != 5]
        _check_handover(kv, resp, pages)
    finally:
        worker.close()
        kv.batch_remove(keys)


def test_streamed_demo_equals_single_process_greedy(tmp_path, model):
    """The whole pipeline with streamed saves: later requests load blocks that
    earlier ones streamed, and outputs still equal a plain greedy run."""
    import io

    from rich.console import Console

    from kvstore.engines.generate import greedy_generate
    from kvstore.tools.demo.run import run_demo
    from kvstore.tools.demo.report import output_digest
    from kvstore.tools.demo.trace import ScaleConfig, default_trace_path, load_trace, scale_trace

    n, out_tokens = 10, 4
    summary = run_demo(requests=n, trace=None, use_cache=True, out=None, time_scale=0.0,
                       block_tokens=BLOCK, max_output_tokens=out_tokens, node_dram="64MiB",
                       log_dir=str(tmp_path), console=Console(file=io.StringIO()),
                       save_mode="streamed")
    assert summary["completed"] == n and summary["hit_blocks"] > 0
    save = summary["kv_save"]
    assert save["mode"] == "streamed" and save["requests"] == n
    assert 0 < save["hidden_ms_total"] <= save["save_ms_total"]
    got = {r["index"]: r["output_digest"] for r in summary["per_request"]}
    reqs = scale_trace(load_trace(default_trace_path(), limit=n),
                       ScaleConfig(block_tokens=BLOCK, max_output_tokens=out_tokens))
    for req in reqs:
        ref = greedy_generate(model, [int(t) for t in req.prompt_tokens], req.max_tokens,
                              page_tokens=BLOCK)
        assert output_digest(ref) == got[req.index], f"request {req.index}"
