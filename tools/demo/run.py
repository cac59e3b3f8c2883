"""The main job: an embedded local cluster replaying the bundled Mooncake trace,
with the prefix cache and without it.

``kvstore demo`` (:func:`run_comparison`) runs the same requests twice, each
time on a freshly started cluster::

    plan     window of the trace (demo_window), arrival rate (demo_arrivals)
    cache    start cluster -> warm-up fills the store, then warms the engines (demo_warmup)
             -> replay window -> stop
    no cache start cluster -> the same engine warm-up -> replay window -> stop
    verdict  side-by-side table and ratios (demo_compare), TTFT plot, JSON

A fresh cluster per mode (about 10 s each) rather than one reused: the
conductor's ``--no-cache`` is a process option, and neither mode should
inherit the other's store contents, engine pages or warm caches.
``--no-cache`` or ``--cache-only`` run one mode (:func:`run_demo`, the
single summary); ``--overload`` sends arrivals above capacity to a
conductor with a TTFT SLO, which refuses early what it cannot serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from rich.console import Console

from kvstore.conductor.cost_model import CostModel, load_cost_model
from kvstore import rpc
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.tools.demo.arrivals import (DEFAULT_TARGET_UTILISATION, OVERLOAD_UTILISATION,
                                         ArrivalPlan, plan_arrivals, retime)
from kvstore.tools.demo.compare import compare, render_comparison_table, write_ttft_plot
from kvstore.tools.demo.warmup import ENGINE_WARMUP_REQUESTS, store_fill, warm_up
from kvstore.tools.demo.window import Window, pick_window
from kvstore.tools.cluster.launcher import ClusterSpec, LocalCluster
from kvstore.tools.cluster.processes import ChildFailed
from kvstore.tools.demo.replay import replay
from kvstore.tools.demo.report import render_summary, save_summary, summarize
from kvstore.tools.demo.trace import (ScaleConfig, ScaledRequest, default_trace_path, load_trace,
                                      scale_trace)

log = logging.getLogger(__name__)

COST_MODEL = "tiny-cpu"
"""The bundled engines' cost model profiled once (``kvstore profile``), for ``--cost-model``."""

PROFILE_NOW = "profile"
"""``--cost-model profile``: fit the cost model on this machine, now, before the run."""

OVERLOAD_TTFT_SLO_MS = 5_000.0
"""``--overload``: the conductor refuses a request whose estimated TTFT is above this."""


@dataclass(frozen=True, slots=True)
class DemoPlan:
    """What both modes replay."""

    trace: Path
    block_tokens: int
    window: Window
    arrivals: ArrivalPlan
    measured: list[ScaledRequest]  # the window, arrivals from its first request
    store_warmup: list[ScaledRequest]  # cache mode: cut warm-up requests (store_fill), in order
    engine_warmup: list[ScaledRequest]  # both modes, after store_warmup: whole requests

    def to_dict(self) -> dict:
        """The plan's JSON entries (``window``, ``arrivals``)."""
        w, a = self.window, self.arrivals
        return {
            "window": {"start": w.start, "requests": w.num_requests, "warmup": w.warmup,
                       "infinite_cache_hit_rate": w.hit_rate,
                       "trace_infinite_cache_hit_rate": w.trace_hit_rate,
                       "trace_requests": w.trace_requests, "chosen": w.chosen,
                       "description": w.describe()},
            "arrivals": {"rate_rps": a.rate_rps, "time_scale": a.time_scale,
                         "target_utilisation": a.target_utilisation,
                         "mean_prefill_ms": a.mean_prefill_ms, "capacity_rps": a.capacity_rps,
                         "num_prefill": a.num_prefill, "cost_model": a.cost_model,
                         "derived": a.derived, "description": a.describe()},
        }


