"""Cache-policy simulator: the store's own eviction code over trace ``hash_ids``.

``simulate`` replays a Mooncake trace against one tier of fixed capacity (in
blocks, every block the same size) and counts prefix hits. It drives the
policies of ``kvstore.store.eviction`` through the same calls a store node
makes (``on_insert`` / ``on_access`` / ``on_prefetch`` / ``victims`` /
``on_remove``); the simulator is the "store" that executes the evictions.

Replay, one request at a time, in trace order::

    keys   = chain keys of the request's blocks (block j is the chain hash_ids[:j+1])
    hits  += the longest run of leading keys that are cached        (prefix semantics)
    evict    max(0, cached + missing - capacity) victims, proposed by the policy;
             the request's own keys and lookahead-protected keys are vetoed
    touch    every key head to tail: on_access if cached, else on_insert
             (parent = the previous key), as long as room is left

``hit_rate = hits / total blocks``. Two prefixes that end in the same hash id
are different blocks: block keys are interned chains ``(parent key, hash id)``.
Policies see the trace clock (``timestamp`` in seconds) as ``now``.

Queue lookahead (``lookahead=W``), modelling the conductor telling the store
what its queue will need (DESIGN.md, "Queue-lookahead prefetch"): while request
``i`` is served, every key of requests ``i+1 .. i+W`` is protected -- the
store's ``can_evict`` vetoes it, under every policy -- and when a request
enters that window, each of its keys that is cached gets one
``on_prefetch(key, now)`` hint. What a policy does with the hint is its own
business: ``lru`` and ``lfu`` ignore it, ``default`` refreshes the key's
recency. Nothing is fetched from elsewhere (there is one tier), so lookahead
helps only by keeping what is about to be used.

``belady`` is the offline reference (Belady, "A study of replacement
algorithms for a virtual-storage computer", IBM Systems Journal 5(2), 1966):
evict the key whose next use lies farthest in the future. Since a block's
parent is used whenever the block is, its next use is never later than its
children's, and Belady evicts tails first (ties: the deeper block first).
It runs through the same eviction loop, with the future as its priority.

CLI: ``kvstore simulate-cache --trace PATH --policy lru --policy default
--capacities 1000,3000 --lookahead 64 --json`` (``simulate_cache_command``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

import typer

import kvstore.store.eviction  # noqa: F401  (registers the policies)
from kvstore.store.eviction.base import POLICIES, EvictionPolicy, Key, PolicyEntry, make_policy
from kvstore.tools.demo.trace import TraceRecord, intern_chains, load_trace, resolve_trace

logger = logging.getLogger(__name__)

DEFAULT_CAPACITIES = (1000, 3000, 10000, 30000, 100000)
"""Capacities (in blocks) of the table in docs/tiers.md."""

DEFAULT_POLICIES = ("lru", "lfu", "default", "belady")
"""Policies of the table in docs/tiers.md; ``belady`` is the offline reference."""

_NEVER = 1 << 62  # next use of a key that is never used again


@dataclass(frozen=True, slots=True)
class SimResult:
    """One simulated (policy, capacity, lookahead) point."""

    policy: str  # registry name, or "belady"
    capacity_blocks: int  # tier size in blocks
    lookahead: int  # W: requests of queue lookahead, 0 for none
    hit_rate: float  # hits / total
    hits: int  # blocks served from the cache (leading runs only)
    total: int  # blocks requested


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN: evict the key whose next use is farthest (offline only).

    Args:
        next_use: a live map key -> index of the next request that uses it,
            kept current by the simulator before each touch. Keys missing
            from it are never used again.

    Thread safety: simulator only; see ``base``.
    """

    name = "belady"

    def __init__(self, next_use: Mapping[Key, int]) -> None:
        super().__init__()
        self._next_use = next_use

    def _priority(self, entry: PolicyEntry) -> tuple:
        # Farthest next use first; among equals the later-touched (deeper) key.
        return (-self._next_use.get(entry.key, _NEVER), -entry.seq)


