"""``kvstore``: run the demo or any component by hand.

    kvstore demo [--requests N] [--trace PATH] [--no-cache | --cache-only] [--overload] [--out FILE]
    kvstore master | node | prefill | decode | conductor | http | resp  [options, see --help]
    kvstore up [--masters N --nodes M --standbys K --etcd URL|local]
    kvstore chaos [--json]
    kvstore fuzz [--inputs N] [--seed S] [--surfaces ...] [--json]
    kvstore vllm-config --master ADDR [--role ROLE] | vllm-env VENV [--checkout DIR] [--fresh]
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import typer
from rich.console import Console

_app = typer.Typer(add_completion=False, no_args_is_help=True,
                   help="kvstore: a distributed KVCache store for disaggregated LLM serving.")
_PASS = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@_app.command()
def demo(
    requests: int = typer.Option(200, "--requests", "-n", help="requests measured (the window)"),
    trace: Optional[str] = typer.Option(None, help="trace JSONL (default: bundled conversation trace)"),
    no_cache: bool = typer.Option(False, "--no-cache", help="only the run without the cache"),
    cache_only: bool = typer.Option(False, "--cache-only", help="only the run with the cache"),
    out: Optional[str] = typer.Option(None, help="write the JSON (both summaries and the "
                                                 "comparison; one summary with --no-cache)"),
    warmup: int = typer.Option(400, help="requests before the window that fill the store, "
                                         "not counted (0: none)"),
    window_start: Optional[int] = typer.Option(
        None, help="first measured request (default: the window whose prefix reuse is closest "
                   "to the whole trace's)"),
    time_scale: Optional[float] = typer.Option(
        None, help="trace clock multiplier (0 = all at once; default: derived from "
                   "--target-utilisation)"),
    target_utilisation: float = typer.Option(
        0.35, help="predicted prefill busy fraction without cache that sets the arrival rate"),
    overload: bool = typer.Option(False, "--overload", help="arrivals at twice the capacity, "
                                  "conductor TTFT SLO on: early rejection"),
    plot: Optional[str] = typer.Option(None, help="TTFT plot PNG (needs the plot extra; default: "
                                                  "beside --out, else in the log folder)"),
    block_tokens: int = typer.Option(16, help="tokens per KV block (a trace block is 512)"),
    max_output_tokens: int = typer.Option(16, help="cap on generated tokens per request"),
    node_dram: str = typer.Option("512MiB", help="DRAM tier per store node"),
    log_dir: Optional[str] = typer.Option(None, help="component logs (default: a temp dir)"),
    save_mode: Optional[str] = typer.Option(
        None, help="prefill KV save: 'sync' (default), 'streamed' (blocks, overlapping "
                 "compute) or 'layerwise' (each layer as computed)"),
    cost_model: str = typer.Option(
        "tiny-cpu", help="cost model of the arrival rate and the conductor: a bundled name "
                         "(default: the bundled engines' profile), a JSON file, or 'profile' "
                         "(fit it on this machine first, about 10 s)"),
) -> None:
    """Replay the bundled Mooncake trace on an embedded local cluster, with the prefix
    cache and without it, and compare."""
    from kvstore.errors import InvalidArgument
    from kvstore.tools.demo.run import run_comparison, run_demo
    from kvstore.tools.cluster.processes import ChildFailed

    logging.basicConfig(level=logging.WARNING)
    console = Console()

    def bad(message: str) -> None:
        typer.echo(f"kvstore demo: error: {message}", err=True)
        raise typer.Exit(2)

    if requests < 1:
        bad("--requests must be >= 1")
    if block_tokens < 1 or max_output_tokens < 1:
        bad("--block-tokens and --max-output-tokens must be >= 1")
    from kvstore.sizes import parse_size
    try:
        parse_size(node_dram)
    except ValueError as exc:
        bad(f"--node-dram: {exc}")
    if warmup < 0 or (window_start is not None and window_start < 0):
        bad("--warmup and --window-start must be >= 0")
    if no_cache and cache_only:
        bad("--no-cache and --cache-only exclude each other")
    if target_utilisation <= 0 or (time_scale is not None and time_scale < 0):
        bad("--target-utilisation must be > 0 and --time-scale >= 0")
    if trace and not os.path.isfile(trace):
        bad(f"no trace file at {trace}")
    for name, path in (("--out", out), ("--plot", plot)):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            bad(f"the folder of {name} {path} does not exist")
    from kvstore.engines.kv_saver import SAVE_MODES

    if save_mode is not None and save_mode not in SAVE_MODES:
        bad(f"--save-mode must be one of {sorted(SAVE_MODES)}, got {save_mode!r}")
    if cost_model != "profile":
        from kvstore.conductor.cost_model import load_cost_model

        try:
            load_cost_model(cost_model)
        except (OSError, ValueError) as exc:
            bad(f"--cost-model {cost_model}: {exc}")
    common = dict(requests=requests, trace=trace, out=out, time_scale=time_scale,
                  block_tokens=block_tokens, max_output_tokens=max_output_tokens,
                  node_dram=node_dram, log_dir=log_dir, console=console, save_mode=save_mode,
                  warmup=warmup, window_start=window_start,
                  target_utilisation=target_utilisation, overload=overload,
                  cost_model=cost_model)
    try:
        if no_cache or cache_only:
            summaries = [run_demo(use_cache=cache_only, **common)]
        else:
            result = run_comparison(plot=plot, **common)
            summaries = [result["cache"], result["no_cache"]]
    except InvalidArgument as exc:      # the window does not fit the trace
        bad(str(exc))
    except ChildFailed as exc:
        console.print(f"[red]a cluster process failed:[/] {exc}")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; cluster stopped[/]")
        raise typer.Exit(130)
    if any(s["errors"] or s["warmup"]["errors"] for s in summaries):
        raise typer.Exit(1)
    if len(summaries) == 2 and not result["comparison"]["outputs_identical"]:
        raise typer.Exit(1)


@_app.command()
def up(
    masters: int = typer.Option(1, min=1, max=64, help="master shards (slots split evenly)"),
    nodes: int = typer.Option(2, min=1, max=256, help="store nodes"),
    standbys: int = typer.Option(0, min=0, max=8,
                                 help="standby masters per shard (starts a local etcd "
                                      "unless --etcd names one)"),
    etcd: Optional[str] = typer.Option(None, help="etcd URL for leader election, or 'local' "
                                                  "to start one (needs etcd on PATH)"),
    dram: str = typer.Option("256MiB", help="DRAM tier per store node"),
    metrics: bool = typer.Option(False, "--metrics",
                                 help="every process serves /metrics, /health and /ready "
                                      "(addresses printed; kvctl top finds them)"),
    log_dir: Optional[str] = typer.Option(None, help="process logs (default: a temp dir)"),
) -> None:
    """Start master shards and store nodes on this machine; runs until Ctrl-C."""
    import tempfile
    import time

    from kvstore.tools.cluster.launcher import start_store_cluster
    from kvstore.tools.cluster.processes import ChildFailed

    from kvstore.tools.cli.services import check_dram

    check_dram(dram, nodes)             # before any process starts
    console = Console()
    if standbys and not etcd:
        etcd = "local"
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvstore-up-")
    observed = ("--metrics-port", "0") if metrics else ()
    try:
        c = start_store_cluster(masters, nodes, standbys=standbys, etcd=etcd, dram=dram,
                                log_dir=log_dir, on_step=console.print,
                                eviction_policy="default",
                                master_args=observed, node_args=observed)
    except ChildFailed as exc:
        console.print(f"[red]a cluster process failed:[/] {exc} (logs in {log_dir})")
        raise typer.Exit(1)
    if metrics:
        for child in [m for shard in c.shards for m in shard] + list(c.nodes.values()):
            console.print(f"{child.name}: metrics at http://{child.info['metrics_address']}/metrics")
    console.print(f"shard map: {c.shard_map}")
    if c.etcd is not None:
        console.print(f"etcd: {c.etcd.url}")
    console.print(f"clients: KVClient({c.master!r}); logs in {log_dir}; Ctrl-C stops")
    gone: set[str] = set()
    try:
        # A process that exits (killed to try a failover, say) is reported; the
        # others keep running until Ctrl-C, or until none is left.
        while len(gone) < len(c.procs.children):
            for child in c.procs.children:
                rc = child.proc.poll()
                if rc is not None and child.name not in gone:
                    gone.add(child.name)
                    console.print(f"[yellow]{child.name} exited with code {rc}[/] (the others "
                                  f"keep running; logs in {log_dir})")
            time.sleep(0.5)
        console.print("[red]every process has exited[/]")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        console.print("[yellow]stopping[/]")
    finally:
        c.stop()


@_app.command()
def chaos(
    json_out: bool = typer.Option(False, "--json", help="print only the JSON report"),
    duration_s: float = typer.Option(30.0, help="total run time"),
    kill_node_at_s: float = typer.Option(8.0, help="kill -9 node n0 at this time"),
    kill_leader_at_s: float = typer.Option(18.0, help="kill -9 shard 0's leader at this time"),
    etcd: str = typer.Option("local", help="etcd URL, or 'local' to start one"),
    log_dir: Optional[str] = typer.Option(None, help="process logs (default: a temp dir)"),
    attach: Optional[str] = typer.Option(
        None, help="a running cluster's JSON description (kvstore hosts writes one) "
                   "instead of a fresh local cluster; credentials from $KVSTORE_TOKEN, "
                   "$KVSTORE_TLS_*"),
    kill_node: str = typer.Option("", help="node to kill (default: the first)"),
) -> None:
    """Fresh local cluster (3 nodes, 2 shards with standbys, replica_num=2) under load;
    kill -9 a node, then a shard leader; report lost puts, wrong reads, recovery times."""
    import json

    from kvstore.tools.faults.chaos import run_chaos

    console = Console(stderr=json_out)
    report = run_chaos(duration_s=duration_s, kill_node_at_s=kill_node_at_s,
                       kill_leader_at_s=kill_leader_at_s, etcd=etcd, log_dir=log_dir,
                       on_step=None if json_out else console.print, attach=attach,
                       kill_node=kill_node)
    print(json.dumps(report.to_dict()))
    if report.lost or report.wrong_reads:
        raise typer.Exit(1)


def _register_tools() -> None:
    """Commands whose code lives in tools/, registered when the app is first needed whole
    (:func:`main` for any command but a service, or ``app`` imported from here): their
    modules pull heavy ones (numpy, the simulators, the benchmark's peers), which a
    master or node started by ``kvstore master`` never loads. In ``kvstore --help``
    they stand where they always did, after ``chaos``."""
    global _tools_registered
    if _tools_registered:
        return
    _tools_registered = True
    first = len(_app.registered_commands)
    from kvstore.tools.bench.command import bench_command
    from kvstore.tools.bench.scale import scale_command
    from kvstore.tools.cluster.certs import certs_command
    from kvstore.tools.sim.cache import simulate_cache_command
    from kvstore.tools.faults.fuzz.command import fuzz_command
    from kvstore.tools.cluster.multihost import hosts_command
    from kvstore.tools.faults.partition.command import partition_command
    from kvstore.tools.cli.profile import profile_command
    from kvstore.tools.demo.replay import replay_command
    from kvstore.tools.sim.simulate import simulate_command
    from kvstore.tools.sim.demo import simulate_demo_command
    from kvstore.tools.sim.beyond import simulate_beyond_command
    from kvstore.tools.sim.parity import simulate_parity_command

    _app.command("bench", help="Data-plane benchmark: kvstore vs memcpy, raw sockets, Redis.")(
        bench_command)
    _app.command("scale", help="Millions of small objects in one master and one node: memory "
                               "per object, and kill -9 restarts that must lose no key.")(
        scale_command)
    _app.command("simulate-cache", help="Replay trace hash_ids through the nodes' eviction "
                                        "policies (and Belady's optimum).")(simulate_cache_command)
    _app.command("simulate", help="Discrete-event simulation of the conductor's scheduling "
                                  "over a trace, with a cost model.")(simulate_command)
    _app.command("simulate-beyond", help="Global cache-aware scheduling against + lookahead "
                                         "prefetch, + hot-spot replication, + both, and cache "
                                         "bounds (mean/p90 TTFT, hit rate).")(simulate_beyond_command)
    _app.command("simulate-demo", help="Replay a `kvstore demo --out` run through the simulator: "
                                       "predicted against measured TTFT and TBT.")(
        simulate_demo_command)
    _app.command("simulate-parity", help="Recompute a live conductor's --decision-log with the "
                                         "simulator's scheduler; exit 1 if any choice differs.")(
        simulate_parity_command)
    _app.command("certs", help="Write a test CA, a server certificate for --host names and a "
                               "client certificate (mutual TLS).")(certs_command)
    _app.command("replay", help="Replay the trace against a running conductor (another "
                                 "host's); same summary and digests as the demo.")(replay_command)
    _app.command("hosts", help="Five hosts on this machine (network namespaces, needs root): "
                                "etcd and masters, nodes, engines and conductor, a client "
                                "host; --auth and TLS on. Ctrl-C removes them.")(hosts_command)
    _app.command("partition", help="Cut real links (network namespaces, needs root) under "
                                   "load: a shard leader, a node from its master, clients "
                                   "from a replica; count lost and wrong reads.")(
        partition_command)
    _app.command("fuzz", help="Seeded fuzzing of the data port (TCP, Unix socket), the master's "
                              "gRPC and the HTTP front; checks processes, reads and memory "
                              "after every batch.")(fuzz_command)
    _app.command("profile", help="Fit the cost model (prefill, decode, transfer) from the "
                                 "bundled engines on this machine.")(profile_command)
    added = _app.registered_commands[first:]
    del _app.registered_commands[first:]
    _app.registered_commands[_TOOLS_AT:_TOOLS_AT] = added


_TOOLS_AT = len(_app.registered_commands)    # the tools' place among the commands
_tools_registered = False


def __getattr__(name: str):
    """``app``: the whole Typer app, the tools' commands included (for tests and
    embedding; :func:`main` registers them itself)."""
    if name == "app":
        _register_tools()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@_app.command("vllm-config")
def vllm_config(master: str = typer.Option(..., help="kvstore master HOST:PORT."),
                role: str = typer.Option("kv_both", help="kv_both, kv_producer or kv_consumer.")
                ) -> None:
    """Print the kv_transfer_config JSON that loads kvstore's vLLM connector."""
    from kvstore.client.integrations.vllm.keys import kv_transfer_config_json
    try:
        print(kv_transfer_config_json(master, role))
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--role") from None