def plan_demo(*, trace: str | None, requests: int, warmup: int, window_start: int | None,
              time_scale: float | None, target_utilisation: float, scale: ScaleConfig,
              num_prefill: int = 1, cost: CostModel | None = None) -> DemoPlan:
    """Chooses the window and the arrival rate (see demo_window, demo_arrivals).

    Args:
        requests: requests measured.
        warmup: requests before the window that fill the store.
        window_start: first measured request; None picks it.
        time_scale: trace clock multiplier; None derives it from ``target_utilisation``.
        scale: how trace requests shrink (``time_scale`` of it is ignored).
        cost: the cost model that derives the arrival rate; None: ``COST_MODEL``.

    Raises:
        InvalidArgument: the window does not fit the trace.
    """
    path = Path(trace) if trace else default_trace_path("conversation")
    records = load_trace(path)
    window = pick_window(records, requests, warmup, start=window_start)
    measured_recs = records[window.start:window.start + window.num_requests]
    measured = scale_trace(measured_recs, scale)
    arrivals = plan_arrivals(measured_recs, measured, cost or load_cost_model(COST_MODEL),
                             num_prefill, target_utilisation, time_scale)
    engine_from = max(window.start - ENGINE_WARMUP_REQUESTS, window.warmup_start)
    fill = store_fill(records, engine_from, window.start + window.num_requests,
                      begin=window.warmup_start)
    b = scale.block_tokens
    store_warmup = [dataclasses.replace(r, prompt_tokens=r.prompt_tokens[:n * b], num_blocks=n)
                    for r, (_, n) in zip(scale_trace([records[i] for i, _ in fill], scale), fill)]
    return DemoPlan(path, b, window, arrivals,
                    retime(measured, measured_recs, arrivals.time_scale), store_warmup,
                    scale_trace(records[engine_from:window.start], scale))


def _run_mode(plan: DemoPlan, *, use_cache: bool, node_dram: str, log_dir: str,
              console: Console, save_mode: str | None, conductor_args: tuple[str, ...],
              overload: bool) -> dict:
    """One mode on a fresh cluster: warm-up, replay of the window; its summary.

    Raises:
        ChildFailed: a component died (everything is stopped first).
    """
    # The engines (and torch) load in the engine processes, not in this one.
    from kvstore.engines.kv_saver import SAVE_MODE_ENV

    mode = "cache" if use_cache else "no-cache"
    spec = ClusterSpec(node_dram=node_dram, block_tokens=plan.block_tokens, use_cache=use_cache,
                       log_dir=log_dir, conductor_args=conductor_args)
    warm_reqs = (plan.store_warmup if use_cache else []) + plan.engine_warmup
    cluster = LocalCluster(spec)
    with console.status(f"{mode}: starting cluster") as status, _env(SAVE_MODE_ENV, save_mode):
        cluster.start(on_step=lambda name: status.update(f"{mode}: starting {name}"))
    try:
        watchdog = _Watchdog(cluster)
        with console.status(f"{mode}: warm-up, {len(warm_reqs)} requests"):
            # Under the TTFT SLO of --overload one at a time: the warm-up builds no
            # queue, so none of it is refused (each long prompt fits the SLO on its own).
            warm = asyncio.run(watchdog.guard(warm_up(cluster.conductor, warm_reqs,
                                                      in_flight=1 if overload else 2)))
        before = _prefill_save_totals(cluster)
        outcome = asyncio.run(watchdog.guard(replay(cluster.conductor, plan.measured)))
        save = save_summary(_since(before, _prefill_save_totals(cluster)))
    finally:
        with console.status(f"{mode}: stopping cluster"):
            cluster.stop()
    summary = summarize(outcome.results, outcome.duration_s, block_hit_rate=outcome.block_hit_rate,
                        total_blocks=outcome.total_blocks, hit_blocks=outcome.hit_blocks, mode=mode)
    summary["trace"] = plan.trace.name
    summary["block_tokens"] = plan.block_tokens
    summary["kv_save"] = save
    summary["warmup"] = warm.to_dict()
    summary.update(plan.to_dict())
    if warm.errors:
        console.print(f"[red]{mode}: {warm.errors} of {warm.requests} warm-up requests failed[/] "
                      f"({warm.first_error})")
    return summary


