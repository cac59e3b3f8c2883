"""The simulator held against the live cluster: ``kvstore simulate-demo FILE``.

``FILE`` is what ``kvstore demo --out FILE`` wrote. Its plan (window, warm-up,
arrival clock, blocks of ``block_tokens`` tokens, instance counts) is rebuilt
exactly as the demo built it (:func:`kvstore.tools.demo.run.plan_demo`, which is
deterministic), and the same requests, with the same arrival times and the
output lengths the engines produced, go through the simulator
(:mod:`kvstore.tools.sim.simulate`) with the demo's cost model (recorded in
``FILE``: the bundled profile, or one ``kvstore demo --cost-model profile``
fitted just before its run), in both modes::

    cache     one pool per prefill instance, big enough for the window, holding
              the warm-up's blocks before the first arrival (as the store did)
    no cache  pools of 0 blocks

The result sets each mode's predicted TTFT and TBT (mean, p90) beside the
measured ones, with the relative error ``predicted / measured - 1``.

Service times: the profile times the bare model call on one core; inside the
demo the prefill engine also looks up, loads and saves KV blocks and shares
two cores with the decode engine, the store and the conductor, so a request
takes longer than the profile says (1.2x-1.6x in our runs), and the queue
grows with it. The demo records each request's service time as the engine
measured it (``prefill_ms``), and ``scale`` says which level the simulated
prefill runs at (:func:`scaled_to`: the profile's prefill time multiplied by
``sum(measured) / sum(predicted)`` over a mode's requests)::

    own      (default) each mode at its own measured level: the simulator is
             given how fast the engine served that run, and predicts the
             queueing, the reuse and so the TTFT distribution from it
    other    each mode at the other mode's level (no figure of a run is used
             to predict it; the two modes' levels differ, since cached
             requests spend more of their time on loads)
    none     the profile as it is

The decode coefficients stay the profile's. (The live conductor learns the
same ratio online for its queue estimates, ``kvstore.conductor.live_state``.)
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import typer
from rich.console import Console

from kvstore.conductor.cost_model import CostModel, load_cost_model
from kvstore.errors import InvalidArgument
from kvstore.tools.demo.run import COST_MODEL, OVERLOAD_TTFT_SLO_MS, plan_demo
from kvstore.tools.sim.simulate import SimConfig, simulate
from kvstore.tools.demo.trace import ScaleConfig, TraceRecord, default_trace_path, load_trace

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


def scaled_to(cost: CostModel, mode: dict[str, Any], label: str) -> CostModel:
    """``cost`` with its prefill time multiplied by ``sum(measured) / sum(predicted)``
    over ``mode``'s requests (``prefill_ms``, the engine's time on each, against
    ``cost.prefill_ms`` of its tokens computed after those cached).

    Raises:
        ValueError: no request of the mode has a service time (an older demo file).
    """
    samples = [(r["prompt_tokens"] - r["cached_tokens"], r["cached_tokens"], r["prefill_ms"])
               for r in mode["per_request"] if r.get("prefill_ms") and r.get("prompt_tokens")]
    predicted = sum(cost.prefill_ms(n, c) for n, c, _ in samples)
    if not samples or predicted <= 0:
        raise ValueError(f"the demo's {label} run has no prefill service times to scale by "
                         "(written by an older kvstore demo?); use --scale none")
    k = sum(ms for _, _, ms in samples) / predicted
    source = dict(cost.source, prefill_base_ms=f"x{k:.3f}: the {len(samples)} prefill service "
                                                f"times of the demo's {label} run")
    return replace(cost, name=f"{cost.name}, prefill x{k:.2f} ({label})",
                   prefill_base_ms=cost.prefill_base_ms * k,
                   prefill_ms_per_token=cost.prefill_ms_per_token * k,
                   prefill_ms_per_mpair=cost.prefill_ms_per_mpair * k, source=source)


#: ``scale`` choices (see the module docstring).
SCALES = ("own", "other", "none")


def like_demo(demo_file: str | Path, cost_model: str | None = None, scale: str = "own"
              ) -> dict[str, Any]:
    """Predicted against measured for both modes of one demo run.

    Args:
        demo_file: the JSON of ``kvstore demo --out`` (both modes).
        cost_model: a cost model name or file; None: the demo's (recorded in the file;
            older files: ``tiny-cpu``).
        scale: "own", "other" or "none": the level of each mode's prefill (see the
            module docstring).

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
        profiled = CostModel.from_dict(demo["cost_model"])
    else:
        profiled = load_cost_model(cost_model or demo["arrivals"].get("cost_model") or COST_MODEL)
    if scale not in SCALES:
        raise InvalidArgument(f"scale must be one of {SCALES}, got {scale!r}")
    out: dict[str, Any] = {"cost_model": profiled.name, "scale": scale}
    plan, trace = _plan(demo, profiled)
    for key, use_cache in (("cache", True), ("no_cache", False)):
        mode = demo[key]
        by = {"own": key, "other": "no_cache" if use_cache else "cache"}.get(scale)
        cost = scaled_to(profiled, demo[by], by.replace("_", "-")) if by else profiled
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
        out[key] = {"predicted": predicted, "measured": seen, "error": error,
                    "cost_model": cost.name}
        out["requests"] = len(measured)
    return out


def like_demo_table(result: dict[str, Any]):
    """A rich Table: per mode and figure, predicted, measured and the error."""
    from rich.table import Table

    scaled = {"own": ", prefill at each mode's measured level",
              "other": ", prefill at the other mode's measured level"}.get(result.get("scale"), "")
    table = Table(title=f"simulator against the demo ({result['requests']} requests, "
                        f"cost model {result['cost_model']}{scaled})")
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
    scale: str = typer.Option("own", "--scale",
                              help="prefill level: own (each mode's measured service times), "
                                   "other (the other mode's), none (the profile as it is)"),
    json_out: bool = typer.Option(False, "--json", help="print the result as JSON on stdout"),
) -> None:
    """The demo's requests through the simulator: predicted against measured, both modes.

    The table goes to stderr with ``--json``; exits 2 with the reason on a file
    it cannot use."""

    try:
        result = like_demo(demo_file, cost_model, scale=scale)
    except (InvalidArgument, OSError, KeyError, ValueError) as exc:
        typer.echo(f"error: {getattr(exc, 'message', None) or exc}", err=True)
        raise typer.Exit(2)
    Console(stderr=json_out).print(like_demo_table(result))
    if json_out:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")