@_app.command("vllm-env")
def vllm_env(venv: str = typer.Argument(..., help="the virtual environment to make or update"),
             checkout: Optional[str] = typer.Option(
                 None, help="kvstore checkout to install (default: this editable install's)"),
             fresh: bool = typer.Option(False, "--fresh", help="delete VENV first")) -> None:
    """Make a virtual environment with vLLM's CPU build and this kvstore checkout (for the
    connector and tests/with_vllm); prints its python last. See tools/cluster/vllm_env.py."""
    from kvstore.tools.cluster.vllm_env import main as vllm_env_main

    code = vllm_env_main([venv] + (["--checkout", checkout] if checkout else [])
                         + (["--fresh"] if fresh else []))
    if code:
        raise typer.Exit(code)


#: The service commands' names: :func:`main` runs them without the tools' commands.
_SERVICES: set[str] = set()


def _service(name: str, help_text: str) -> None:
    """A component's command: its options go to :mod:`kvstore.tools.cli.services` as they are."""
    _SERVICES.add(name)

    @_app.command(name=name, context_settings=_PASS, help=help_text, add_help_option=False)
    def _run(ctx: typer.Context) -> None:
        from kvstore.tools.cli.services import run

        code = run(name, ctx.args)
        if code:
            raise typer.Exit(code)


