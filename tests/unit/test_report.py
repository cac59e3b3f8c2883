"""Tests for kvstore.tools.demo.report: replay results, summary and tables."""

from __future__ import annotations

import json

import numpy as np
import pytest
import xxhash
from rich.console import Console
from rich.table import Table

from kvstore.tools.demo.report import (
    RequestResult,
    mismatched_outputs,
    output_digest,
    render_comparison,
    render_summary,
    summarize,
)


def _render(table: Table) -> str:
    console = Console(width=160, record=True, color_system=None)
    console.print(table)
    return console.export_text()


def test_output_digest_encoding():
    expected = xxhash.xxh64_hexdigest(b"\x01\x00\x00\x00\x02\x01\x00\x00")
    assert output_digest([1, 258]) == expected
    assert output_digest(np.array([1, 258], dtype=np.int64)) == expected
    assert output_digest(np.array([1, 258], dtype=">u4")) == expected
    assert output_digest(iter([1, 258])) == expected
    assert output_digest([]) == xxhash.xxh64_hexdigest(b"")
    assert output_digest([1, 2]) != output_digest([2, 1])
    with pytest.raises(ValueError):
        output_digest([-1])


def _results() -> list[RequestResult]:
    return [
        RequestResult(0, prompt_tokens=100, cached_tokens=32, output_tokens=10, ttft_ms=10.0, tbt_ms=1.0,
                      output_digest=output_digest(range(10)), prefill_instance="p0", decode_instance="d0"),
        RequestResult(1, prompt_tokens=50, cached_tokens=0, output_tokens=5, ttft_ms=20.0, tbt_ms=2.0,
                      output_digest=output_digest(range(5))),
        RequestResult(2, prompt_tokens=70, cached_tokens=16, output_tokens=1, ttft_ms=40.0, tbt_ms=None,
                      output_digest=output_digest([7])),
        RequestResult(3, prompt_tokens=80, rejected=True),
        RequestResult(4, prompt_tokens=90, cached_tokens=64, error="decode instance died"),
    ]


def test_summarize_counts_and_stats():
    s = summarize(_results(), 2.0, block_hit_rate=0.25, total_blocks=40, hit_blocks=10, mode="cached")
    assert s["mode"] == "cached"
    assert (s["requests"], s["completed"], s["rejected"], s["errors"]) == (5, 3, 1, 1)
    assert (s["block_hit_rate"], s["hit_blocks"], s["total_blocks"]) == (0.25, 10, 40)
    assert s["prefill_tokens_saved"] == 48  # completed requests only
    assert s["ttft_ms"]["mean"] == pytest.approx(70 / 3)
    assert s["ttft_ms"]["p50"] == 20.0
    assert s["ttft_ms"]["p90"] == pytest.approx(36.0)  # linear: 20 + 0.8 * 20
    assert s["ttft_ms"]["p99"] == pytest.approx(39.6)
    assert s["tbt_ms"] == {"mean": 1.5, "p50": 1.5, "p90": pytest.approx(1.9), "p99": pytest.approx(1.99)}
    assert s["throughput_tokens_per_s"] == pytest.approx((220 + 16) / 2.0)
    assert s["duration_s"] == 2.0
    assert [r["index"] for r in s["per_request"]] == [0, 1, 2, 3, 4]
    assert set(s["per_request"][0]) >= {
        "index", "cached_tokens", "output_digest", "ttft_ms", "tbt_ms", "output_tokens", "error", "rejected",
    }
    assert s["per_request"][3]["rejected"] is True
    assert s["per_request"][4]["error"] == "decode instance died"
    json.dumps(s)  # plain JSON types only


def test_summarize_empty_is_none_safe():
    s = summarize([], 0.0, block_hit_rate=0.0, total_blocks=0, hit_blocks=0, mode="no-cache")
    assert s["completed"] == 0
    assert s["ttft_ms"] == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert s["tbt_ms"]["p99"] is None
    assert s["throughput_tokens_per_s"] is None
    assert "-" in _render(render_summary(s))


def test_summarize_all_rejected():
    results = [RequestResult(i, prompt_tokens=10, rejected=True) for i in range(3)]
    s = summarize(results, 1.0, block_hit_rate=0.0, total_blocks=0, hit_blocks=0, mode="x")
    assert (s["completed"], s["rejected"]) == (0, 3)
    assert s["ttft_ms"]["mean"] is None
    assert s["throughput_tokens_per_s"] == 0.0


def test_render_summary():
    s = summarize(_results(), 2.0, block_hit_rate=0.25, total_blocks=40, hit_blocks=10, mode="cached")
    text = _render(render_summary(s))
    assert "replay: cached" in text
    assert "25.0%" in text
    assert "23.3" in text  # TTFT mean, 1 decimal
    assert "10 / 40" in text


def test_render_comparison_and_mismatches():
    cached = summarize(_results(), 2.0, block_hit_rate=0.25, total_blocks=40, hit_blocks=10, mode="cached")
    plain_results = _results()
    for r in plain_results:
        r.cached_tokens = 0
        if r.ttft_ms is not None:
            r.ttft_ms *= 2
    nocache = summarize(plain_results, 4.0, block_hit_rate=0.0, total_blocks=40, hit_blocks=0, mode="no-cache")
    assert mismatched_outputs(cached, nocache) == []
    text = _render(render_comparison(cached, nocache))
    assert "cached / no-cache" in text
    assert "0.50x" in text  # TTFT halves
    assert "outputs identical" in text

    plain_results[1].output_digest = output_digest([9])
    nocache = summarize(plain_results, 4.0, block_hit_rate=0.0, total_blocks=40, hit_blocks=0, mode="no-cache")
    assert mismatched_outputs(cached, nocache) == [1]
    text = _render(render_comparison(cached, nocache, labels=("A", "B")))
    assert "A / B" in text
    assert "1 outputs differ" in text


def test_latency_stats_of_nothing_is_none_not_zero():
    from kvstore.tools.demo.report import latency_stats

    assert latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    assert latency_stats([10.0, 20.0]) == {"mean": 15.0, "p50": 15.0, "p90": 19.0,
                                           "p99": 19.9}
