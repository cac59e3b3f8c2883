"""The simulator held against the live cluster: ``kvstore simulate-demo FILE``.

``FILE`` is what ``kvstore demo --out FILE`` wrote. Its plan (window, warm-up,
arrival clock, blocks of ``block_tokens`` tokens, instance counts) is rebuilt
exactly as the demo built it (:func:`kvstore.tools.demo.plan_demo`, which is
deterministic), and the same requests, with the same arrival times and the
output lengths the engines produced, go through the simulator
(:mod:`kvstore.tools.simulate`) with the demo's cost model (the one ``kvstore
demo`` fitted on its machine just before the run, recorded in ``FILE``), in
both modes::

    cache     one pool per prefill instance, big enough for the window, holding
              the warm-up's blocks before the first arrival (as the store did)
    no cache  pools of 0 blocks

The result sets each mode's predicted TTFT and TBT (mean, p90) beside the
measured ones, with the relative error ``predicted / measured - 1``.

What the simulator leaves out, so where a gap is expected: the conductor's and
the engines' per-request overheads beyond the cost model's prefill and decode
calls (gRPC hops, tokens and KV pages set up, the KV save), and the time the
live engines spend reading cached blocks from the store (the pool is taken to
be local). The cost model is ``kvstore profile``'s fit of those two calls.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from kvstore.conductor.cost_model import CostModel, load_cost_model
from kvstore.errors import InvalidArgument
from kvstore.tools.demo import COST_MODEL, OVERLOAD_TTFT_SLO_MS, plan_demo
from kvstore.tools.simulate import SimConfig, simulate
from kvstore.tools.trace import ScaleConfig, TraceRecord, default_trace_path, load_trace

#: The figures compared, per mode: (summary section, statistic).
COMPARED = (("ttft_ms", "mean"), ("ttft_ms", "p90"), ("tbt_ms", "mean"), ("tbt_ms", "p90"))


def _plan(demo: dict[str, Any], cost: CostModel):
    """The demo's plan, rebuilt as the demo built it, and the trace it came from."""
    name = demo.get("trace")
    path = default_trace_path("conversation")
    if name != path.name:
        raise InvalidArgument(f"the demo replayed {name!r}; simulate-demo knows the bundled "
                              f"{path.name!r} only")
    w, a = demo["window"], demo["arrivals"]
    plan = plan_demo(trace=str(path), requests=w["requests"], warmup=w["warmup"],
                     window_start=w["start"], time_scale=a["time_scale"],
                     target_utilisation=a["target_utilisation"],
                     scale=ScaleConfig(block_tokens=demo["block_tokens"]),
                     num_prefill=a["num_prefill"], cost=cost)
    return plan, load_trace(path)


def _records(plan, trace, mode: dict[str, Any]):
    """The plan's warm-up and measured requests as simulator records (demo scale), with
    the output lengths ``mode``'s engines produced."""
    outputs = {r["index"]: r["output_tokens"] for r in mode["per_request"]}
    measured = [TraceRecord(r.index, r.arrival_ms, r.num_prompt_tokens,
                            max(1, outputs.get(r.index, r.max_tokens)),
                            trace[r.index].hash_ids) for r in plan.measured]
    warm = [TraceRecord(r.index, 0, r.num_prompt_tokens, 1, trace[r.index].hash_ids[:r.num_blocks])
            for r in plan.store_warmup]
    return warm, measured


