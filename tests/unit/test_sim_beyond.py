"""kvstore simulate-beyond: prefetch and hot-spot replication rows on a slice of the trace."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from kvstore.conductor.cost_model import load_cost_model
from kvstore.tools.cli.cli import app
from kvstore.tools.sim.beyond import compare_beyond
from kvstore.tools.demo.trace import default_trace_path, load_trace

ROWS = ["global-cache-aware", "+ lookahead prefetch", "+ hot-spot replication", "+ both",
        "infinite cache (bound)", "infinite cache + both", "shared infinite cache (ceiling)",
        "no cache (reference)"]


def _rows(limit: int = 400):
    records = load_trace(default_trace_path("conversation"), limit=limit)
    return compare_beyond(records, load_cost_model("llama2-70b-a800"))


def test_rows_exist_and_the_bounds_hold():
    rows = {r["row"]: r for r in _rows()}
    assert list(rows) == ROWS
    for r in rows.values():
        assert r["served"] == 400  # no SLOs: every request is served
    ceiling = rows["shared infinite cache (ceiling)"]
    for name, r in rows.items():
        assert ceiling["ttft_mean_ms"] <= r["ttft_mean_ms"] * (1 + 1e-9), name
        assert ceiling["block_hit_rate"] >= r["block_hit_rate"] - 1e-12, name
    assert rows["infinite cache (bound)"]["block_hit_rate"] >= rows["global-cache-aware"]["block_hit_rate"]
    assert rows["no cache (reference)"]["block_hit_rate"] == 0
    assert rows["no cache (reference)"]["ttft_mean_ms"] > rows["global-cache-aware"]["ttft_mean_ms"]
    assert rows["shared infinite cache (ceiling)"]["transferred_blocks"] == 0
    assert rows["global-cache-aware"]["vs_global"] == 1.0


def test_deterministic():
    assert _rows(150) == _rows(150)


def test_command_json():
    res = CliRunner().invoke(app, ["simulate-beyond", "--limit", "120", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    assert [r["row"] for r in out["rows"]] == ROWS
    assert out["cost_model"] == "llama2-70b-a800" and out["prefill"] == 8
