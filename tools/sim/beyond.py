"""Beyond the paper, in simulation: queue-lookahead prefetch and hot-spot replication.

``kvstore simulate-beyond`` runs the conversation trace (by default) through
:mod:`kvstore.tools.sim.simulate` eight ways and prints one table of mean and
p90 TTFT and block hit rate:

* ``global-cache-aware`` -- Algorithm 1 as the paper has it (FAST'25 §5.2):
  a remote prefix is fetched when the prefill *starts*, and only when it is
  at least ``balance_ratio`` times the local one.
* ``+ lookahead prefetch`` -- a request that has to queue starts fetching its
  remote prefix at once, so the transfer overlaps the wait ahead of it; the
  scheduler knows this (:class:`GlobalCacheAwarePrefetchPolicy`): an
  instance's estimate is ``queue + max(0, transfer - queue) + prefill``, and
  any longer remote prefix is worth considering, not only one past the
  ratio. The paper's workflow (its first step, "KVCache reuse") loads the
  prefix before the prefill; overlapping it with the queue is the idea of
  prefetching from the lookahead window of the waiting queue (cf. the
  lookahead of ``kvstore simulate-cache --lookahead``), not the paper's.
* ``+ hot-spot replication`` -- a prefix that requests reused at least
  ``hot_hits`` times within ``hot_window_s`` is copied, in the background, to
  the least-loaded instances until ``hot_replicas`` hold it, so later
  requests find it locally and the scheduler can balance load freely. The
  paper (§5.2, cache load balancing) replicates hot blocks only as a side
  effect of a fetch that Algorithm 1 chose; copying them ahead of demand is
  this simulator's addition.
* ``+ both``.
* ``infinite cache`` -- global-cache-aware with no eviction anywhere: the
  hit rate the trace allows to this placement.
* ``shared infinite cache`` -- one pool of unlimited size that every instance
  reads for free (no transfer): the ceiling of any prefetch or replication
  scheme, whose only remaining cost is queueing and compute.
* ``no cache`` -- pools of zero blocks: what the cache is worth at all.

Simplifications, stated: prefetched and replicated blocks are usable as soon
as the copy is issued by the model of the pools (a prefetch still delays
its own prefill until ``transfer_ms`` after its arrival); background copies
are not charged to any prefill instance's time or to the network.

Thread safety: single-threaded, like the simulator.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections import deque
from typing import Any, Optional, Sequence

import typer

from kvstore.conductor.cost_model import CostModel, load_cost_model
from kvstore.conductor.instances import PrefillChoice
from kvstore.conductor.policies import (SchedulingPolicy, Situation, _min_by, plan,
                                        reused_tokens)
from kvstore.tools.demo.report import latency_stats
from kvstore.tools.sim.cluster import LocalPool
from kvstore.tools.sim.simulate import SimConfig, PoolView, _Simulation
from kvstore.tools.demo.trace import TraceRecord, load_trace, resolve_trace

PREFETCH_POLICY = "global-cache-aware-prefetch"
INFINITE_BLOCKS = 1 << 40


def _hidden(sit: Situation, p: PrefillChoice) -> PrefillChoice:
    """``p`` with its transfer overlapped with its queue wait (the prefetch estimate)."""
    exposed = max(0.0, p.transfer_ms - p.queue_ms)
    return dataclasses.replace(p, estimated_ttft_ms=p.queue_ms + exposed + p.prefill_ms)


class GlobalCacheAwarePrefetchPolicy(SchedulingPolicy):
    """Algorithm 1 (FAST'25 §5.2) for a cluster that prefetches from the queue.

    Not registered with the conductor's policies (the live cluster does not
    prefetch): the simulation of the ``prefetch`` rows installs it.

    For each instance both plans are weighed -- its own prefix only, and the
    best prefix anywhere fetched while the request waits -- with the transfer
    counted only where it outlasts the wait. Least estimate wins.
    """

    name = PREFETCH_POLICY

    def choose(self, sit: Situation) -> PrefillChoice:
        plans = []
        for c in sit.candidates:
            plans.append(plan(sit, c, allow_transfer=False))
            if sit.best_holder not in (None, c.instance.instance_id) and sit.best_blocks > c.local_blocks:
                plans.append(_hidden(sit, _fetch_plan(sit, c)))
        return _min_by(sit, plans, lambda p: p.estimated_ttft_ms)


def _fetch_plan(sit: Situation, cand) -> PrefillChoice:
    """The plan that fetches the best remote prefix, whatever the ratio."""
    n = sit.request.prompt_tokens
    fetch = sit.best_blocks - cand.local_blocks
    cached = reused_tokens(sit, sit.best_blocks)
    transfer_ms = sit.cost.blocks_transfer_ms(fetch)
    prefill_ms = sit.cost.prefill_ms(n - cached, cached)
    return PrefillChoice(
        instance=cand.instance, tokens_to_compute=n - cached,
        estimated_load_tokens=cand.instance.queued_tokens + n - cached,
        estimated_ttft_ms=cand.queue_ms + transfer_ms + prefill_ms, queue_ms=cand.queue_ms,
        prefill_ms=prefill_ms, transfer_ms=transfer_ms, local_prefix_blocks=cand.local_blocks,
        transfer_blocks=fetch, transfer_from=sit.best_holder)


@dataclasses.dataclass(frozen=True, slots=True)
class BeyondOptions:
    """What one row adds to the plain simulation."""

    prefetch: bool = False  # fetch a queued request's remote prefix at arrival
    replicate: bool = False  # proactive hot-spot replication
    shared: bool = False  # one unlimited pool every instance reads for free
    hot_hits: int = 3  # reuses within the window that make a prefix hot
    hot_window_s: float = 60.0
    hot_replicas: int = 4  # instances that should hold a hot prefix


class _BeyondSimulation(_Simulation):
    """The simulator with prefetch, replication or a shared pool (see the module docstring)."""

    def __init__(self, records: Sequence[TraceRecord], cfg: SimConfig, cost: CostModel,
                 opts: BeyondOptions):
        super().__init__(records, cfg, cost, offline=set())
        self.opts = opts
        if opts.prefetch:
            self.sched.policy = GlobalCacheAwarePrefetchPolicy()
        if opts.shared:
            pool = LocalPool(INFINITE_BLOCKS, cfg.eviction)
            for n in self.nodes:
                n.pool = pool
            self.sched.cache_view = PoolView({n.inst.instance_id: pool for n in self.nodes})
        self.ready_ms: dict[int, float] = {}  # job id -> when its prefetch lands
        self.uses: dict[Any, deque] = {}  # prefix key -> recent reuse times (ms)
        self.replicated = 0

    def _arrive(self, job) -> None:
        super()._arrive(job)
        c = job.choice
        if not (self.opts.prefetch and c is not None and c.transfer_blocks and not job.transferred):
            return
        node = self.nodes[job.node]
        if node.running is job:
            return
        self._fetch(job)  # issued now, overlapping the queue
        self.ready_ms[id(job)] = self.now + c.transfer_ms
        new = c.prefill_ms + max(0.0, c.transfer_ms - c.queue_ms)
        node.inst.queued_ms += new - job.pred_ms
        job.pred_ms = new

    def _start_next(self, i: int) -> None:
        node = self.nodes[i]
        if node.online and self.ready_ms:
            job = node.online[0]
            ready = self.ready_ms.pop(id(job), None)
            if ready is not None:
                new = job.choice.prefill_ms + max(0.0, ready - self.now)
                node.inst.queued_ms += new - job.pred_ms
                job.pred_ms = new
        super()._start_next(i)

    def _prefill_done(self, job) -> None:
        super()._prefill_done(job)
        reused = job.choice.reused_blocks
        if not self.opts.replicate or reused == 0:
            return
        keys = job.req.block_keys[:reused]
        times = self.uses.setdefault(keys[-1], deque())
        times.append(self.now)
        while times and times[0] < self.now - self.opts.hot_window_s * 1000:
            times.popleft()
        if len(times) < self.opts.hot_hits:
            return
        lacking = [n for n in self.nodes if n.pool.prefix_blocks(keys) < reused]
        holders = len(self.nodes) - len(lacking)
        lacking.sort(key=lambda n: self.sched.queue_ms(n.inst, self.now))
        for n in lacking[:max(0, self.opts.hot_replicas - holders)]:
            self.replicated += n.pool.store(keys, self.now / 1000)


def run_row(records: Sequence[TraceRecord], cfg: SimConfig, cost: CostModel,
            opts: BeyondOptions) -> dict[str, Any]:
    """One row: TTFT mean/p90 (ms), block hit rate, blocks fetched and replicated."""
    sim = _BeyondSimulation(records, cfg, cost, opts)
    sim.run()
    ttft = latency_stats(sim.ttft)
    return {"ttft_mean_ms": ttft["mean"], "ttft_p90_ms": ttft["p90"],
            "block_hit_rate": sim.blocks_reused / sim.blocks_total if sim.blocks_total else 0.0,
            "served": len(sim.ttft), "transferred_blocks": sim.transferred,
            "replicated_blocks": sim.replicated}


def compare_beyond(records: Sequence[TraceRecord], cost: CostModel, num_prefill: int = 8,
                   num_decode: int = 8, speed: float = 1.0, cache_blocks: int | None = None,
                   opts: BeyondOptions = BeyondOptions()) -> list[dict[str, Any]]:
    """Every row of the comparison, with ``vs_global`` (mean TTFT ratio to the first row)."""
    base = dict(rejection="none", num_prefill=num_prefill, num_decode=num_decode, speed=speed,
                ttft_slo_ms=math.inf, tbt_slo_ms=math.inf, cache_blocks=cache_blocks)
    plain = SimConfig(scheduler="global-cache-aware", **base)
    pre = plain  # the prefetch rows install their policy (BeyondOptions.prefetch)
    inf = dataclasses.replace(plain, cache_blocks=INFINITE_BLOCKS)
    rows = [("global-cache-aware", plain, dataclasses.replace(opts)),
            ("+ lookahead prefetch", pre, dataclasses.replace(opts, prefetch=True)),
            ("+ hot-spot replication", plain, dataclasses.replace(opts, replicate=True)),
            ("+ both", pre, dataclasses.replace(opts, prefetch=True, replicate=True)),
            ("infinite cache (bound)", inf, dataclasses.replace(opts)),
            ("infinite cache + both", dataclasses.replace(pre, cache_blocks=INFINITE_BLOCKS),
             dataclasses.replace(opts, prefetch=True, replicate=True)),
            ("shared infinite cache (ceiling)", inf, dataclasses.replace(opts, shared=True)),
            ("no cache (reference)", dataclasses.replace(plain, cache_blocks=0), dataclasses.replace(opts))]
    out = []
    for name, cfg, o in rows:
        row = {"row": name, **run_row(records, cfg, cost, o)}
        out.append(row)
    ref = out[0]["ttft_mean_ms"] or math.nan
    for row in out:
        row["vs_global"] = row["ttft_mean_ms"] / ref if row["ttft_mean_ms"] is not None else None
    return out


def beyond_table(rows: list[dict[str, Any]], title: str):
    """A rich Table of the rows."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("row", "mean TTFT (s)", "p90 TTFT (s)", "vs global", "hit rate", "fetched", "replicated"):
        table.add_column(col, justify="left" if col == "row" else "right")
    for r in rows:
        table.add_row(r["row"], f"{r['ttft_mean_ms'] / 1000:.3f}", f"{r['ttft_p90_ms'] / 1000:.3f}",
                      f"{r['vs_global']:.3f}", f"{100 * r['block_hit_rate']:.2f}%",
                      f"{r['transferred_blocks']:,}", f"{r['replicated_blocks']:,}")
    return table


