"""``kvstore bench``: the typer command, and the systems a run measures, in order.

The command parses the options, shows progress on stderr, runs
:func:`run_bench` and prints the tables (:mod:`~kvstore.tools.bench.report`)
or, with ``--json``, the rows. Notes (peers skipped, parsers, checksum
checks) go to stderr.
"""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from kvstore.sizes import parse_size
from kvstore.tools.bench import (kvstore_peer, kvstore_tls_peer, mooncake_peer, redis_peer,
                                  resp_peer, socket_peer)
from kvstore.tools.bench.harness import StartSystem, run_systems
from kvstore.tools.bench.report import render

#: Start order, which is also the order each size is measured in: the socket peer starts
#: first (its process comes up while the others start), kvstore last, then (``--tls``)
#: kvstore with TLS, so each TLS row follows its plain twin closely, then (``--resp``)
#: the RESP front beside its own redis-server. The cold-memcpy limit is timed by
#: kvstore's module, beside its shm gets.
SYSTEMS_IN_RUN_ORDER: tuple[StartSystem, ...] = (
    socket_peer.start, redis_peer.start, mooncake_peer.start, kvstore_peer.start,
    kvstore_tls_peer.start, resp_peer.start)


def run_bench(sizes: str | list[int] = "64KiB,1MiB,4MiB", *, log_dir: str | None = None,
              **options) -> list[dict]:
    """Run every measurement once; rows as dicts (see :class:`~.harness.Row`), in table order.

    Args:
        sizes: value sizes, ``"64KiB,1MiB"`` or a list of byte counts.
        log_dir: cluster logs (default: a temporary directory, removed afterwards).
        **options: any :class:`~.harness.BenchConfig` field.
    """
    return run_systems(SYSTEMS_IN_RUN_ORDER, sizes, log_dir=log_dir, **options)


def num_steps(num_sizes: int, use_redis: bool, use_mooncake: bool = False,
              tls: bool = False, resp: bool = False) -> int:
    """Progress labels a run reports (for a progress bar's total): per size, the socket's
    4, redis's 2, mooncake's 1, kvstore's 14 (6 of them asyncio), its TLS rows' 4 and the
    RESP front's 6 (4 redis-benchmark runs, 2 redis-py rows); then the exists and lookup rows."""
    return num_sizes * (4 + 2 * use_redis + use_mooncake + 14 + 4 * tls + 6 * resp) + 2


def bench_command(
    sizes: str = typer.Option("64KiB,1MiB,4MiB", help="value sizes, comma-separated"),
    json_out: bool = typer.Option(False, "--json", help="print the rows as JSON on stdout"),
    duration_s: float = typer.Option(1.0, "--duration-s", help="timed budget per measurement"),
    warmup_s: float = typer.Option(0.2, "--warmup-s", help="untimed warm-up per measurement"),
    rounds: int = typer.Option(3, help="rounds per budget; the median round is reported"),
    verify: Optional[bool] = typer.Option(None, "--verify/--no-verify",
                                help="check every get (default: TCP gets only)"),
    clients: int = typer.Option(4, help="client processes in the concurrent rows"),
    concurrent_shm: bool = typer.Option(False, "--concurrent-shm",
                                        help="concurrent clients use shared memory, not TCP"),
    batch_keys: int = typer.Option(32, help="keys per batched call (tcp-batch rows)"),
    exists_keys: int = typer.Option(1000, help="keys per batch_exists call"),
    node_dram: str = typer.Option("3GiB", help="DRAM of the benchmark's store node"),
    redis: bool = typer.Option(True, "--redis/--no-redis", help="measure Redis when installed"),
    mooncake: bool = typer.Option(True, "--mooncake/--no-mooncake",
                                  help="measure Mooncake Store when installed"),
    tls: bool = typer.Option(False, "--tls",
                             help="also measure kvstore's TCP paths over mutual TLS "
                                  "(a second cluster with throwaway certificates and tokens)"),
    resp: bool = typer.Option(False, "--resp",
                              help="also measure the RESP front (kvstore resp) beside a "
                                   "redis-server: redis-benchmark -P 16 and redis-py rows"),
    metrics: bool = typer.Option(False, "--metrics",
                                 help="kvstore's master and node serve --metrics-port and are "
                                      "scraped every few seconds (what metrics cost)"),
    log_dir: Optional[str] = typer.Option(None, help="cluster logs (default: a temp dir)"),
) -> None:
    """Measure kvstore's data plane beside memcpy, a raw socket, Redis and Mooncake Store."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from kvstore.tools.cluster.processes import ChildFailed

    out, err = Console(), Console(stderr=True)
    try:
        size_list = [parse_size(s) for s in sizes.split(",")]
    except ValueError as exc:
        err.print(f"[red]{exc}[/]")
        raise typer.Exit(2)
    # Redrawn once per step, not by a 10 Hz thread: that thread's CPU would count as
    # the client's in every row's CPU columns.
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                        console=err, transient=True, auto_refresh=False)
    uses_mooncake = mooncake and mooncake_peer.master_binary() is not None
    task = progress.add_task("starting",
                             total=num_steps(len(size_list), redis, uses_mooncake, tls, resp))

    def step(label: str) -> None:
        progress.update(task, description=label, advance=1, refresh=True)

    try:
        with progress:
            rows = run_bench(size_list, log_dir=log_dir, duration_s=duration_s,
                             warmup_s=warmup_s, rounds=rounds, verify=verify, clients=clients,
                             concurrent_shm=concurrent_shm, batch_keys=batch_keys,
                             exists_keys=exists_keys, node_dram=node_dram, use_redis=redis,
                             use_mooncake=mooncake, tls=tls, metrics=metrics, use_resp=resp,
                             progress=step, note=lambda t: err.print(f"note: {t}"))
    except (ChildFailed, RuntimeError) as exc:
        err.print(f"[red]benchmark failed:[/] {exc}")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted; cluster stopped[/]")
        raise typer.Exit(130)
    if json_out:
        sys.stdout.write(json.dumps(rows) + "\n")
    else:
        out.print(render(rows, verify))
