"""Tests for kvstore.conductor.live_state: the live conductor keeps the scheduler's inputs
by the simulator's rules, and records each decision with the state it came from."""

from __future__ import annotations

import json
import math

import pytest

from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.instances import DecodeInstance, PrefillInstance, RejectReason, SchedRequest
from kvstore.conductor.live_state import DecisionLog, PrefillQueues, SharedStoreView
from kvstore.conductor.rejection import DecodeForecaster, Slo
from kvstore.conductor.scheduler import Scheduler

# 4-token blocks, prefill 1 ms per token, decode steps of 10 ms + 10 ms per sequence.
COST = CostModel(name="unit", block_tokens=4, kv_bytes_per_token=10, prefill_base_ms=0.0,
                 prefill_ms_per_token=1.0, prefill_ms_per_mpair=0.0, decode_base_ms=10.0,
                 decode_ms_per_seq=10.0, decode_ms_per_kctx=0.0, transfer_base_ms=0.0,
                 transfer_bytes_per_ms=40.0, decode_kv_capacity_tokens=1000, prefill_cache_bytes=0)
KEYS = tuple(f"k{i}" for i in range(10))


def test_prefill_queues_follow_the_simulators_rules():
    p = PrefillInstance("p")
    q = PrefillQueues()
    a = q.dispatched(p, 100.0, now_ms=1000.0)          # idle: starts now
    assert (p.busy_until_ms, p.queued_ms) == (1100.0, 0.0)
    b = q.dispatched(p, 50.0, now_ms=1010.0)           # busy: queued
    c = q.dispatched(p, 30.0, now_ms=1020.0)
    assert (p.busy_until_ms, p.queued_ms) == (1100.0, 80.0)
    q.answered(p, c, now_ms=1030.0)                    # out of turn (failed): leaves the queue
    assert (p.busy_until_ms, p.queued_ms) == (1100.0, 50.0)
    q.answered(p, a, now_ms=1120.0)                    # the running one ended late: b starts now
    assert (p.busy_until_ms, p.queued_ms) == (1170.0, 0.0)
    q.answered(p, b, now_ms=1160.0)
    assert (p.busy_until_ms, p.queued_ms) == (1160.0, 0.0)
    q.answered(p, b, now_ms=2000.0)                    # twice: nothing
    assert p.busy_until_ms == 1160.0


def test_queued_work_is_scaled_by_the_measured_service_ratio():
    p = PrefillInstance("p")
    q = PrefillQueues()
    a = q.dispatched(p, 100.0, now_ms=0.0)
    q.answered(p, a, now_ms=2000.0, service_ms=2000.0)  # 20x (a cold start): taken as 4x
    assert q.service_ratio["p"] == pytest.approx(1.0 + 0.2 * (4.0 - 1.0))
    b = q.dispatched(p, 100.0, now_ms=2100.0)
    q.dispatched(p, 50.0, now_ms=2100.0)
    assert (p.busy_until_ms, p.queued_ms) == (2260.0, 80.0)
    q.answered(p, b, now_ms=2200.0, service_ms=100.0)   # 1x: the mean moves a fifth of the way
    assert q.service_ratio["p"] == pytest.approx(1.6 + 0.2 * (1.0 - 1.6))
    assert (p.busy_until_ms, p.queued_ms) == (2280.0, 0.0)


def test_the_schedulers_choice_over_a_shared_store():
    pre = [PrefillInstance("p0"), PrefillInstance("p1")]
    view = SharedStoreView()
    s = Scheduler(pre, [DecodeInstance("d0")], cost_model=COST, cache_view=view)
    q = PrefillQueues()
    q.dispatched(pre[0], 30.0, now_ms=0.0)             # p0 busy until 30 ms
    req = SchedRequest("r", prompt_tokens=40, block_keys=KEYS)
    with view.holding(req.block_keys, 6):             # the store holds 6 blocks: 24 tokens
        d = s.schedule(req, now_ms=10.0)
    assert d.prefill.instance.instance_id == "p1"      # 0 + 16 ms against 20 + 16 ms
    assert d.prefill.tokens_to_compute == 16 and d.prefill.transfer_ms == 0.0
    assert d.prefill.estimated_ttft_ms == pytest.approx(16.0)
    assert view.prefix_blocks("p0", KEYS) == 0         # released after the decision
    q.dispatched(pre[1], 60.0, now_ms=10.0)            # p1 until 70; p0 until 30
    assert s.schedule(SchedRequest("r2", 40, KEYS), now_ms=20.0).prefill.instance.instance_id == "p0"


def test_early_rejection_and_no_instance():
    pre = [PrefillInstance("p0")]
    s = Scheduler(pre, [DecodeInstance("d0")], cost_model=COST, rejection="early",
                  slo=Slo(ttft_ms=50.0, tbt_ms=math.inf), cache_view=SharedStoreView())
    PrefillQueues().dispatched(pre[0], 40.0, now_ms=0.0)
    d = s.schedule(SchedRequest("r", prompt_tokens=20), now_ms=0.0)     # 40 + 20 > 50
    assert d.rejection.reason is RejectReason.TTFT_SLO
    pre[0].alive = False
    assert s.schedule(SchedRequest("r", prompt_tokens=1), 0.0).rejection.reason is RejectReason.NO_INSTANCE
    with pytest.raises(ValueError):
        Scheduler([], [DecodeInstance("d0")])


def test_forecast_snapshot_restores_the_same_forecasts():
    dec = [DecodeInstance("d0"), DecodeInstance("d1")]
    f = DecodeForecaster(dec)
    for i in range(70):                                # enough finishes for the survival curve
        f.decode_started(f"x{i}", "d0", float(i), 10)
        f.decode_finished(f"x{i}", "d0", float(i) + 100 + i, 5)
    f.decode_started("a", "d1", 500.0, 100)
    f.admitted("b", "d0", 700.0, 50)
    snap = json.loads(json.dumps(f.snapshot()))
    g = DecodeForecaster(dec)
    g.restore(snap)
    assert g.snapshot() == snap
    for t in (510.0, 600.0, 900.0):
        assert ([(ld.batch_size, ld.context_tokens) for ld in g.load_at(500.0, t)]
                == [(ld.batch_size, ld.context_tokens) for ld in f.load_at(500.0, t)])
    assert g.output_tokens == f.output_tokens
    with pytest.raises(KeyError):
        DecodeForecaster([DecodeInstance("other")]).restore(snap)


def test_decision_log_lines(tmp_path):
    pre = [PrefillInstance("p0"), PrefillInstance("p1")]
    s = Scheduler(pre, [DecodeInstance("d0")], cost_model=COST, cache_view=SharedStoreView())
    log = DecisionLog(tmp_path / "d.jsonl")
    req = SchedRequest("r", prompt_tokens=40, block_keys=KEYS)
    state = DecisionLog.state(s)
    log.record(s, state, req, 3, 5.0, s.schedule(req, 5.0))
    log.close()
    header, line = [json.loads(x) for x in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert header["header"]["policy"] == "global-cache-aware"
    assert header["header"]["slo"] == {"ttft_ms": "inf", "tbt_ms": "inf"}
    assert header["header"]["cost_model"]["name"] == "unit"
    assert line["blocks"] == 10 and line["cached_blocks"] == 3 and line["t_ms"] == 5.0
    assert [p["id"] for p in line["prefill"]] == ["p0", "p1"]
    assert line["choice"]["prefill"] == "p0" and line["choice"]["decode"] == "d0"
    assert line["forecast"]["inflight"] == {}
