"""Tests for kvstore.conductor.cost_model: formulas, JSON files, fitting on synthetic data."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvstore.conductor.cost_model import (
    DEFAULT_COST_MODEL,
    CostModel,
    bundled_cost_models,
    fit_decode,
    fit_prefill,
    fit_transfer,
    load_cost_model,
)


def _model(**kw) -> CostModel:
    base = dict(name="t", block_tokens=4, kv_bytes_per_token=10, prefill_base_ms=5.0,
                prefill_ms_per_token=0.5, prefill_ms_per_mpair=2000.0, decode_base_ms=10.0,
                decode_ms_per_seq=1.0, decode_ms_per_kctx=3.0, transfer_base_ms=1.0,
                transfer_bytes_per_ms=100.0, decode_kv_capacity_tokens=1000, prefill_cache_bytes=400)
    base.update(kw)
    return CostModel(**base)


def test_formulas():
    m = _model()
    # 10 new after 20 cached: 10*20 + 10*10/2 = 250 pairs
    assert m.prefill_ms(10, 20) == pytest.approx(5.0 + 0.5 * 10 + 2000.0 * 250 / 1e6)
    assert m.prefill_ms(0, 100) == 0.0
    assert m.decode_step_ms(3, 2000) == pytest.approx(10.0 + 3.0 + 6.0)
    assert m.decode_step_ms(0, 0) == 0.0
    assert m.transfer_ms(500) == pytest.approx(6.0)
    assert m.block_bytes == 40
    assert m.blocks_transfer_ms(2) == pytest.approx(1.0 + 80 / 100)
    assert m.prefill_cache_blocks == 10


def test_cached_prefix_is_cheaper():
    m = load_cost_model(DEFAULT_COST_MODEL)
    assert m.prefill_ms(512, 8192) < m.prefill_ms(8192 + 512, 0)
    # fetching a block beats recomputing it on the GPU-class model
    assert m.blocks_transfer_ms(1) < m.prefill_ms(512, 0)


def test_validation():
    with pytest.raises(ValueError, match="prefill_ms_per_token"):
        _model(prefill_ms_per_token=-1.0)
    with pytest.raises(ValueError):
        _model(transfer_bytes_per_ms=0.0)
    with pytest.raises(ValueError, match="unknown"):
        CostModel.from_dict({**_model().to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="lacks"):
        d = _model().to_dict()
        del d["decode_base_ms"]
        CostModel.from_dict(d)


def test_json_roundtrip(tmp_path):
    m = _model(source={"prefill_base_ms": "made up"})
    path = tmp_path / "m.json"
    m.save(path)
    back = load_cost_model(path)
    assert back == m
    assert back.source == {"prefill_base_ms": "made up"}
    assert json.loads(path.read_text())["name"] == "t"


def test_bundled_models_document_every_number():
    names = bundled_cost_models()
    assert DEFAULT_COST_MODEL in names and "llama-65b-a800" in names
    for name in names:
        m = load_cost_model(name)
        assert m.name == name
        for field in ("kv_bytes_per_token", "prefill_ms_per_token", "decode_base_ms",
                      "transfer_bytes_per_ms", "decode_kv_capacity_tokens"):
            assert field in m.source, (name, field)


def test_unknown_model_lists_bundled():
    with pytest.raises(FileNotFoundError, match=DEFAULT_COST_MODEL):
        load_cost_model("no-such-model")


def test_fit_recovers_synthetic_coefficients():
    rng = np.random.default_rng(1)
    truth = _model()
    pre = [(n, c, truth.prefill_ms(n, c) * (1 + rng.normal(0, 0.01)))
           for n in (16, 128, 1024, 4096) for c in (0, 512, 8192)]
    dec = [(b, k, truth.decode_step_ms(b, k) * (1 + rng.normal(0, 0.01)))
           for b in (1, 8, 32) for k in (100, 5000, 40000)]
    xfer = [(n, truth.transfer_ms(n) * (1 + rng.normal(0, 0.01))) for n in (10, 1000, 10**5, 10**6)]
    p = fit_prefill(pre)
    d = fit_decode(dec)
    t = fit_transfer(xfer)
    assert p == pytest.approx((5.0, 0.5, 2000.0), rel=0.1)
    assert d == pytest.approx((10.0, 1.0, 3.0), rel=0.1)
    assert t == pytest.approx((1.0, 100.0), rel=0.1)


def test_fit_keeps_coefficients_non_negative():
    # pure linear data: the constant and the pair term must come out >= 0, not negative
    samples = [(n, 0, 0.3 * n) for n in (10, 20, 40, 80)]
    p = fit_prefill(samples)
    assert min(p) >= 0
    assert p[1] == pytest.approx(0.3, rel=1e-6)
    with pytest.raises(ValueError):
        fit_transfer([(10, 1.0)])  # too few samples


def test_the_conductor_runs_on_the_bundled_engines_profiled_model_by_default():
    from kvstore.conductor.config import BUNDLED_COST_MODEL, ConductorConfig, conductor_cost_model
    assert ConductorConfig(master="m:1", prefill=(), decode=()).cost_model == "auto"
    assert conductor_cost_model("auto", "tiny").name == BUNDLED_COST_MODEL == "tiny-cpu"
    assert conductor_cost_model("auto", "/models/llama") is None      # no profile known
    assert conductor_cost_model("none", "tiny") is None
    assert conductor_cost_model("llama2-70b-a800", "tiny").name == "llama2-70b-a800"
