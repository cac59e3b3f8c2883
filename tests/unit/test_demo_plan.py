"""The demo's plan, without a cluster: the window, the arrival rate, the warm-up cut."""

from __future__ import annotations

import pytest

from kvstore.conductor.cost_model import load_cost_model
from kvstore.errors import InvalidArgument
from kvstore.tools.demo.arrivals import plan_arrivals, retime
from kvstore.tools.demo.warmup import store_fill
from kvstore.tools.demo.window import pick_window, prefix_hits
from kvstore.tools.demo.trace import ScaleConfig, TraceRecord, intern_chains, scale_trace


def _rec(i: int, t_ms: int, ids: tuple[int, ...]) -> TraceRecord:
    return TraceRecord(index=i, timestamp_ms=t_ms, input_length=512 * len(ids), output_length=64,
                       hash_ids=ids)


# Requests 0-3 share nothing; 4-7 each repeat the prefix of the one 4 before.
TRACE = [_rec(i, 1000 * i, (100 + i, 200 + i)) for i in range(4)] + \
        [_rec(4 + i, 1000 * (4 + i), (100 + i, 200 + i, 300 + i)) for i in range(4)]


def test_prefix_hits_count_only_the_counted_requests():
    chains = intern_chains(TRACE)
    assert prefix_hits(chains, 0, 0, 4) == (0, 8)
    assert prefix_hits(chains, 0, 4, 8) == (8, 12)      # warmed by 0..3
    assert prefix_hits(chains, 4, 4, 8) == (0, 12)      # no warm-up: cold


def test_the_window_with_reuse_closest_to_the_whole_trace_is_picked():
    w = pick_window(TRACE, num_requests=4, warmup=4, step=1)
    assert (w.start, w.warmup, w.chosen) == (4, 4, True)
    assert w.hit_rate == pytest.approx(8 / 12)
    assert w.trace_hit_rate == pytest.approx(8 / 20)
    given = pick_window(TRACE, num_requests=4, warmup=0, start=0)
    assert (given.start, given.warmup, given.chosen, given.hit_rate) == (0, 0, False, 0.0)
    with pytest.raises(InvalidArgument):
        pick_window(TRACE, num_requests=4, warmup=0, start=6)


def test_the_rate_is_the_target_share_of_the_no_cache_capacity():
    cost = load_cost_model("tiny-cpu")
    recs = TRACE[4:]
    reqs = scale_trace(recs, ScaleConfig(block_tokens=16))
    plan = plan_arrivals(recs, reqs, cost, num_prefill=1, target_utilisation=0.5)
    mean_ms = sum(cost.prefill_ms(r.num_prompt_tokens) for r in reqs) / len(reqs)
    assert plan.capacity_rps == pytest.approx(1000 / mean_ms)
    assert plan.rate_rps == pytest.approx(0.5 * plan.capacity_rps)
    timed = retime(reqs, recs, plan.time_scale)
    assert timed[0].arrival_ms == 0
    assert (len(timed) - 1) / (timed[-1].arrival_ms / 1000) == pytest.approx(plan.rate_rps)
    given = plan_arrivals(recs, reqs, cost, time_scale=0.0)
    assert not given.derived and given.describe().startswith("all at once")


def test_the_warm_up_keeps_only_blocks_read_later_and_each_once():
    trace = [_rec(0, 0, (1, 2, 3)), _rec(1, 1, (1, 2, 4)), _rec(2, 2, (1, 5)),
             _rec(3, 3, (9,)), _rec(4, 4, (1, 2, 3, 7))]
    # 0: (1,2,3) read by 4; 1: (1,2) already kept by 0; 2: (1) too; 3: never read
    assert store_fill(trace, fill_end=4, until=5) == [(0, 3)]
    # Reads stop at 3: 0 shares (1, 2) with 1; 1 shares (1) with 2, which 0 already keeps.
    assert store_fill(trace, fill_end=2, until=3) == [(0, 2)]