def run_demo(*, requests: int, trace: str | None, use_cache: bool, out: str | None,
             time_scale: float | None, block_tokens: int, max_output_tokens: int, node_dram: str,
             log_dir: str | None, console: Console, save_mode: str | None = None,
             warmup: int = 0, window_start: int | None = 0,
             target_utilisation: float = DEFAULT_TARGET_UTILISATION,
             overload: bool = False, cost_model: str = COST_MODEL) -> dict:
    """One mode: start the cluster, warm up, replay the window, print and return the summary.

    The defaults of ``warmup`` and ``window_start`` replay the trace's first
    ``requests`` with no warm-up; ``time_scale`` None derives the arrival
    rate (demo_arrivals), a number multiplies the trace clock.

    Args:
        save_mode: the prefill engines' ``--save-mode`` ("sync", "streamed", "layerwise");
            None keeps their default. The summary's ``kv_save`` entry reports
            the window's prefills (warm-up excluded): their save time and how
            much of it was hidden behind compute.
        overload: arrivals at OVERLOAD_UTILISATION of capacity, conductor TTFT SLO on.
        cost_model: the conductor's and the arrival rate's cost model: a bundled name
            or file, or PROFILE_NOW (fit it here first, ``kvstore profile``).

    Raises:
        InvalidArgument: the window does not fit the trace.
        ChildFailed: a component died (everything is stopped first).
    """
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvstore-demo-")
    cost = _cost_model(cost_model, block_tokens, log_dir, console)
    plan, conductor_args = _plan(trace, requests, warmup, window_start, time_scale,
                                 target_utilisation, overload, block_tokens, max_output_tokens,
                                 cost, log_dir)
    mode = "cache" if use_cache else "no-cache"
    _announce(console, plan, f"{mode} only", log_dir)
    summary = _run_mode(plan, use_cache=use_cache, node_dram=node_dram, log_dir=log_dir,
                        console=console, save_mode=save_mode, conductor_args=conductor_args,
                        overload=overload)
    summary["cost_model"] = cost.to_dict()
    console.print(render_summary(summary))
    if out:
        Path(out).write_text(json.dumps(summary, indent=2))
        console.print(f"summary written to {out}")
    return summary


def run_comparison(*, requests: int, trace: str | None, out: str | None,
                   time_scale: float | None, block_tokens: int, max_output_tokens: int,
                   node_dram: str, log_dir: str | None, console: Console,
                   save_mode: str | None = None, warmup: int = 400,
                   window_start: int | None = None,
                   target_utilisation: float = DEFAULT_TARGET_UTILISATION,
                   overload: bool = False, plot: str | None = None,
                   cost_model: str = COST_MODEL) -> dict:
    """Both modes on the same requests; prints the side-by-side table, writes the
    TTFT plot (``plot``, default beside ``out`` or in the log folder) and ``out``.

    Returns:
        ``{"cache", "no_cache", "comparison", "window", "arrivals", "trace",
        "block_tokens", "overload", "plot", "wall_s", "cost_model"}``: each mode's
        summary as :func:`run_demo` returns it, their comparison (demo_compare),
        and the cost model used (``CostModel.to_dict``).

    Raises:
        InvalidArgument: the window does not fit the trace.
        ChildFailed: a component died (everything is stopped first).
    """
    started = time.perf_counter()
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvstore-demo-")
    cost = _cost_model(cost_model, block_tokens, log_dir, console)
    plan, conductor_args = _plan(trace, requests, warmup, window_start, time_scale,
                                 target_utilisation, overload, block_tokens, max_output_tokens,
                                 cost, log_dir)
    _announce(console, plan, "cache against no cache", log_dir)
    runs = {}
    for use_cache, key in ((True, "cache"), (False, "no_cache")):
        runs[key] = _run_mode(plan, use_cache=use_cache, node_dram=node_dram,
                              log_dir=os.path.join(log_dir, key), console=console,
                              save_mode=save_mode, conductor_args=conductor_args,
                              overload=overload)
    comparison = compare(runs["cache"], runs["no_cache"])
    title = (f"kvstore demo: {plan.window.num_requests} requests of {plan.trace.name} at "
             f"{plan.arrivals.rate_rps:.2f} requests/s" + (" (overload)" if overload else ""))
    console.print(render_comparison_table(comparison, title))
    save = runs["no_cache"]["kv_save"]
    if save["requests"]:
        console.print(f"no-cache prefill: {save['prefill_ms_total'] / save['requests']:.0f} ms "
                      f"per request measured in the window, "
                      f"{plan.arrivals.mean_prefill_ms:.0f} ms by cost model "
                      f"{plan.arrivals.cost_model}")
    plot_path = Path(plot) if plot else (Path(out).with_suffix(".ttft.png") if out
                                         else Path(log_dir) / "ttft.png")
    why_not = write_ttft_plot(runs["cache"], runs["no_cache"], plot_path, title)
    console.print(f"TTFT plot: {plot_path}" if why_not is None else f"no TTFT plot: {why_not}",
                  markup=False)
    result = {"trace": plan.trace.name, "block_tokens": plan.block_tokens, **plan.to_dict(),
              "overload": overload, "conductor_args": list(conductor_args),
              "cache": runs["cache"], "no_cache": runs["no_cache"], "comparison": comparison,
              "plot": None if why_not else str(plot_path),
              "wall_s": time.perf_counter() - started, "cost_model": cost.to_dict()}
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
        console.print(f"both summaries and the comparison written to {out}")
    return result