@dataclass(slots=True)
class Workload:
    """A trace turned into interned chain keys, shared by all runs."""

    keys: list[tuple[int, ...]]  # per request: chain keys of its blocks, head to tail
    now_s: list[float]  # per request: trace clock in seconds
    next_use: list[list[int]]  # per request, per block: index of the next request using it
    total: int  # blocks over all requests


def build_workload(records: Sequence[TraceRecord]) -> Workload:
    """Interns each block's prefix chain into an int key and precomputes next uses.

    Key of block j = intern((key of block j-1, hash_ids[j])), so equal keys
    mean equal prefixes through that block (:func:`kvstore.tools.demo.trace.intern_chains`).
    """
    keys = intern_chains(records)
    next_use: list[list[int]] = [[]] * len(keys)
    seen: dict[int, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        ks = keys[i]
        next_use[i] = [seen.get(k, _NEVER) for k in ks]
        for k in ks:
            seen[k] = i
    return Workload(keys=keys, now_s=[r.timestamp_ms / 1000.0 for r in records],
                     next_use=next_use, total=sum(len(ks) for ks in keys))


def _make(policy_name: str, next_use: dict[int, int]) -> EvictionPolicy:
    if policy_name == BeladyPolicy.name:
        return BeladyPolicy(next_use)
    return make_policy(policy_name)


def simulate(trace_records: Sequence[TraceRecord] | Workload, policy_name: str, capacity_blocks: int,
             lookahead: int = 0) -> SimResult:
    """Replays a trace against one tier (see the module docstring).

    Args:
        trace_records: the trace (``load_trace``), or a ``build_workload`` of it
            to share the key interning between runs.
        policy_name: a registered eviction policy, or ``"belady"``.
        capacity_blocks: tier size in blocks, >= 1.
        lookahead: W, the number of queued requests whose keys are protected
            (and hinted) while a request is served; 0 disables.

    Returns:
        The hit counts.

    Raises:
        KeyError: unknown policy.
        ValueError: capacity or lookahead out of range.
    """
    if capacity_blocks < 1:
        raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
    if lookahead < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead}")
    wl = trace_records if isinstance(trace_records, Workload) else build_workload(trace_records)
    future: dict[int, int] = {}  # belady's oracle: key -> next request using it
    policy = _make(policy_name, future)
    is_belady = isinstance(policy, BeladyPolicy)
    cached: set[int] = set()  # what the simulated tier holds
    protected: dict[int, int] = {}  # key -> how many of requests i+1 .. i+W use it
    current: set[int] = set()
    hits = 0

    def can_evict(key: Key) -> bool:
        return key not in current and key not in protected

    n_req = len(wl.keys)
    for i, ks in enumerate(wl.keys):
        now = wl.now_s[i]
        if lookahead:
            if i == 0:
                for r in range(1, min(lookahead, n_req - 1) + 1):
                    _announce(wl.keys[r], policy, cached, protected, now)
            else:
                for k in ks:  # request i leaves the window (it was announced at i - W)
                    c = protected[k]
                    if c > 1:
                        protected[k] = c - 1
                    else:
                        del protected[k]
                if i + lookahead < n_req:
                    _announce(wl.keys[i + lookahead], policy, cached, protected, now)
        n = len(ks)
        h = 0
        while h < n and ks[h] in cached:
            h += 1
        hits += h
        current = set(ks)
        missing = sum(1 for k in ks if k not in cached)
        excess = len(cached) + missing - capacity_blocks
        if excess > 0:
            for victim in policy.victims(count=excess, can_evict=can_evict):
                cached.discard(victim)
                policy.on_remove(victim)
        nu = wl.next_use[i]
        parent: int | None = None
        room = True
        for j, k in enumerate(ks):
            if is_belady:
                future[k] = nu[j]
            if k in cached:
                policy.on_access(k, now)
            elif room and len(cached) < capacity_blocks:
                cached.add(k)
                policy.on_insert(k, 1, now, parent=parent)
            else:
                room = False  # a block past a gap is useless for prefix hits
            parent = k
    return SimResult(policy=policy_name, capacity_blocks=capacity_blocks, lookahead=lookahead,
                     hit_rate=hits / wl.total if wl.total else 0.0, hits=hits, total=wl.total)