def simulate_beyond_command(
    trace: Optional[str] = typer.Option("conversation", "--trace", help="trace JSONL or bundled name"),
    prefill: int = typer.Option(8, "--prefill", min=1),
    decode: int = typer.Option(8, "--decode", min=1),
    speed: float = typer.Option(1.0, "--speed", help="arrival-rate multiplier"),
    cost_model: str = typer.Option("llama2-70b-a800", "--cost-model"),
    cache_blocks: Optional[int] = typer.Option(None, "--cache-blocks", min=0,
                                               help="pool per prefill instance (default: the model's)"),
    hot_hits: int = typer.Option(3, "--hot-hits", min=1, help="reuses in the window that make a prefix hot"),
    hot_window_s: float = typer.Option(60.0, "--hot-window-s"),
    hot_replicas: int = typer.Option(4, "--hot-replicas", min=1, help="instances that should hold a hot prefix"),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="first N requests only"),
    json_out: bool = typer.Option(False, "--json", help="print the rows as JSON on stdout"),
) -> None:
    """Global cache-aware scheduling against + lookahead prefetch, + hot-spot replication, + both, and bounds."""
    from rich.console import Console

    try:
        cost = load_cost_model(cost_model)
        records = load_trace(resolve_trace(trace), limit=limit)
        rows = compare_beyond(records, cost, prefill, decode, speed, cache_blocks,
                              BeyondOptions(hot_hits=hot_hits, hot_window_s=hot_window_s,
                                            hot_replicas=hot_replicas))
    except (KeyError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc.args[0] if exc.args else exc}", err=True)
        raise typer.Exit(2)
    title = (f"simulate-beyond: {trace}, {len(records):,} requests, {prefill}P+{decode}D, "
             f"{cost.name}, {speed}x, no SLOs")
    Console(stderr=json_out, width=max(Console().width, 110)).print(beyond_table(rows, title))
    if json_out:
        sys.stdout.write(json.dumps({"trace": trace, "requests": len(records), "cost_model": cost.name,
                                     "prefill": prefill, "decode": decode, "speed": speed,
                                     "rows": rows}, indent=2) + "\n")
