"""Discrete-event simulation of a Mooncake cluster, driven by the real scheduler.

``kvstore simulate --trace conversation --scheduler global-cache-aware`` replays
a Mooncake trace (512-token ``hash_ids`` blocks) against ``--prefill N``
prefill and ``--decode M`` decode instances whose times come from a cost
model (:mod:`kvstore.conductor.cost_model`). Every decision is made by the
conductor's own :class:`kvstore.conductor.scheduler.Scheduler` -- the same policy and
rejection classes the live conductor uses -- and every prefill instance keeps
a local KVCache pool run by the store nodes' eviction code
(:class:`kvstore.tools.sim.cluster.LocalPool`). Nothing is mocked: only time is.

One request's life::

    arrival ──schedule()──▶ rejected (TTFT, or decode load at arrival: early / predictive)
       │                     pins: the local prefix on p, the source blocks on the holder
       ▼
    queue of p ── online first; offline work fills idle time in chunks
       │  start: fetch (replicate) the remote prefix into p's pool
       ▼
    prefill ends (TTFT) ──admit_decode()──▶ rejected late (prefill wasted)
       │  store the request's blocks in p's pool; unpin
       ▼
    decode batch (fluid: one token per step per member) ── finish (TBT)

Offline requests (``--offline-fraction``) are never rejected: they wait in the
conductor's backlog until a prefill instance has no online work, run in
chunks of at most ``--offline-chunk-tokens`` (an online arrival waits at most
one chunk, which its TTFT estimate includes), and join a decode batch only
while its step stays within 80% of the TBT SLO.

Simplifications, stated: the prefill→decode KV hand-over is layer-wise and
overlapped (not timed); decode memory is checked at admission with the mean
output length reserved (no preemption); a request's last, partial block is
keyed like the full ones, as in the traces.

Output: a rich table, or with ``--json`` one object: ``{scheduler, rejection,
requests, rejected, ttft_ms: {mean, p50, p90, p99}, tbt_ms: {...},
block_hit_rate, ...}`` (TTFT and TBT over served online requests, seconds of
simulated time converted to milliseconds).

Thread safety: single-threaded; a run owns everything it builds.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Collection, Hashable, Optional, Sequence

import typer

from kvstore.conductor.cost_model import DEFAULT_COST_MODEL, CostModel, load_cost_model
from kvstore.conductor.instances import DecodeChoice, DecodeInstance, PrefillChoice, PrefillInstance, SchedRequest
from kvstore.conductor.policies import DEFAULT_SCHEDULING_POLICY, SCHEDULING_POLICIES
from kvstore.conductor.rejection import DEFAULT_REJECTION_POLICY, REJECTION_POLICIES, Slo
from kvstore.conductor.scheduler import Scheduler
from kvstore.tools.demo.report import latency_stats
from kvstore.tools.sim.cluster import DecodeBatch, LocalPool
from kvstore.tools.demo.trace import (TRACE_BLOCK_TOKENS, TraceRecord, intern_chains, load_trace,
                                      resolve_trace)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation's settings."""

    scheduler: str = DEFAULT_SCHEDULING_POLICY  # kvstore.conductor.policies name
    rejection: str = DEFAULT_REJECTION_POLICY  # kvstore.conductor.rejection name
    num_prefill: int = 8  # prefill instances
    num_decode: int = 8  # decode instances
    speed: float = 1.0  # arrival-rate multiplier (2: the trace in half the time)
    ttft_slo_ms: float = 30_000.0  # inf: no TTFT check
    tbt_slo_ms: float = 100.0  # inf: no TBT check
    cache_blocks: int | None = None  # per prefill instance; None: the cost model's DRAM pool
    eviction: str = "default"  # kvstore.store.eviction policy of the pools
    balance_ratio: float = 1.2  # Algorithm 1's kvcache_balancing_threshold
    departures: str = "survival"  # predictive rejection's departure model ("uniform": the paper's)
    confidence_gone: float = 0.05  # survival: predicted gone at or below this chance to stay
    offline_fraction: float = 0.0  # share of requests marked offline (seeded)
    offline_chunk_tokens: int = 4096  # offline prefill chunk
    seed: int = 0  # random scheduler and offline marking
    block_tokens: int = TRACE_BLOCK_TOKENS  # tokens per hash_ids block (the demo's scale: 16)

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("need at least one prefill and one decode instance")
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0, got {self.speed}")
        if not 0 <= self.offline_fraction <= 1:
            raise ValueError(f"offline_fraction must be in [0, 1], got {self.offline_fraction}")
        if self.offline_chunk_tokens < 1:
            raise ValueError("offline_chunk_tokens must be >= 1")
        if self.scheduler not in SCHEDULING_POLICIES:
            raise KeyError(f"unknown scheduler {self.scheduler!r}; known: {sorted(SCHEDULING_POLICIES)}")
        if self.rejection not in REJECTION_POLICIES:
            raise KeyError(f"unknown rejection policy {self.rejection!r}; known: "
                           f"{sorted(REJECTION_POLICIES)}")


