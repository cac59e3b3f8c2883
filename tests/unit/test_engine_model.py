"""The decoder against Hugging Face transformers' LlamaForCausalLM (float32)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvstore.client.models import ModelConfig
from kvstore.engines.kv_cache import PagedKVCache, Sequence
from kvstore.engines.model import LlamaModel

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


def _hf_model(tmp_path, tie: bool = False):
    """A small random HF Llama saved as safetensors; returns (hf_model, folder)."""
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, attn_implementation="eager")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    # HF's 0.02 init gives near-flat logits; use O(1) activations and
    # non-trivial norm weights so that the comparison means something.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf, tmp_path


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


@pytest.mark.parametrize("tie", [False, True])
def test_full_logits_match_hf(tmp_path, tie):
    hf, folder = _hf_model(tmp_path, tie)
    model = LlamaModel.from_pretrained(folder)
    assert model.cfg.tie_word_embeddings is tie
    tokens = torch.randint(0, 128, (41,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = _hf_logits(hf, tokens)
    ours = model.forward(tokens)
    assert ours.shape == (41, 128) and ours.dtype == torch.float32
    assert ref.abs().max() > 1.0  # not flat
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


def test_paged_prefill_and_decode_match_hf(tmp_path):
    hf, folder = _hf_model(tmp_path)
    model = LlamaModel.from_pretrained(folder)
    tokens = torch.randint(0, 128, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    cache = PagedKVCache.for_model(model.cfg, num_pages=16, page_tokens=8)
    seq = Sequence("hf")
    cache.reserve(seq, len(tokens) + 12)
    logits = model.prefill(seq, cache, tokens)  # chunks of 8, 8, 5
    torch.testing.assert_close(logits, _hf_logits(hf, tokens)[-1], atol=ATOL, rtol=0)
    for _ in range(12):  # crosses page boundaries at 24 and 32
        tokens.append(int(logits.argmax()))
        logits = model.decode([seq], cache, [tokens[-1]])[0]
        torch.testing.assert_close(logits, _hf_logits(hf, tokens)[-1], atol=ATOL, rtol=0)
    assert seq.num_computed == len(tokens)


def test_config_from_hf_dict_reads_both_rope_layouts():
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    assert ModelConfig.from_hf_dict({**base, "rope_theta": 5e5}).rope_theta == 5e5
    cfg = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default",
                                                                 "rope_theta": 1234.0}})
    assert (cfg.rope_theta, cfg.head_dim, cfg.num_kv_heads) == (1234.0, 4, 1)
    with pytest.raises(ValueError, match="rope_type"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "llama3"}})
    with pytest.raises(ValueError, match="bias"):
        ModelConfig.from_hf_dict({**base, "attention_bias": True})


def test_from_pretrained_reports_missing_weights(tmp_path):
    _hf_model(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="model.layers.2"):
        LlamaModel.from_pretrained(tmp_path)
