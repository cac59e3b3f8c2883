"""The main job: an embedded local cluster replaying the bundled Mooncake trace."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path

import grpc
from rich.console import Console

from kvstore.engines.kv_saver import SAVE_MODE_ENV
from kvstore import rpc
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.tools.launcher import ClusterSpec, LocalCluster
from kvstore.tools.processes import ChildFailed
from kvstore.tools.replay import replay
from kvstore.tools.report import render_summary, save_summary, summarize
from kvstore.tools.trace import ScaleConfig, default_trace_path, load_trace, scale_trace

log = logging.getLogger(__name__)


def run_demo(*, requests: int, trace: str | None, use_cache: bool, out: str | None,
             time_scale: float, block_tokens: int, max_output_tokens: int, node_dram: str,
             log_dir: str | None, console: Console, save_mode: str | None = None) -> dict:
    """Start the cluster, replay ``requests`` trace requests, print and return the summary.

    Args:
        save_mode: the prefill engines' ``--save-mode`` ("sync", "streamed", "layerwise");
            None keeps their default. The summary's ``kv_save`` entry reports
            how much of the save time was hidden behind compute.

    Raises:
        ChildFailed: a component died (everything is stopped first).
    """
    path = Path(trace) if trace else default_trace_path("conversation")
    cfg = ScaleConfig(block_tokens=block_tokens, time_scale=time_scale,
                      max_output_tokens=max_output_tokens)
    reqs = scale_trace(load_trace(path, limit=requests), cfg)
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvstore-demo-")
    spec = ClusterSpec(node_dram=node_dram, block_tokens=block_tokens, use_cache=use_cache,
                       log_dir=log_dir)
    mode = "cache" if use_cache else "no-cache"
    console.print(f"[bold]kvstore demo[/] ({mode}): {len(reqs)} requests of {path.name}, "
                  f"{block_tokens} tokens per block; logs in {log_dir}")
    cluster = LocalCluster(spec)
    with console.status("starting cluster") as status, _env(SAVE_MODE_ENV, save_mode):
        cluster.start(on_step=lambda name: status.update(f"starting {name}"))
    try:
        watchdog = _Watchdog(cluster)
        outcome = asyncio.run(watchdog.guard(replay(cluster.conductor, reqs)))
        save = save_summary(_prefill_save_totals(cluster))
    finally:
        with console.status("stopping cluster"):
            cluster.stop()
    summary = summarize(outcome.results, outcome.duration_s, block_hit_rate=outcome.block_hit_rate,
                        total_blocks=outcome.total_blocks, hit_blocks=outcome.hit_blocks, mode=mode)
    summary["trace"] = path.name
    summary["block_tokens"] = block_tokens
    summary["kv_save"] = save
    console.print(render_summary(summary))
    if out:
        Path(out).write_text(json.dumps(summary, indent=2))
        console.print(f"summary written to {out}")
    return summary


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
        out.append({"mode": st.save_mode, "requests": st.requests_done,
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
