"""Tests for kvstore.tools.sim.cache: prefix-hit replay, lookahead, Belady, the CLI."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from kvstore.tools.sim.cache import (
    SimResult,
    build_workload,
    simulate,
    simulate_cache_command,
    simulate_cache_main,
)
from kvstore.tools.demo.trace import TraceRecord, default_trace_path, load_trace


def trace(*requests: list[int]) -> list[TraceRecord]:
    """Records one second apart with the given hash ids."""
    return [TraceRecord(index=i, timestamp_ms=1000 * i, input_length=512 * len(ids), output_length=1,
                        hash_ids=tuple(ids)) for i, ids in enumerate(requests)]


# r0 [1 2]: 2 misses. r1 [1 2 3]: hits 1, 2; inserts 3 -> full (3 blocks).
# r2 [4]: one victim needed.
#   lru:     oldest is block 1 (read first in r1) -> the chain loses its head.
#   default: leaves only -> block 3 (chain tail); belady: 3 is never used again.
# r3 [1 2]: lru 0 hits (1 is gone, so 2 cannot count); default and belady 2 hits.
HAND = trace([1, 2], [1, 2, 3], [4], [1, 2])


@pytest.mark.parametrize("policy, hits", [("lru", 2), ("default", 4), ("belady", 4)])
def test_hand_computed_trace(policy, hits):
    res = simulate(HAND, policy, capacity_blocks=3)
    assert res == SimResult(policy=policy, capacity_blocks=3, lookahead=0,
                            hit_rate=hits / 8, hits=hits, total=8)


def test_blocks_are_prefix_chains_not_ids():
    # The same id after a different prefix is a different block.
    res = simulate(trace([1, 5], [2, 5], [1, 5]), "lru", capacity_blocks=100)
    assert (res.hits, res.total) == (2, 6)
    wl = build_workload(trace([1, 5], [2, 5]))
    assert wl.keys[0][1] != wl.keys[1][1]


def test_only_the_leading_run_counts():
    # Block [1,2] stays cached, but [1] was evicted: no prefix hit at all.
    res = simulate(trace([1, 2], [9], [1, 2]), "lru", capacity_blocks=2)
    assert res.hits == 0


def test_lookahead_protects_blocks_of_queued_requests():
    reqs = trace([1], [2], [1])
    assert simulate(reqs, "lru", capacity_blocks=1).hits == 0
    # With W=1, block 1 is needed by r2 while r1 is served: r1's block is not cached.
    res = simulate(reqs, "lru", capacity_blocks=1, lookahead=1)
    assert (res.hits, res.lookahead) == (1, 1)


def test_arguments_are_checked():
    with pytest.raises(ValueError):
        simulate(HAND, "lru", capacity_blocks=0)
    with pytest.raises(ValueError):
        simulate(HAND, "lru", capacity_blocks=3, lookahead=-1)
    with pytest.raises(KeyError):
        simulate(HAND, "nope", capacity_blocks=3)


def test_belady_bounds_every_policy_on_a_trace_slice():
    wl = build_workload(load_trace(default_trace_path("conversation"), limit=600))
    for capacity in (40, 400):
        best = simulate(wl, "belady", capacity).hits
        for policy in ("lru", "lfu", "default"):
            assert simulate(wl, policy, capacity).hits <= best, (policy, capacity)


def test_default_beats_lru_on_a_trace_slice():
    wl = build_workload(load_trace(default_trace_path("synthetic"), limit=1500))
    for capacity in (1000, 3000):
        assert simulate(wl, "default", capacity).hits >= simulate(wl, "lru", capacity).hits


def _write_trace(path, records):
    path.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                        "output_length": r.output_length, "hash_ids": list(r.hash_ids)})
                            + "\n" for r in records))


def test_main_prints_json_rows_and_writes_a_plot(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    _write_trace(path, HAND)
    plot = tmp_path / "p.png"
    results = simulate_cache_main(str(path), ["lru", "default", "belady"], [3, 2], json_out=True,
                                  plot=str(plot), jobs=1)
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["capacity_blocks"]) for r in rows] == [
        ("lru", 2), ("default", 2), ("belady", 2), ("lru", 3), ("default", 3), ("belady", 3)]
    assert rows[3] == {"policy": "lru", "capacity_blocks": 3, "lookahead": 0, "hit_rate": 0.25}
    assert [r.hit_rate for r in results] == [r["hit_rate"] for r in rows]
    pytest.importorskip("matplotlib")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_typer_command(tmp_path):
    app = typer.Typer()
    app.command("simulate-cache")(simulate_cache_command)

    @app.command("other")
    def other() -> None:  # a second command keeps typer in subcommand mode, as in kvstore's CLI
        pass

    path = tmp_path / "t.jsonl"
    _write_trace(path, HAND)
    runner = CliRunner()
    ok = runner.invoke(app, ["simulate-cache", "--trace", str(path), "-p", "lru", "-p", "default",
                             "--capacities", "3", "--plot", "", "--json", "-j", "1"])
    assert ok.exit_code == 0, ok.output
    rows = json.loads(ok.stdout)
    assert [(r["policy"], r["hit_rate"]) for r in rows] == [("lru", 0.25), ("default", 0.5)]
    bad = runner.invoke(app, ["simulate-cache", "--trace", str(path), "-p", "nope", "--plot", ""])
    assert bad.exit_code == 2 and "unknown policy" in bad.output
    bad = runner.invoke(app, ["simulate-cache", "--trace", str(path), "--capacities", "x", "--plot", ""])
    assert bad.exit_code == 2