def _cost_model(name: str, block_tokens: int, log_dir: str, console: Console) -> CostModel:
    """``name`` loaded, or with PROFILE_NOW fitted on this machine now (about 10 s)."""
    if name != PROFILE_NOW:
        return load_cost_model(name)
    from kvstore.tools.cli.profile import profile

    with console.status("profiling the engines' cost model on this machine (kvstore profile)"):
        cost, _ = profile("tiny", block_tokens=block_tokens, name="tiny-cpu-now")
    return cost


def _plan(trace, requests, warmup, window_start, time_scale, target_utilisation, overload,
          block_tokens, max_output_tokens, cost: CostModel, log_dir: str
          ) -> tuple[DemoPlan, tuple[str, ...]]:
    """The plan and the conductor's extra options: its cost model (written to the log
    folder) and, under ``overload``, the TTFT SLO."""
    scale = ScaleConfig(block_tokens=block_tokens, max_output_tokens=max_output_tokens)
    target = OVERLOAD_UTILISATION if overload else target_utilisation
    plan = plan_demo(trace=trace, requests=requests, warmup=warmup, window_start=window_start,
                     time_scale=time_scale, target_utilisation=target, scale=scale, cost=cost)
    path = Path(log_dir) / "cost_model.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    cost.save(path)
    args = ("--cost-model", str(path))
    if overload:
        args += ("--ttft-slo-ms", f"{OVERLOAD_TTFT_SLO_MS:g}")
    return plan, args


def _announce(console: Console, plan: DemoPlan, what: str, log_dir: str) -> None:
    console.print(f"[bold]kvstore demo[/] ({what}): {plan.window.num_requests} requests of "
                  f"{plan.trace.name}, {plan.block_tokens} tokens per block; logs in {log_dir}")
    console.print(f"  window: {plan.window.describe()}")
    console.print(f"  arrivals: {plan.arrivals.describe()}")


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """Set one environment variable for a block (None: leave it alone).

    The cluster's children inherit it: this is how the demo picks the
    prefill engines' save mode without a cluster option for it.
    """
    if value is None:
        yield
        return
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def _since(before: list[dict], after: list[dict]) -> list[dict]:
    """Each engine's save totals of the window: ``after`` less ``before`` (the
    warm-up's), per engine; an engine missing from ``before`` counts whole."""
    start = {e["engine"]: e for e in before}
    out = []
    for e in after:
        b = start.get(e["engine"])
        out.append(e if b is None else {**e, **{k: e[k] - b[k] for k in _TOTALS}})
    return out


_TOTALS = ("requests", "compute_ms", "save_ms", "hidden_ms")


def _prefill_save_totals(cluster: LocalCluster) -> list[dict]:
    """Each prefill engine's KV save totals, from its Status RPC.

    An engine that does not answer is left out (and logged): the run's
    summary does not depend on it.
    """
    out = []
    for i in range(cluster.spec.num_prefill):
        address = cluster.process(f"prefill{i}").address
        try:
            with rpc.channel(address) as ch:
                st = spb_grpc.PrefillEngineStub(ch).Status(spb.EngineStatusRequest(), timeout=10)
        except grpc.RpcError as exc:
            log.warning("prefill%d did not report its save totals: %s", i, exc)
            continue
        out.append({"engine": i, "mode": st.save_mode, "requests": st.requests_done,
                    "compute_ms": st.compute_ms_total, "save_ms": st.save_ms_total,
                    "hidden_ms": st.save_hidden_ms_total})
    return out


class _Watchdog:
    """Fails the replay at once when any cluster process dies."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster

    async def guard(self, coro):
        main = asyncio.ensure_future(coro)
        while not main.done():
            try:
                self.cluster.check()
            except ChildFailed:
                main.cancel()
                raise
            await asyncio.wait([main], timeout=0.5)
        return main.result()
