"""``kvstore partition``: the command, its progress and its table."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from kvstore.tools.faults.partition.scenario import PartitionReport, run_partition

_FIGURES = [("stepdown_s", "stepped down"), ("takeover_s", "standby took over"),
            ("serving_s", "standby serving"), ("fenced_s", "fenced"),
            ("dead_s", "declared dead"), ("max_read_s", "slowest read"),
            ("recovery_s", "recovery"), ("rejoin_s", "rejoined after mend")]


def print_report(report: PartitionReport, console) -> None:
    """One column per cut, one row per figure; then the counts and any failure."""
    from rich.table import Table

    table = Table("", *(f"{row['cut']} ({row['target']})" for row in report.cuts))
    table.add_row("link down", *(f"{row['host']}'s {row['network']}" for row in report.cuts))
    table.add_row("at, for", *(f"{row['at_s']} s, {row['for_s']} s" for row in report.cuts))
    for key, label in _FIGURES:
        if any(row.get(key) is not None for row in report.cuts):
            table.add_row(label, *(f"{row[key]} s" if row.get(key) is not None else "-"
                                   for row in report.cuts))
    console.print(table)
    console.print(f"acknowledged puts {report.acked_puts}, removed {report.removed}: "
                  f"lost {report.lost}, resurrected {report.resurrected}; reads {report.reads}: "
                  f"wrong {report.wrong_reads}, stale {report.stale_reads}, errors "
                  f"{report.read_errors}, live keys not found {report.not_found_live}; "
                  f"put retries {report.put_errors}")
    for line in report.failures:
        console.print(f"[red]FAILED[/] {line}")
    for line in report.examples:
        console.print(f"  {line}")


def partition_command(
    duration_s: Annotated[float, typer.Option(help="load duration (the cuts are at 8, 26 "
                                                   "and 44 s)")] = 60.0,
    folder: Annotated[str, typer.Option(help="credentials and logs (default: a temp dir)")] = "",
    tls: Annotated[bool, typer.Option("--tls", help="TLS on every port too")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="print only the JSON report")] = False,
) -> None:
    """Cut links (leader from etcd and nodes, a node from its master, clients from a
    replica) on hosts made of network namespaces, under load; needs root."""
    from rich.console import Console

    from kvstore.tools.cluster.netns import unavailable

    why = unavailable()
    if why:
        typer.echo(f"kvstore partition: error: {why}", err=True)
        raise typer.Exit(2)
    console = Console(stderr=json_out)
    report = run_partition(folder or None, duration_s=duration_s, tls=tls,
                           on_step=console.print)
    if json_out:
        print(json.dumps(report.to_dict()))
    else:
        print_report(report, console)
    if not report.passed:
        raise typer.Exit(1)