_service("master", "Run a master shard (see --help).")
_service("node", "Run a store node (see --help).")
_service("prefill", "Run a prefill engine (see --help).")
_service("decode", "Run a decode engine (see --help).")
_service("conductor", "Run the conductor (see --help).")
_service("http", "Run the OpenAI-style HTTP front alone, before a conductor (see --help).")
_service("resp", "Run the Redis protocol front (RESP2/RESP3) over a master (see --help).")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    """Console-script entry point (``kvstore``). SIGTERM is handled as Ctrl-C, so a
    command that started processes (up, demo, hosts, bench, ...) stops them first."""
    import signal
    import sys

    from kvstore.errors import KVStoreError

    signal.signal(signal.SIGTERM, _interrupt)
    if len(sys.argv) < 2 or sys.argv[1] not in _SERVICES:
        _register_tools()          # a service runs without them (see _register_tools)
    try:
        _app()                     # exits with the command's status, or click's for bad usage
    except (OSError, ValueError, KVStoreError) as exc:
        # Bad input a command did not check itself (a folder that does not exist,
        # a value out of range): one line, not a traceback.
        name = sys.argv[1] if len(sys.argv) > 1 else ""
        message = exc.message if isinstance(exc, KVStoreError) else exc
        print(f"kvstore {name}: error: {message}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