def like_demo(demo_file: str | Path, cost_model: str | None = None) -> dict[str, Any]:
    """Predicted against measured for both modes of one demo run.

    Args:
        demo_file: the JSON of ``kvstore demo --out`` (both modes).
        cost_model: a cost model name or file; None: the demo's (the one it profiled
            before its run, recorded in the file; older files: ``tiny-cpu``).

    Returns:
        ``{"cost_model", "requests", "cache": {...}, "no_cache": {...}}``, each mode
        ``{"predicted": {ttft_ms, tbt_ms, block_hit_rate}, "measured": {...},
        "error": {"ttft_ms.mean": predicted / measured - 1, ...}}``.

    Raises:
        InvalidArgument: the file is not a two-mode demo result, or of another trace.
    """
    demo = json.loads(Path(demo_file).read_text())
    if not all(k in demo for k in ("cache", "no_cache", "window", "arrivals", "block_tokens")):
        raise InvalidArgument(f"{demo_file}: not the JSON of a two-mode `kvstore demo --out`")
    if cost_model is None and isinstance(demo.get("cost_model"), dict):
        cost = CostModel.from_dict(demo["cost_model"])
    else:
        cost = load_cost_model(cost_model or demo["arrivals"].get("cost_model") or COST_MODEL)
    out: dict[str, Any] = {"cost_model": cost.name}
    plan, trace = _plan(demo, cost)
    for key, use_cache in (("cache", True), ("no_cache", False)):
        mode = demo[key]
        warm, measured = _records(plan, trace, mode)
        blocks = sum(len(r.hash_ids) for r in warm + measured)
        overload = bool(demo.get("overload"))      # the conductor refused early on a TTFT SLO
        cfg = SimConfig(scheduler="global-cache-aware", rejection="early" if overload else "none",
                        num_prefill=plan.arrivals.num_prefill, num_decode=1,
                        ttft_slo_ms=OVERLOAD_TTFT_SLO_MS if overload else math.inf,
                        tbt_slo_ms=math.inf,
                        cache_blocks=blocks if use_cache else 0, block_tokens=plan.block_tokens)
        res = simulate(measured, cfg, cost, offline=(), warm=warm if use_cache else ())
        s = res.summary()
        predicted = {"ttft_ms": s["ttft_ms"], "tbt_ms": s["tbt_ms"],
                     "block_hit_rate": res.block_hit_rate, "rejected": res.rejected}
        seen = {"ttft_ms": mode["ttft_ms"], "tbt_ms": mode["tbt_ms"],
                "block_hit_rate": mode["block_hit_rate"], "rejected": mode["rejected"]}
        error = {f"{sec}.{stat}": predicted[sec][stat] / seen[sec][stat] - 1
                 for sec, stat in COMPARED if seen[sec][stat]}
        out[key] = {"predicted": predicted, "measured": seen, "error": error}
        out["requests"] = len(measured)
    return out


def like_demo_table(result: dict[str, Any]):
    """A rich Table: per mode and figure, predicted, measured and the error."""
    from rich.table import Table

    table = Table(title=f"simulator against the demo ({result['requests']} requests, "
                        f"cost model {result['cost_model']})")
    for col in ("mode", "figure", "predicted", "measured", "error"):
        table.add_column(col, justify="left" if col in ("mode", "figure") else "right")
    for key in ("cache", "no_cache"):
        r = result[key]
        for sec, stat in COMPARED:
            err = r["error"].get(f"{sec}.{stat}")
            table.add_row(key.replace("_", " "), f"{sec.replace('_ms', '')} {stat} (ms)",
                          f"{r['predicted'][sec][stat]:.1f}", f"{r['measured'][sec][stat]:.1f}",
                          "-" if err is None else f"{100 * err:+.0f} %")
        table.add_row(key.replace("_", " "), "block hit rate",
                      f"{100 * r['predicted']['block_hit_rate']:.1f} %",
                      f"{100 * r['measured']['block_hit_rate']:.1f} %", "")
        if r["measured"]["rejected"] or r["predicted"]["rejected"]:
            table.add_row(key.replace("_", " "), "rejected", str(r["predicted"]["rejected"]),
                          str(r["measured"]["rejected"]), "")
    return table


def simulate_demo_command(
    demo_file: str = typer.Argument(..., metavar="DEMO_JSON",
                                    help="what `kvstore demo --out DEMO_JSON` wrote (both modes)"),
    cost_model: Optional[str] = typer.Option(None, "--cost-model",
                                             help="cost model JSON or bundled name (default: the demo's)"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON on stdout"),
) -> None:
    """The demo's requests through the simulator: predicted against measured, both modes.

    The table goes to stderr with ``--json``; exits 2 with the reason on a file
    it cannot use."""

    try:
        result = like_demo(demo_file, cost_model)
    except (InvalidArgument, OSError, KeyError, ValueError) as exc:
        typer.echo(f"error: {getattr(exc, 'message', None) or exc}", err=True)
        raise typer.Exit(2)
    Console(stderr=json_out).print(like_demo_table(result))
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
