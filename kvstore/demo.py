"""The main job: an embedded local cluster replaying the bundled Mooncake trace."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import tempfile
import threading
from pathlib import Path

from rich.console import Console

from kvstore.local_cluster import ClusterSpec, LocalCluster
from kvstore.process import ChildFailed
from tools.replay import replay
from tools.report import render_summary, summarize
from tools.trace import ScaleConfig, default_trace_path, load_trace, scale_trace

log = logging.getLogger(__name__)


def run_demo(*, requests: int, trace: str | None, use_cache: bool, out: str | None,
             time_scale: float, block_tokens: int, max_output_tokens: int, node_dram: str,
             log_dir: str | None, console: Console) -> dict:
    """Start the cluster, replay ``requests`` trace requests, print and return the summary.

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
    with console.status("starting cluster") as status:
        cluster.start(on_step=lambda name: status.update(f"starting {name}"))
    try:
        watchdog = _Watchdog(cluster)
        outcome = asyncio.run(watchdog.guard(replay(cluster.conductor, reqs)))
    finally:
        with console.status("stopping cluster"):
            cluster.stop()
    summary = summarize(outcome.results, outcome.duration_s, block_hit_rate=outcome.block_hit_rate,
                        total_blocks=outcome.total_blocks, hit_blocks=outcome.hit_blocks, mode=mode)
    summary["trace"] = path.name
    summary["block_tokens"] = block_tokens
    console.print(render_summary(summary))
    if out:
        Path(out).write_text(json.dumps(summary, indent=2))
        console.print(f"summary written to {out}")
    return summary


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