@dataclass(slots=True, eq=False)
class _Job:
    """One request's progress through the simulated cluster."""

    req: SchedRequest
    arrival_ms: float
    output_tokens: int
    choice: PrefillChoice | None = None  # the plan, once scheduled
    planned_decode: DecodeInstance | None = None  # decode instance chosen at arrival, if any
    node: int = -1  # prefill instance index
    pred_ms: float = 0.0  # online: predicted transfer + prefill
    done_tokens: int = 0  # offline: prompt tokens computed so far
    transferred: bool = False  # the remote prefix was fetched
    ttft_ms: float = math.nan
    tbt_ms: float = math.nan


@dataclass(slots=True, eq=False)
class _PrefillNode:
    inst: PrefillInstance
    pool: LocalPool
    online: deque = field(default_factory=deque)  # queued online jobs
    parked: _Job | None = None  # offline job in progress between chunks
    running: _Job | None = None


class PoolView:
    """The scheduler's CacheView over the simulated pools (one per prefill instance)."""

    __slots__ = ("_pools",)

    def __init__(self, pools: dict[str, LocalPool]):
        self._pools = pools

    def prefix_blocks(self, instance_id: str, block_keys: Sequence[Hashable]) -> int:
        return self._pools[instance_id].prefix_blocks(block_keys)


def simulator_scheduler(pre: list[PrefillInstance], dec: list[DecodeInstance], cfg: SimConfig,
                        cost: CostModel, view: PoolView) -> Scheduler:
    """The scheduler the simulation drives, as ``cfg`` sets it up (also used to recompute
    the live conductor's recorded decisions, ``kvstore.tools.sim.parity``)."""
    return Scheduler(pre, dec, policy=cfg.scheduler, rejection=cfg.rejection, cost_model=cost,
                     slo=Slo(cfg.ttft_slo_ms, cfg.tbt_slo_ms), block_tokens=cfg.block_tokens,
                     balance_ratio=cfg.balance_ratio, cache_view=view, seed=cfg.seed,
                     departures=cfg.departures, confidence_gone=cfg.confidence_gone)


@dataclass(frozen=True, slots=True)
class SimResult:
    """What a run measured."""

    config: SimConfig
    cost_model: str
    cache_blocks: int  # per prefill instance
    requests: int  # simulated (online + offline)
    online: int
    rejected: int  # online requests refused (at arrival or late)
    rejected_late: int  # of which refused after their prefill (wasted)
    rejected_by_reason: dict[str, int]
    ttft_ms: dict[str, float | None]  # served online requests (None: none served)
    tbt_ms: dict[str, float | None]  # served online requests that decoded
    offline_completed: int
    offline_ttft_ms: dict[str, float | None]
    block_hit_rate: float  # reused / all prompt blocks, over prefilled requests
    transferred_blocks: int  # fetched from another instance (replicas made)
    sim_duration_s: float  # simulated time until the last event
    wall_s: float  # how long the run took

    def summary(self) -> dict[str, Any]:
        """The ``--json`` object."""
        out = {
            "scheduler": self.config.scheduler,
            "rejection": self.config.rejection,
            "requests": self.requests,
            "rejected": self.rejected,
            "ttft_ms": self.ttft_ms,
            "tbt_ms": self.tbt_ms,
            "block_hit_rate": self.block_hit_rate,
            "rejected_late": self.rejected_late,
            "rejected_by_reason": self.rejected_by_reason,
            "transferred_blocks": self.transferred_blocks,
            "settings": {
                "prefill": self.config.num_prefill, "decode": self.config.num_decode,
                "speed": self.config.speed, "cost_model": self.cost_model,
                "ttft_slo_ms": _num(self.config.ttft_slo_ms), "tbt_slo_ms": _num(self.config.tbt_slo_ms),
                "cache_blocks_per_prefill": self.cache_blocks, "eviction": self.config.eviction,
                "balance_ratio": self.config.balance_ratio, "departures": self.config.departures,
                "confidence_gone": self.config.confidence_gone, "seed": self.config.seed,
            },
            "sim_duration_s": self.sim_duration_s,
            "wall_s": self.wall_s,
        }
        if self.requests > self.online:
            out["offline"] = {"requests": self.requests - self.online,
                              "completed": self.offline_completed, "ttft_ms": self.offline_ttft_ms}
        return out


