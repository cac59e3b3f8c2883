"""Tests for kvstore.tools.sim.simulate and kvstore.tools.sim.cluster: determinism,
online/offline, parts."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from kvstore.conductor.cost_model import DEFAULT_COST_MODEL, load_cost_model
from kvstore.conductor.instances import DecodeInstance
from kvstore.tools.sim.cluster import DecodeBatch, LocalPool
from kvstore.tools.sim.simulate import SimConfig, simulate, simulate_command
from kvstore.tools.demo.trace import TraceRecord, default_trace_path, load_trace

COST = load_cost_model(DEFAULT_COST_MODEL)


@pytest.fixture(scope="module")
def head():
    """The first 300 requests of the conversation trace (about 2.5 minutes of it)."""
    return load_trace(default_trace_path("conversation"), limit=300)


def _key(res):
    s = res.summary()
    s.pop("wall_s")
    return json.dumps(s, sort_keys=True)


@pytest.mark.parametrize("scheduler", ["random", "global-cache-aware"])
def test_deterministic(head, scheduler):
    cfg = SimConfig(scheduler=scheduler, rejection="predictive", speed=4.0, seed=3)
    assert _key(simulate(head, cfg, COST)) == _key(simulate(head, cfg, COST))


def test_random_depends_on_seed(head):
    a = simulate(head, SimConfig(scheduler="random", seed=1, ttft_slo_ms=math.inf), COST)
    b = simulate(head, SimConfig(scheduler="random", seed=2, ttft_slo_ms=math.inf), COST)
    assert a.ttft_ms != b.ttft_ms


def test_every_scheduler_serves_the_slice(head):
    rates = {}
    for name in ("random", "load-balance", "local-cache-aware", "global-cache-aware"):
        res = simulate(head, SimConfig(scheduler=name, num_prefill=4, num_decode=2,
                                       ttft_slo_ms=math.inf, tbt_slo_ms=math.inf), COST)
        assert res.rejected == 0 and res.requests == 300
        assert res.ttft_ms["p50"] <= res.ttft_ms["p90"] <= res.ttft_ms["p99"]
        assert 0 < res.tbt_ms["mean"] < 1000
        rates[name] = res.block_hit_rate
        assert (res.transferred_blocks > 0) == (name == "global-cache-aware")
    # fetching remote prefixes reuses at least as much as any local-only policy
    assert rates["global-cache-aware"] >= max(rates.values()) - 1e-9


def test_overload_rejects_and_never_breaks_the_ttft_slo(head):
    cfg = SimConfig(num_prefill=1, num_decode=1, speed=8.0, ttft_slo_ms=20_000.0, rejection="early")
    res = simulate(head, cfg, COST)
    assert res.rejected > 0 and res.rejected_by_reason["ttft_slo"] > 0
    assert res.ttft_ms["p99"] <= 20_000.0  # admitted online requests meet their TTFT


def test_offline_is_delayed_not_rejected(head):
    cfg = SimConfig(num_prefill=2, num_decode=2, speed=4.0, offline_fraction=0.3, ttft_slo_ms=15_000.0)
    res = simulate(head, cfg, COST)
    off = res.requests - res.online
    assert off > 50
    assert res.offline_completed == off  # every offline request finished, none refused
    assert res.ttft_ms["p99"] <= 15_000.0  # online ones still met their SLO
    assert res.offline_ttft_ms["mean"] > res.ttft_ms["mean"]  # online first


def test_online_waits_at_most_one_offline_chunk():
    # one instance: a 64k-token offline prompt at t=0, a short online one at t=1 ms
    recs = [TraceRecord(0, 0, 65536, 2, tuple(range(128))),
            TraceRecord(1, 1, 1024, 2, (1000, 1001))]
    cfg = SimConfig(num_prefill=1, num_decode=1, offline_chunk_tokens=4096)
    res = simulate(recs, cfg, COST, offline={0})
    chunk_ms = COST.prefill_ms(4096, 0)
    own_ms = COST.prefill_ms(1024, 0)
    assert res.online == 1 and res.offline_completed == 1
    assert res.ttft_ms["mean"] <= chunk_ms + own_ms + 1e-6
    assert res.offline_ttft_ms["mean"] > COST.prefill_ms(65536, 0)  # chunking costs a little


def test_cli_json(head, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                          "output_length": r.output_length, "hash_ids": list(r.hash_ids)})
                              for r in head[:100]) + "\n")
    import typer

    app = typer.Typer()
    app.command()(simulate_command)
    out = CliRunner().invoke(app, ["--trace", str(path), "--scheduler", "local-cache-aware",
                                   "--rejection", "early", "--prefill", "2", "--decode", "2",
                                   "--speed", "2", "--json"])
    assert out.exit_code == 0, out.output
    summary = json.loads(out.stdout[out.stdout.index("{"):])
    for key in ("scheduler", "rejection", "requests", "rejected", "ttft_ms", "tbt_ms", "block_hit_rate"):
        assert key in summary
    assert set(summary["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert summary["requests"] == 100 and summary["scheduler"] == "local-cache-aware"
    bad = CliRunner().invoke(app, ["--trace", str(path), "--scheduler", "fifo"])
    assert bad.exit_code == 2


# ---------------------------------------------------------------- parts


def test_pool_capacity_pins_and_prefix():
    pool = LocalPool(4, "lru")
    assert pool.store(["a", "b", "c"], 1.0) == 3
    assert pool.prefix_blocks(["a", "b", "x"]) == 2
    pool.pin(["a"])
    pool.store(["d", "e", "f"], 2.0)  # needs 2 more slots: b and c go, a is pinned
    assert pool.keys == {"a", "d", "e", "f"}
    pool.unpin(["a"])
    assert pool.pins == {}
    assert len(pool.keys) <= 4


def test_pool_stops_at_the_first_gap():
    pool = LocalPool(2, "default")
    pool.pin(["x", "y"])
    pool.store(["x", "y"], 0.0)
    assert pool.store(["p", "q"], 1.0) == 0  # everything pinned: nothing fits


def test_decode_batch_fluid_timing():
    cm = COST.with_overrides(decode_base_ms=10.0, decode_ms_per_seq=0.0, decode_ms_per_kctx=0.0)
    inst = DecodeInstance("d0")
    b = DecodeBatch(inst, cm)
    b.add("a", 0.0, prompt_tokens=100, decode_tokens=10)
    assert inst.active_requests == 1
    assert b.next_finish_ms() == pytest.approx(100.0)
    b.add("b", 50.0, prompt_tokens=100, decode_tokens=2)  # 5 tokens of a done at 50 ms
    assert inst.context_tokens == 205
    assert b.next_finish_ms() == pytest.approx(70.0)
    done = b.pop_finished(70.0, lambda item: 100)
    assert [(i, round(t, 6)) for i, _, t in done] == [("b", 10.0)]
    assert b.next_finish_ms() == pytest.approx(100.0)
    done = b.pop_finished(100.0, lambda item: 100)
    assert done[0][0] == "a" and done[0][2] == pytest.approx(10.0)
    assert len(b) == 0 and inst.active_requests == 0 and b.next_finish_ms() is None


def test_offline_waits_for_decode_room_without_duplicates():
    # decode holds 10,000 KV tokens: the three offline requests must take turns
    cm = COST.with_overrides(decode_kv_capacity_tokens=10_000)
    recs = [TraceRecord(i, i, 4000, 50, (10 * i, 10 * i + 1)) for i in range(3)]
    res = simulate(recs, SimConfig(num_prefill=3, num_decode=1), cm, offline={0, 1, 2})
    assert res.offline_completed == 3 and res.rejected == 0