def _announce(ks: list[int], policy: EvictionPolicy, cached: set[int],
              protected: dict[int, int], now: float) -> None:
    """A queued request entered the lookahead window: protect and hint its keys."""
    for k in ks:
        protected[k] = protected.get(k, 0) + 1
        if k in cached:
            policy.on_prefetch(k, now)


# ---------------------------------------------------------------- tables and CLI

_worker_workload: Workload | None = None  # per worker process, built once


def _init_worker(trace_path: str) -> None:
    global _worker_workload
    _worker_workload = build_workload(load_trace(trace_path))


def _run_point(args: tuple[str, int, int]) -> SimResult:
    assert _worker_workload is not None, "worker not initialised"
    return simulate(_worker_workload, *args)


def run_table(trace_path: str | Path, policies: Sequence[str], capacities: Sequence[int],
              lookahead: int = 0, jobs: int = 1,
              on_done: Optional[Callable[[SimResult], None]] = None) -> list[SimResult]:
    """Simulates every (policy, capacity) point of one trace.

    Args:
        trace_path: the trace JSONL.
        policies: registered names and/or "belady".
        capacities: tier sizes in blocks.
        lookahead: W for every point (see ``simulate``).
        jobs: worker processes; 1 runs in this process.
        on_done: called as each point finishes (in any order).

    Returns:
        The results, ordered by capacity, then by ``policies``.

    Raises:
        KeyError: an unknown policy (checked before any work starts).
    """
    for name in policies:
        if name != BeladyPolicy.name and name not in POLICIES:
            raise KeyError(f"unknown policy {name!r}; known: {sorted(POLICIES) + [BeladyPolicy.name]}")
    points = [(p, c, lookahead) for c in capacities for p in policies]
    results: dict[tuple[str, int], SimResult] = {}
    if jobs <= 1 or len(points) == 1:
        wl = build_workload(load_trace(trace_path))
        for p, c, w in points:
            res = simulate(wl, p, c, lookahead=w)
            results[(p, c)] = res
            if on_done is not None:
                on_done(res)
    else:
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # Longest points first (large caches, belady) keep the workers busy to the end.
        order = sorted(points, key=lambda pt: -pt[1])
        with ProcessPoolExecutor(max_workers=jobs, initializer=_init_worker,
                                 initargs=(str(trace_path),)) as pool:
            futures = [pool.submit(_run_point, pt) for pt in order]
            for fut in as_completed(futures):
                res = fut.result()
                results[(res.policy, res.capacity_blocks)] = res
                if on_done is not None:
                    on_done(res)
    return [results[(p, c)] for p, c, _ in points]


def results_table(results: Sequence[SimResult], title: str):
    """A rich Table: one row per capacity, one column per policy (hit rate in %)."""
    from rich.table import Table

    policies = list(dict.fromkeys(r.policy for r in results))
    capacities = list(dict.fromkeys(r.capacity_blocks for r in results))
    rate = {(r.policy, r.capacity_blocks): r.hit_rate for r in results}
    table = Table(title=title)
    table.add_column("capacity (blocks)", justify="right")
    for p in policies:
        table.add_column(p, justify="right")
    for c in capacities:
        table.add_row(f"{c:,}", *(f"{100 * rate[(p, c)]:.2f}%" for p in policies))
    return table


def markdown_table(results: Sequence[SimResult]) -> str:
    """The same table as GitHub markdown (for docs/tiers.md)."""
    policies = list(dict.fromkeys(r.policy for r in results))
    capacities = list(dict.fromkeys(r.capacity_blocks for r in results))
    rate = {(r.policy, r.capacity_blocks): r.hit_rate for r in results}
    lines = ["| capacity (blocks) | " + " | ".join(policies) + " |",
             "|---:|" + "---:|" * len(policies)]
    for c in capacities:
        lines.append(f"| {c:,} | " + " | ".join(f"{100 * rate[(p, c)]:.2f}%" for p in policies) + " |")
    return "\n".join(lines)


