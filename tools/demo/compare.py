"""The demo's verdict: the cached run beside the no-cache run, and their ratios.

Both runs replay the same window at the same arrival times; the comparison
is ``cache / no_cache`` per metric (below 1 is better for latencies and
computed tokens)::

    comparison = {"basis": "cache / no_cache",
                  "metrics": {name: {"cache": a, "no_cache": b, "ratio": a / b | None}},
                  "outputs_identical": bool, "mismatched_outputs": [request index, ...]}

Greedy decoding makes every request's output independent of where its KV
came from, so ``outputs_identical`` must hold; a mismatch is a bug.

``write_ttft_plot`` draws the two TTFT distributions (empirical CDFs) when
matplotlib (the ``plot`` extra) is installed.

Thread safety: pure functions.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from rich.table import Table

from kvstore.tools.demo.report import mismatched_outputs

logger = logging.getLogger(__name__)


def _computed(s: dict[str, Any]) -> int:
    return s["prompt_tokens"] - s["prefill_tokens_saved"]


#: (name, label, getter, format) of each compared metric, in table order.
METRICS: list[tuple[str, str, Callable[[dict], Any], Callable[[Any], str]]] = [
    ("completed", "completed", lambda s: s["completed"], lambda v: f"{v:,}"),
    ("rejected", "rejected", lambda s: s["rejected"], lambda v: f"{v:,}"),
    ("errors", "errors", lambda s: s["errors"], lambda v: f"{v:,}"),
    *[(f"ttft_{k}_ms", f"TTFT {k} (ms)", (lambda s, k=k: s["ttft_ms"][k]), lambda v: f"{v:,.0f}")
      for k in ("mean", "p50", "p90", "p99")],
    *[(f"tbt_{k}_ms", f"TBT {k} (ms)", (lambda s, k=k: s["tbt_ms"][k]), lambda v: f"{v:.1f}")
      for k in ("p50", "p99")],
    ("prefill_tokens_computed", "prefill tokens computed", _computed, lambda v: f"{v:,}"),
    ("prefill_tokens_loaded", "prefill tokens loaded", lambda s: s["prefill_tokens_saved"],
     lambda v: f"{v:,}"),
    ("block_hit_rate", "block hit rate", lambda s: s["block_hit_rate"], lambda v: f"{100 * v:.1f} %"),
    ("throughput_tokens_per_s", "throughput (tokens/s)", lambda s: s["throughput_tokens_per_s"],
     lambda v: f"{v:,.0f}"),
    ("duration_s", "replay (s)", lambda s: s["duration_s"], lambda v: f"{v:.1f}"),
    ("kv_save_ms", "KV save (ms)", lambda s: _save(s, "save_ms_total"), lambda v: f"{v:,.0f}"),
    ("kv_save_exposed_ms", "  on the critical path (ms)", lambda s: _save(s, "exposed_ms_total"),
     lambda v: f"{v:,.0f}"),
]


def _save(s: dict[str, Any], field: str) -> Any:
    """A ``kv_save`` total of the window (live runs only; None elsewhere)."""
    return (s.get("kv_save") or {}).get(field)


def compare(cache: dict[str, Any], no_cache: dict[str, Any]) -> dict[str, Any]:
    """The comparison of two run summaries (:func:`kvstore.tools.demo.report.summarize`).

    Returns:
        The ``comparison`` entry (see the module); a ratio is None when the
        no-cache value is 0 or either value is missing.
    """
    metrics = {}
    for name, _label, get, _fmt in METRICS:
        a, b = get(cache), get(no_cache)
        ratio = a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None
        metrics[name] = {"cache": a, "no_cache": b, "ratio": ratio}
    bad = mismatched_outputs(cache, no_cache)
    return {"basis": "cache / no_cache", "metrics": metrics, "outputs_identical": not bad,
            "mismatched_outputs": bad}


def render_comparison_table(comparison: dict[str, Any], title: str) -> Table:
    """The side-by-side table: metric, cache, no cache, cache / no cache."""
    table = Table(title=title)
    for name, justify in (("metric", "left"), ("cache", "right"), ("no cache", "right"),
                          ("cache / no cache", "right")):
        table.add_column(name, justify=justify)
    for name, label, _get, fmt in METRICS:
        m = comparison["metrics"][name]
        cells = ["-" if m[k] is None else fmt(m[k]) for k in ("cache", "no_cache")]
        ratio = "-" if m["ratio"] is None else f"{m['ratio']:.2f}x"
        table.add_row(label, *cells, ratio)
    bad = comparison["mismatched_outputs"]
    table.caption = ("every output identical between the modes" if not bad
                     else f"[red]{len(bad)} outputs differ between the modes[/]")
    return table


def write_ttft_plot(cache: dict[str, Any], no_cache: dict[str, Any], path: Path,
                    title: str) -> str | None:
    """Draws both runs' TTFT distributions (empirical CDFs) into the PNG ``path``.

    Returns:
        None when written; otherwise why not (matplotlib is missing).
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'kvstore[plot]')"
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for summary, label in ((cache, "cache"), (no_cache, "no cache")):
        ttft = sorted(r["ttft_ms"] / 1000 for r in summary["per_request"]
                      if r["ttft_ms"] is not None)
        if ttft:
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post",
                    label=f"{label} (mean {sum(ttft) / len(ttft):.2f} s)")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("TTFT plot written to %s", path)
    return None


__all__ = ["METRICS", "compare", "render_comparison_table", "write_ttft_plot"]
