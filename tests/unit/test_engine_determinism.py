"""Bit-identity: cached vs computed prefill, batch-invariant decode, reproducibility."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from kvstore.client.models import ModelConfig
from kvstore.engines.generate import greedy_generate, greedy_token
from kvstore.engines.kv_cache import PagedKVCache, Sequence
from kvstore.engines.model import LlamaModel, max_cached_blocks

P = 16


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.random(ModelConfig.tiny())


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 2048, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _prefilled(model, tokens, num_pages=16, shift=0):
    """A cache and sequence with ``tokens`` prefilled; ``shift`` pages taken first."""
    cache = PagedKVCache.for_model(model.cfg, num_pages, P)
    cache.reserve(Sequence("filler"), shift * P)
    seq = Sequence("s")
    cache.reserve(seq, len(tokens) + 8)
    return cache, seq, model.prefill(seq, cache, tokens)


@pytest.mark.parametrize("n", [53, 48])
def test_prefill_with_cached_pages_is_bit_identical(model, n):
    tokens = _prompt(n, seed=n)
    ref_cache, ref_seq, ref_logits = _prefilled(model, tokens)
    for k in range(1, max_cached_blocks(n, P) + 1):
        cache = PagedKVCache.for_model(model.cfg, 16, P)
        cache.reserve(Sequence("filler"), 3 * P)  # different page ids than the reference
        seq = Sequence("c")
        cache.reserve(seq, n)
        for b in range(k):  # "load from the store"
            cache.page(seq.page_ids[b]).copy_(ref_cache.page(ref_seq.page_ids[b]))
        cache.mark_computed(seq, k * P)
        saved = []
        logits = model.prefill(seq, cache, tokens, on_block=lambda b, p: saved.append((b, p)))
        assert torch.equal(logits, ref_logits)
        assert saved == [(b, seq.page_ids[b]) for b in range(k, n // P)]
        for b in range(cache.pages_for(n)):
            assert torch.equal(cache.page(seq.page_ids[b]), ref_cache.page(ref_seq.page_ids[b]))


def test_prefill_rejects_unaligned_start(model):
    cache = PagedKVCache.for_model(model.cfg, 4, P)
    seq = Sequence("u")
    cache.reserve(seq, 40)
    cache.mark_computed(seq, 5)
    with pytest.raises(ValueError, match="multiple of page_tokens"):
        model.prefill(seq, cache, _prompt(40, 0))


def test_decode_is_batch_invariant(model):
    # Five rows: on this CPU a plain [M, in] @ [in, out] changes a row's bits from M = 4 on.
    lengths, steps = (7, 16, 38, 3, 25), 20

    def run(batch: list[int]) -> dict[int, list[torch.Tensor]]:
        cache = PagedKVCache.for_model(model.cfg, 16, P)
        seqs, last = {}, {}
        for i in batch:
            seq = Sequence(str(i))
            cache.reserve(seq, lengths[i] + steps)
            last[i] = greedy_token(model.prefill(seq, cache, _prompt(lengths[i], i)))
            seqs[i] = seq
        out = {i: [] for i in batch}
        for _ in range(steps):
            logits = model.decode([seqs[i] for i in batch], cache, [last[i] for i in batch])
            for row, i in enumerate(batch):
                out[i].append(logits[row])
                last[i] = greedy_token(logits[row])
        return out

    batched = run([2, 0, 4, 1, 3])
    assert len(batched[2]) == steps
    for i in range(len(lengths)):
        alone = run([i])[i]
        assert all(torch.equal(a, b) for a, b in zip(alone, batched[i]))


def test_disaggregated_run_equals_greedy_generate(model):
    """Prefill in one cache (partly from "stored" pages), decode in another, batched."""
    tokens, max_tokens = _prompt(45, 9), 12
    ref = greedy_generate(model, tokens, max_tokens, page_tokens=P)
    stored, stored_seq, _ = _prefilled(model, tokens[:32])  # an earlier request's blocks
    # Prefill engine.
    pre = PagedKVCache.for_model(model.cfg, 8, P)
    pseq = Sequence("p")
    pre.reserve(pseq, len(tokens))
    for b in range(2):
        pre.page(pseq.page_ids[b]).copy_(stored.page(stored_seq.page_ids[b]))
    pre.mark_computed(pseq, 2 * P)
    first = greedy_token(model.prefill(pseq, pre, tokens))
    # Decode engine: full blocks and the tail page arrive as objects.
    dec = PagedKVCache.for_model(model.cfg, 16, P)
    other, other_last = Sequence("o"), 0
    dec.reserve(other, 64)
    other_last = greedy_token(model.prefill(other, dec, _prompt(20, 1)))
    dseq = Sequence("d")
    dec.reserve(dseq, len(tokens) + max_tokens)
    for b in range(pre.pages_for(len(tokens))):
        dec.page(dseq.page_ids[b]).copy_(pre.page(pseq.page_ids[b]))
    dec.mark_computed(dseq, len(tokens))
    out = [first]
    while len(out) < max_tokens:
        logits = model.decode([other, dseq], dec, [other_last, out[-1]])
        other_last = greedy_token(logits[0])
        out.append(greedy_token(logits[1]))
    assert out == ref


def test_greedy_generate_is_deterministic(model):
    tokens = _prompt(30, 4)
    a = greedy_generate(model, tokens, 16)
    assert a == greedy_generate(model, tokens, 16)
    assert len(a) == 16 and len(set(a)) > 1


def test_random_weights_identical_across_processes(model):
    code = ("from kvstore.client.models import ModelConfig; from kvstore.engines.model import LlamaModel; "
            "print(LlamaModel.random(ModelConfig.tiny()).fingerprint())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == model.fingerprint()
    assert LlamaModel.random(ModelConfig.tiny(seed=1)).fingerprint() != model.fingerprint()


def test_prefill_and_decode_do_not_depend_on_thread_count(model):
    """Engine processes may run with different torch thread counts."""
    tokens = _prompt(37, 5)  # chunks of 16, 16, 5 rows

    def run() -> list[torch.Tensor]:
        cache, seq, logits = _prefilled(model, tokens)
        return [logits, model.decode([seq], cache, [1])[0], cache.data.clone()]

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(max(threads, 2))
        many = run()
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, many))