def plot_results(results: Sequence[SimResult], path: str | Path, title: str) -> bool:
    """Writes hit rate vs capacity (log x), one line per policy, as a PNG.

    Returns:
        False when matplotlib is not installed (nothing written).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed; no plot written")
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r.policy for r in results):
        pts = sorted((r.capacity_blocks, r.hit_rate) for r in results if r.policy == policy)
        style = {"linestyle": "--", "color": "black"} if policy == BeladyPolicy.name else {}
        ax.plot([c for c, _ in pts], [100 * h for _, h in pts], marker="o", label=policy, **style)
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("prefix hit rate (%)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def simulate_cache_main(trace: str | None, policies: Sequence[str], capacities: Sequence[int],
                        lookahead: int = 0, json_out: bool = False, plot: str | None = "cache_sim.png",
                        jobs: int | None = None) -> list[SimResult]:
    """``kvstore simulate-cache``: simulate, then print a table, a plot and/or JSON.

    Args:
        trace: a bundled trace name, a JSONL path, or None (conversation).
        policies: policy names (registry names or "belady"); empty means
            ``DEFAULT_POLICIES``.
        capacities: tier sizes in blocks; empty means ``DEFAULT_CAPACITIES``.
        lookahead: queue-lookahead window W in requests.
        json_out: print the rows as a JSON list on stdout (the table then
            goes to stderr).
        plot: PNG path for the plot; None or "" for none.
        jobs: worker processes; None uses every CPU.

    Returns:
        The results.
    """
    import os

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    policies = list(policies) or list(DEFAULT_POLICIES)
    capacities = sorted(set(capacities or DEFAULT_CAPACITIES))
    path = resolve_trace(trace)
    jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    err = Console(stderr=True)
    out = err if json_out else Console()
    title = f"prefix hit rate, {path.name}" + (f", lookahead {lookahead}" if lookahead else "")
    started = time.perf_counter()
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(), console=err, transient=True) as bar:
        task = bar.add_task(f"simulating {path.name}", total=len(policies) * len(capacities))
        results = run_table(path, policies, capacities, lookahead=lookahead,
                            jobs=min(jobs, len(policies) * len(capacities)),
                            on_done=lambda _res: bar.advance(task))
    elapsed = time.perf_counter() - started
    out.print(results_table(results, title))
    out.print(f"[dim]{len(results)} runs in {elapsed:.1f} s[/]")
    if plot and plot_results(results, plot, title):
        out.print(f"plot written to {plot}")
    if json_out:
        rows = [{"policy": r.policy, "capacity_blocks": r.capacity_blocks,
                 "lookahead": r.lookahead, "hit_rate": r.hit_rate} for r in results]
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    return results


def _parse_capacities(text: str) -> list[int]:
    try:
        caps = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"capacities must be comma-separated integers, got {text!r}") from None
    if not caps or min(caps) < 1:
        raise ValueError(f"capacities must be positive integers, got {text!r}")
    return caps


def simulate_cache_command(
    trace: Optional[str] = typer.Option(None, "--trace", help="trace JSONL, or a bundled name: conversation, synthetic"),
    policy: Optional[list[str]] = typer.Option(None, "--policy", "-p",
                                               help="policy to simulate (repeatable; 'belady' = offline optimum)"),
    capacities: str = typer.Option(",".join(str(c) for c in DEFAULT_CAPACITIES), "--capacities",
                                   help="comma-separated tier sizes in blocks"),
    lookahead: int = typer.Option(0, "--lookahead", min=0,
                                  help="protect (and hint) the blocks of the next W queued requests"),
    json_out: bool = typer.Option(False, "--json", help="print the rows as JSON on stdout"),
    plot: str = typer.Option("cache_sim.png", "--plot", help="PNG plot path ('' for none)"),
    jobs: Optional[int] = typer.Option(None, "--jobs", "-j", min=1, help="worker processes (default: all CPUs)"),
) -> None:
    """Replay a trace's prefix blocks against the store's eviction policies."""

    try:
        simulate_cache_main(trace, policy or [], _parse_capacities(capacities), lookahead=lookahead,
                            json_out=json_out, plot=plot or None, jobs=jobs)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc.args[0] if exc.args else exc}", err=True)
        raise typer.Exit(2)


def main() -> None:
    """``python -m kvstore.tools.sim.cache``: the same command, standalone."""

    typer.run(simulate_cache_command)


if __name__ == "__main__":
    main()