def _ms(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _num(x: float) -> float | None:
    return None if math.isinf(x) else x


class _Simulation:
    """One run's state and event handlers (see the module docstring)."""

    def __init__(self, records: Sequence[TraceRecord], cfg: SimConfig, cost: CostModel,
                 offline: Collection[int] | None = None, warm: Sequence[TraceRecord] = ()):
        self.cfg = cfg
        self.cost = cost
        self.cache_blocks = cfg.cache_blocks if cfg.cache_blocks is not None else cost.prefill_cache_blocks
        pre = [PrefillInstance(f"p{i}") for i in range(cfg.num_prefill)]
        dec = [DecodeInstance(f"d{i}") for i in range(cfg.num_decode)]
        self.nodes = [_PrefillNode(p, LocalPool(self.cache_blocks, cfg.eviction)) for p in pre]
        self.node_of = {n.inst.instance_id: i for i, n in enumerate(self.nodes)}
        self.batches = [DecodeBatch(d, cost) for d in dec]
        self.batch_of = {d.instance_id: i for i, d in enumerate(dec)}
        view = PoolView({n.inst.instance_id: n.pool for n in self.nodes})
        self.sched = simulator_scheduler(pre, dec, cfg, cost, view)
        if offline is None:
            marks = random.Random(cfg.seed + 1)
            offline = {i for i in range(len(records))
                       if cfg.offline_fraction and marks.random() < cfg.offline_fraction}
        keys = intern_chains(list(warm) + list(records))
        for chain in keys[:len(warm)]:              # a warm-up filled every pool before the run
            for n in self.nodes:
                n.pool.store(chain, 0.0)
        keys = keys[len(warm):]
        t0 = records[0].timestamp_ms if records else 0
        self.jobs = [
            _Job(SchedRequest(rec.index, rec.input_length, keys[i], online=i not in offline),
                 arrival_ms=(rec.timestamp_ms - t0) / cfg.speed, output_tokens=rec.output_length)
            for i, rec in enumerate(records)]
        self.events: list[tuple[float, int, int, Any, int]] = []  # (ms, seq, kind, payload, version)
        self._seq = 0
        self.offline_backlog: deque[_Job] = deque()
        self.decode_backlog: deque[_Job] = deque()  # offline jobs waiting for a decode slot
        self.now = 0.0
        # counters
        self.rejected: dict[str, int] = {}
        self.rejected_late = 0
        self.ttft: list[float] = []
        self.tbt: list[float] = []
        self.offline_ttft: list[float] = []
        self.offline_done = 0
        self.blocks_total = 0
        self.blocks_reused = 0
        self.transferred = 0

    # ------------------------------------------------------------ event queue

    _PREFILL_DONE, _DECODE_DONE = 0, 1

    def _push(self, t_ms: float, kind: int, payload: Any, version: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.events, (t_ms, self._seq, kind, payload, version))

    def _arm_decode(self, b: int) -> None:
        batch = self.batches[b]
        t = batch.next_finish_ms()
        if t is not None:
            self._push(t, self._DECODE_DONE, b, batch.version)

    def run(self) -> float:
        """Runs every event; returns the time of the last one."""
        events = self.events
        for job in self.jobs:
            while events and events[0][0] <= job.arrival_ms:
                self._dispatch(heapq.heappop(events))
            self.now = job.arrival_ms
            self._arrive(job)
        while events:
            self._dispatch(heapq.heappop(events))
        return self.now

    def _dispatch(self, ev: tuple[float, int, int, Any, int]) -> None:
        t, _, kind, payload, version = ev
        self.now = t
        if kind == self._PREFILL_DONE:
            self._chunk_done(payload)
        elif version == self.batches[payload].version:  # stale finish times are skipped
            self._decode_done(payload)

    # ------------------------------------------------------------ arrivals

    def _arrive(self, job: _Job) -> None:
        now = self.now
        for b, batch in enumerate(self.batches):  # the early check reads the live context
            if len(batch):
                batch.advance(now)
                self._arm_decode(b)
        if not job.req.online:
            self.offline_backlog.append(job)
            for i, node in enumerate(self.nodes):
                if node.running is None and not node.online:
                    self._start_next(i)
            return
        decision = self.sched.schedule(job.req, now)
        if not decision.accepted:
            reason = decision.rejection.reason.value
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
            return
        choice = decision.prefill
        i = self.node_of[choice.instance.instance_id]
        node = self.nodes[i]
        job.choice, job.node = choice, i
        job.planned_decode = decision.decode.instance if decision.decode else None
        job.pred_ms = choice.transfer_ms + choice.prefill_ms
        self._pin(job, +1)
        node.online.append(job)
        node.inst.queued_ms += job.pred_ms
        node.inst.queued_requests += 1
        node.inst.queued_tokens += choice.tokens_to_compute
        if node.running is None:
            self._start_next(i)

    def _pin(self, job: _Job, sign: int) -> None:
        """Pins (or unpins) the blocks the plan reads: local prefix here, the source on the holder."""
        c = job.choice
        keys = job.req.block_keys
        node = self.nodes[job.node]
        (node.pool.pin if sign > 0 else node.pool.unpin)(keys[:c.local_prefix_blocks])
        if c.transfer_blocks and not job.transferred:
            src = self.nodes[self.node_of[c.transfer_from]].pool
            (src.pin if sign > 0 else src.unpin)(keys[c.local_prefix_blocks:c.reused_blocks])

    # ------------------------------------------------------------ prefill

    def _start_next(self, i: int) -> None:
        """Starts the next piece of work on idle node ``i``: online first, then offline chunks."""
        node = self.nodes[i]
        now = self.now
        if node.online:
            job = node.online.popleft()
            node.inst.queued_ms -= job.pred_ms
            self._fetch(job)
            node.running = job
            node.inst.busy_until_ms = now + job.pred_ms
            self._push(now + job.pred_ms, self._PREFILL_DONE, i)
            return
        job = node.parked
        if job is None and self.offline_backlog:
            job = self.offline_backlog.popleft()
            job.choice = self.sched.plan_prefill(job.req, now, only=node.inst)
            job.node = i
            self._pin(job, +1)
        if job is None:
            node.inst.busy_until_ms = now
            return
        node.parked = None
        c = job.choice
        cached = c.reused_blocks and min(c.reused_blocks * self.cfg.block_tokens, job.req.prompt_tokens - 1)
        todo = c.tokens_to_compute - job.done_tokens
        chunk = min(todo, self.cfg.offline_chunk_tokens)
        ms = self.cost.prefill_ms(chunk, cached + job.done_tokens)
        if not job.transferred:
            ms += c.transfer_ms
            self._fetch(job)
        job.done_tokens += chunk
        node.running = job
        node.inst.busy_until_ms = now + ms
        self._push(now + ms, self._PREFILL_DONE, i)

    def _fetch(self, job: _Job) -> None:
        """At prefill start: the remote prefix is copied into this node's pool (a replica)."""
        c = job.choice
        if job.transferred or not c.transfer_blocks:
            job.transferred = True
            return
        keys = job.req.block_keys
        span = keys[c.local_prefix_blocks:c.reused_blocks]
        self.nodes[self.node_of[c.transfer_from]].pool.unpin(span)
        job.transferred = True
        pool = self.nodes[job.node].pool
        pool.store(keys[:c.reused_blocks], self.now / 1000)
        pool.pin(span)
        self.transferred += len(span)

    def _chunk_done(self, i: int) -> None:
        node = self.nodes[i]
        job = node.running
        node.running = None
        if not job.req.online and job.done_tokens < job.choice.tokens_to_compute:
            node.parked = job  # more chunks; online work goes first
        else:
            self._prefill_done(job)
        self._start_next(i)

    def _prefill_done(self, job: _Job) -> None:
        now = self.now
        c = job.choice
        node = self.nodes[job.node]
        keys = job.req.block_keys
        node.pool.store(keys, now / 1000)
        node.pool.unpin(keys[:c.reused_blocks])
        self.blocks_total += len(keys)
        self.blocks_reused += c.reused_blocks
        if job.req.online:
            node.inst.queued_requests -= 1
            node.inst.queued_tokens -= c.tokens_to_compute
        job.ttft_ms = now - job.arrival_ms
        if job.output_tokens <= 1:  # the first token was the whole answer
            self.sched.dropped(job.req)
            self._served(job)
            return
        self._to_decode(job)

    # ------------------------------------------------------------ decode

    def _to_decode(self, job: _Job, waiting: bool = False) -> bool:
        """Late check and join; an online refusal is final, an offline one waits in the backlog.

        Args:
            job: the request whose prefill ended.
            waiting: ``job`` is already in the offline decode backlog.

        Returns:
            Whether it joined a decode batch.
        """
        picked = self.sched.admit_decode(job.req, self.now, job.planned_decode)
        if not isinstance(picked, DecodeChoice):
            if job.req.online:
                self.rejected[picked.reason.value] = self.rejected.get(picked.reason.value, 0) + 1
                self.rejected_late += 1
            elif not waiting:
                self.decode_backlog.append(job)
            return False
        b = self.batch_of[picked.instance.instance_id]
        self.batches[b].add(job, self.now, job.req.prompt_tokens, job.output_tokens - 1)
        self.sched.decode_started(job.req, picked.instance.instance_id, self.now)
        self._arm_decode(b)
        return True

    def _decode_done(self, b: int) -> None:
        batch = self.batches[b]
        did = batch.instance.instance_id
        for job, _join_ms, tbt in batch.pop_finished(self.now, lambda j: j.req.prompt_tokens):
            job.tbt_ms = tbt
            self.sched.decode_finished(job.req, did, self.now, job.output_tokens)
            self._served(job)
        self._arm_decode(b)
        while self.decode_backlog and self._to_decode(self.decode_backlog[0], waiting=True):
            self.decode_backlog.popleft()

    def _served(self, job: _Job) -> None:
        if job.req.online:
            self.ttft.append(job.ttft_ms)
            if not math.isnan(job.tbt_ms):
                self.tbt.append(job.tbt_ms)
        else:
            self.offline_done += 1
            self.offline_ttft.append(job.ttft_ms)


def simulate(records: Sequence[TraceRecord], cfg: SimConfig, cost: CostModel | None = None,
             offline: Collection[int] | None = None,
             warm: Sequence[TraceRecord] = ()) -> SimResult:
    """Replays ``records`` through the simulated cluster.

    Args:
        records: the trace (``kvstore.tools.demo.trace.load_trace``), in arrival order.
        cfg: the settings.
        cost: the cost model; default: the bundled GPU-class model.
        offline: positions in ``records`` of the offline requests; None marks
            ``cfg.offline_fraction`` of them at random (seeded).
        warm: requests whose blocks are in every pool before the first arrival
            (a warm-up, e.g. the demo's), not replayed.

    Returns:
        The measurements.
    """
    started = time.perf_counter()
    cost = cost or load_cost_model(DEFAULT_COST_MODEL)
    sim = _Simulation(records, cfg, cost, offline, warm)
    end_ms = sim.run()
    online = sum(1 for j in sim.jobs if j.req.online)
    return SimResult(
        config=cfg, cost_model=cost.name, cache_blocks=sim.cache_blocks, requests=len(sim.jobs),
        online=online, rejected=sum(sim.rejected.values()), rejected_late=sim.rejected_late,
        rejected_by_reason=dict(sorted(sim.rejected.items())), ttft_ms=latency_stats(sim.ttft),
        tbt_ms=latency_stats(sim.tbt), offline_completed=sim.offline_done,
        offline_ttft_ms=latency_stats(sim.offline_ttft),
        block_hit_rate=sim.blocks_reused / sim.blocks_total if sim.blocks_total else 0.0,
        transferred_blocks=sim.transferred, sim_duration_s=end_ms / 1000,
        wall_s=time.perf_counter() - started)


# ---------------------------------------------------------------- CLI


def result_table(res: SimResult):
    """A rich Table of one run."""
    from rich.table import Table

    s = res.summary()
    table = Table(title=f"simulate: {res.config.scheduler} / rejection {res.config.rejection}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    st = s["settings"]
    table.add_row("instances", f"{st['prefill']} prefill + {st['decode']} decode")
    table.add_row("cost model / speed", f"{res.cost_model} / {st['speed']}x")
    table.add_row("SLOs", f"TTFT {st['ttft_slo_ms'] or 'none'} ms, TBT {st['tbt_slo_ms'] or 'none'} ms")
    table.add_row("cache per prefill", f"{res.cache_blocks:,} blocks ({res.config.eviction})")
    table.add_row("requests", f"{res.requests:,}")
    table.add_row("rejected", f"{res.rejected:,} ({res.rejected_late:,} after prefill)")
    for reason, n in res.rejected_by_reason.items():
        table.add_row(f"  {reason}", f"{n:,}")
    for name in ("ttft_ms", "tbt_ms"):
        d = s[name]
        table.add_row(name.replace("_ms", " (ms)"),
                      "  ".join(f"{k} {_ms(d[k])}" for k in ("mean", "p50", "p90", "p99")))
    table.add_row("block hit rate", f"{100 * res.block_hit_rate:.2f}%")
    table.add_row("blocks transferred", f"{res.transferred_blocks:,}")
    if "offline" in s:
        off = s["offline"]
        table.add_row("offline", f"{off['completed']:,}/{off['requests']:,} done, "
                                  f"mean TTFT {_ms(off['ttft_ms']['mean'], 0)} ms")
    table.add_row("simulated / wall", f"{res.sim_duration_s:,.0f} s / {res.wall_s:.1f} s")
    return table


def simulate_command(
    trace: Optional[str] = typer.Option(None, "--trace", help="trace JSONL, or a bundled name: conversation, synthetic"),
    scheduler: str = typer.Option(DEFAULT_SCHEDULING_POLICY, "--scheduler",
                                  help="random | load-balance | local-cache-aware | global-cache-aware"),
    rejection: str = typer.Option(DEFAULT_REJECTION_POLICY, "--rejection", help="none | early | predictive"),
    prefill: int = typer.Option(8, "--prefill", min=1, help="prefill instances"),
    decode: int = typer.Option(8, "--decode", min=1, help="decode instances"),
    speed: float = typer.Option(1.0, "--speed", help="arrival-rate multiplier"),
    cost_model: str = typer.Option(DEFAULT_COST_MODEL, "--cost-model", help="cost model JSON, or a bundled name"),
    ttft_slo_ms: float = typer.Option(30_000.0, "--ttft-slo-ms", help="TTFT SLO ('inf': none)"),
    tbt_slo_ms: float = typer.Option(100.0, "--tbt-slo-ms", help="TBT SLO ('inf': none)"),
    no_slo: bool = typer.Option(False, "--no-slo", help="no SLOs: nothing is refused for latency"),
    cache_blocks: Optional[int] = typer.Option(None, "--cache-blocks", min=0,
                                               help="local pool per prefill instance (default: the cost model's)"),
    eviction: str = typer.Option("default", "--eviction", help="pool eviction policy (default, lru, lfu)"),
    balance_ratio: float = typer.Option(1.2, "--balance-ratio", help="kvcache_balancing_threshold"),
    departures: str = typer.Option("survival", "--departures",
                                   help="predictive rejection's departure model: survival | uniform (the paper's)"),
    offline_fraction: float = typer.Option(0.0, "--offline-fraction", help="share of requests marked offline"),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="first N requests only"),
    seed: int = typer.Option(0, "--seed"),
    json_out: bool = typer.Option(False, "--json", help="print the summary as JSON on stdout"),
) -> None:
    """Simulate the cluster on a trace with the conductor's scheduler and a cost model."""
    from rich.console import Console

    try:
        path = resolve_trace(trace)
        cost = load_cost_model(cost_model)
        cfg = SimConfig(scheduler=scheduler, rejection=rejection, num_prefill=prefill, num_decode=decode,
                        speed=speed, ttft_slo_ms=math.inf if no_slo else ttft_slo_ms,
                        tbt_slo_ms=math.inf if no_slo else tbt_slo_ms, cache_blocks=cache_blocks,
                        eviction=eviction, balance_ratio=balance_ratio, departures=departures,
                        offline_fraction=offline_fraction, seed=seed)
        records = load_trace(path, limit=limit)
        res = simulate(records, cfg, cost)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc.args[0] if exc.args else exc}", err=True)
        raise typer.Exit(2)
    Console(stderr=json_out).print(result_table(res))
    if json_out:
        sys.stdout.write(json.dumps(res.summary(), indent=2) + "\n")


def main() -> None:
    """``python -m kvstore.tools.sim.simulate``: the same command, standalone."""
    typer.run(simulate_command)


if __name__ == "__main__":
    main()
