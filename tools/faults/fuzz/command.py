"""``kvstore fuzz``: the typer command, its progress bar, the table or the JSON line.

Exit status: 0 when every invariant held (:meth:`~.report.FuzzReport.failures`
is empty), 1 when one broke, 2 for bad options or a cluster that did not start.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
from typing import Optional

import typer
from rich.console import Console

from kvstore.tools.faults.fuzz.report import SURFACES, render


def fuzz_command(
    inputs: int = typer.Option(20_000, "--inputs", "-n", help="inputs to send, over all surfaces"),
    seed: int = typer.Option(1, help="the run's seed: the same seed sends the same inputs"),
    surfaces: str = typer.Option(",".join(SURFACES), help="comma-separated subset of "
                                 + ", ".join(SURFACES)),
    batch: int = typer.Option(5000, help="inputs between two invariant checks"),
    warmup: int = typer.Option(20_000, help="inputs of the first batch, after which memory "
                                            "is first sampled (at most half the run)"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON report line only"),
    attach: Optional[str] = typer.Option(
        None, help="a running cluster's JSON description (see kvstore.tools.faults.fuzz.cluster."
                   "Target.attach) instead of a fresh local one"),
    max_rss_ratio: float = typer.Option(1.5, help="largest RSS growth allowed after warm-up"),
    log_dir: Optional[str] = typer.Option(None, help="process logs (default: a temp dir)"),
) -> None:
    """Seeded fuzzing of the node's data port (TCP and Unix socket), the master's gRPC
    methods and the conductor's HTTP front, with invariants checked after every batch."""
    from kvstore.errors import KVStoreError
    from kvstore.tools.faults.fuzz.cluster import Target, start_fuzz_cluster
    from kvstore.tools.faults.fuzz.runner import run_fuzz
    from kvstore.tools.cluster.processes import ChildFailed

    logging.basicConfig(level=logging.ERROR)
    console = Console(stderr=True)
    if not console.is_terminal:          # a log file: lines as wide as the table
        console = Console(stderr=True, width=160)
    chosen = [s.strip() for s in surfaces.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SURFACES))
    if unknown or not chosen or inputs < 1 or batch < 1:
        typer.echo(f"kvstore fuzz: error: --surfaces takes {', '.join(SURFACES)}; "
                   f"--inputs and --batch must be >= 1", err=True)
        raise typer.Exit(2)
    cluster = None
    popen = None
    try:
        if attach:
            target = Target.attach(attach)
        else:
            log_dir = log_dir or tempfile.mkdtemp(prefix="kvstore-fuzz-")
            os.makedirs(log_dir, exist_ok=True)
            if not json_out:
                console.print(f"starting a cluster with --auth (logs in {log_dir})")
            cluster = start_fuzz_cluster(log_dir, http="http" in chosen, resp="resp" in chosen,
                                         on_step=None if json_out else console.print)
            target = cluster.target
            names = {"master0": "master", "n0": "node", "prefill0": "prefill",
                     "decode0": "decode", "conductor": "conductor", "resp-front": "resp"}
            popen = {names[c.name]: c.proc for c in cluster.procs.children if c.name in names}
    except (OSError, ValueError, KeyError, ChildFailed) as exc:
        typer.echo(f"kvstore fuzz: error: {exc}", err=True)
        if cluster is not None:
            cluster.stop()
        raise typer.Exit(2)
    try:
        report = _run(run_fuzz, console, json_out, target, inputs=inputs, seed=seed,
                      surfaces=chosen, batch=batch, warmup=warmup, popen=popen,
                      max_rss_ratio=max_rss_ratio)
    except (ValueError, KVStoreError) as exc:
        typer.echo(f"kvstore fuzz: error: {exc}", err=True)
        raise typer.Exit(2)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]")
        raise typer.Exit(130)
    finally:
        if cluster is not None:
            cluster.stop()
    if json_out:
        print(json.dumps(report.to_dict()))
    else:
        out = Console()
        render(report, out if out.is_terminal else Console(width=160))
        for line in report.failures():
            console.print(f"[red]FAIL[/] {line}")
        for name, s in report.surfaces.items():
            for sample in s.samples[:5]:
                console.print(f"[yellow]{name}[/]: {sample}")
    sys.stdout.flush()
    if report.failures():
        raise typer.Exit(1)


def _run(run_fuzz, console: Console, quiet: bool, target, *, inputs: int, **options):
    """``run_fuzz`` with a progress bar (a line per batch when stderr is not a terminal)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    with Progress(TextColumn("fuzz"), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"),
                  TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[note]}"),
                  console=console, disable=quiet) as progress:
        task = progress.add_task("fuzz", total=inputs, note="")

        def on_batch(report, done: int) -> None:
            bad = report.failures()
            progress.update(task, completed=done,
                            note=f"[red]{len(bad)} failing[/]" if bad else "[green]ok[/]")
            if not quiet and not console.is_terminal:
                rss = ", ".join(f"{n} {t.last_bytes / 2**20:.0f}" for n, t in report.rss.items())
                console.print(f"batch {report.batches}: {done:,}/{inputs:,} inputs, "
                              f"{report.elapsed_s:.0f} s, RSS MiB {rss}; "
                              + ("; ".join(bad) if bad else "invariants hold"))

        return run_fuzz(target, inputs=inputs, on_batch=on_batch, **options)
