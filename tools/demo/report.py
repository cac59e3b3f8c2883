"""Trace replay results: per-request records, the run summary, and its tables.

A replay produces one ``RequestResult`` per trace request. ``summarize`` folds
them into a plain, JSON-ready dict (the form ``bench`` and the README use), and
``render_summary`` / ``render_comparison`` lay one or two summaries out as
``rich`` tables, e.g. a cached run beside a no-cache run.

Outcomes are exclusive: a request is *rejected* (the conductor refused it,
HTTP 429), else *errored* (``error`` is set), else *completed*. Latency
percentiles and throughput count completed requests only.

``save_summary`` folds the prefill engines' save totals (how much of the
time spent putting new KV blocks into the store was hidden behind compute,
see :mod:`kvstore.engines.kv_saver`) into the ``kv_save`` entry a live run adds.

``output_digest`` fingerprints the generated tokens so that two runs (with and
without the cache) can be checked for equal greedy outputs without storing them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import xxhash
from rich.table import Table

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 99)
"""Latency percentiles reported beside the mean."""


@dataclass(slots=True)
class RequestResult:
    """What happened to one replayed request."""

    index: int  # the trace record's index
    prompt_tokens: int  # prompt length in tokens
    cached_tokens: int = 0  # prompt tokens loaded from the store instead of computed
    output_tokens: int = 0  # tokens generated
    ttft_ms: float | None = None  # time to first token; None unless completed
    tbt_ms: float | None = None  # mean time between later tokens; None with < 2 outputs
    output_digest: str = ""  # output_digest() of the generated token ids
    rejected: bool = False  # refused by the conductor (SLO could not be met)
    error: str | None = None  # failure message; None on success
    prefill_instance: str | None = None  # prefill engine that served it
    decode_instance: str | None = None  # decode engine that served it
    prefill_ms: float | None = None  # the prefill engine's time on it (load, compute, save)
    prefill_queue_ms: float | None = None  # its wait in the prefill engine's queue

    @property
    def completed(self) -> bool:
        """True when the request was neither rejected nor failed."""
        return not self.rejected and self.error is None


def output_digest(tokens: Iterable[int] | np.ndarray) -> str:
    """Fingerprints generated token ids.

    Args:
        tokens: token ids, each in ``[0, 2**32)``.

    Returns:
        The xxh64 hex digest of the ids encoded as little-endian uint32.
    """
    if not isinstance(tokens, np.ndarray):
        tokens = np.fromiter(tokens, dtype=np.int64)
    if tokens.size and (tokens.min() < 0 or tokens.max() > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    return xxhash.xxh64_hexdigest(np.ascontiguousarray(tokens, dtype="<u4").tobytes())


def latency_stats(values_ms: Sequence[float]) -> dict[str, float | None]:
    """Mean and PERCENTILES (linear interpolation) of latencies in ms; all None when
    empty (no request is not a latency of 0). The one percentile helper of the
    tools: live replays and the simulator report the same way."""
    keys = ["mean"] + [f"p{p}" for p in PERCENTILES]
    if not values_ms:
        return dict.fromkeys(keys, None)
    arr = np.asarray(values_ms, dtype=np.float64)
    stats: dict[str, float | None] = {"mean": float(arr.mean())}
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES, method="linear")):
        stats[f"p{p}"] = float(v)
    return stats


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    *,
    block_hit_rate: float,
    total_blocks: int,
    hit_blocks: int,
    mode: str,
) -> dict[str, Any]:
    """Folds per-request results into one run summary.

    Args:
        results: one result per replayed request.
        duration_s: wall time of the replay.
        block_hit_rate: fraction of looked-up prefix blocks found in the store.
        total_blocks: prefix blocks looked up.
        hit_blocks: prefix blocks found.
        mode: a label for the run (e.g. "cached", "no-cache", "simulated").

    Returns:
        A JSON-ready dict: ``mode``, ``requests``, ``completed``, ``rejected``,
        ``errors``, ``block_hit_rate``, ``hit_blocks``, ``total_blocks``,
        ``prefill_tokens_saved``, ``prompt_tokens``, ``output_tokens``,
        ``ttft_ms`` and ``tbt_ms`` (each ``{"mean", "p50", "p90", "p99"}``,
        None when nothing completed), ``throughput_tokens_per_s`` (None when
        ``duration_s`` is not positive), ``duration_s`` and ``per_request``
        (in input order).
    """
    completed = [r for r in results if r.completed]
    num_rejected = sum(1 for r in results if r.rejected)
    num_errors = sum(1 for r in results if not r.rejected and r.error is not None)
    prompt_tokens = sum(r.prompt_tokens for r in completed)
    output_tokens = sum(r.output_tokens for r in completed)
    throughput = (prompt_tokens + output_tokens) / duration_s if duration_s > 0 else None
    summary: dict[str, Any] = {
        "mode": mode,
        "requests": len(results),
        "completed": len(completed),
        "rejected": num_rejected,
        "errors": num_errors,
        "block_hit_rate": float(block_hit_rate),
        "hit_blocks": int(hit_blocks),
        "total_blocks": int(total_blocks),
        "prefill_tokens_saved": sum(r.cached_tokens for r in completed),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "ttft_ms": latency_stats([r.ttft_ms for r in completed if r.ttft_ms is not None]),
        "tbt_ms": latency_stats([r.tbt_ms for r in completed if r.tbt_ms is not None]),
        "throughput_tokens_per_s": throughput,
        "duration_s": float(duration_s),
        "per_request": [
            {
                "index": r.index,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "prefill_ms": r.prefill_ms,
                "prefill_queue_ms": r.prefill_queue_ms,
                "output_digest": r.output_digest,
                "ttft_ms": r.ttft_ms,
                "tbt_ms": r.tbt_ms,
                "output_tokens": r.output_tokens,
                "error": r.error,
                "rejected": r.rejected,
            }
            for r in results
        ],
    }
    logger.debug(
        "summary %s: %d/%d completed, hit rate %.3f, %.1f s",
        mode,
        len(completed),
        len(results),
        block_hit_rate,
        duration_s,
    )
    return summary


def save_summary(engines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Folds the prefill engines' KV save totals into one ``kv_save`` entry.

    Args:
        engines: per prefill engine, ``{"mode", "requests", "compute_ms",
            "save_ms", "hidden_ms"}`` (totals over its requests, milliseconds).

    Returns:
        ``{"mode", "requests", "prefill_ms_total", "save_ms_total",
        "hidden_ms_total", "exposed_ms_total", "hidden_fraction"}``:
        ``mode`` is the engines' save mode ("mixed" when they differ),
        ``exposed`` = save time on the requests' critical path,
        ``hidden_fraction`` = hidden / save (None when nothing was saved).
    """
    modes = sorted({e["mode"] for e in engines})
    save = sum(e["save_ms"] for e in engines)
    hidden = sum(e["hidden_ms"] for e in engines)
    return {
        "mode": modes[0] if len(modes) == 1 else ("mixed" if modes else None),
        "requests": sum(e["requests"] for e in engines),
        "prefill_ms_total": sum(e["compute_ms"] for e in engines),
        "save_ms_total": save,
        "hidden_ms_total": hidden,
        "exposed_ms_total": max(save - hidden, 0.0),
        "hidden_fraction": hidden / save if save > 0 else None,
    }


def mismatched_outputs(a: dict[str, Any], b: dict[str, Any]) -> list[int]:
    """Indices of requests completed in both summaries whose output digests differ.

    With greedy decoding a cached run must match a no-cache run exactly, so a
    non-empty answer is a correctness bug.
    """

    def completed_digests(summary: dict[str, Any]) -> dict[int, str]:
        return {
            r["index"]: r["output_digest"]
            for r in summary["per_request"]
            if not r["rejected"] and r["error"] is None
        }

    da, db = completed_digests(a), completed_digests(b)
    return sorted(i for i in da.keys() & db.keys() if da[i] != db[i])


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _int(v: int | None) -> str:
    return "-" if v is None else f"{v:,}"


def _rows() -> list[tuple[str, Any, Any]]:
    """(label, getter, formatter) rows shared by both tables."""
    rows: list[tuple[str, Any, Any]] = [
        ("requests", lambda s: s["requests"], _int),
        ("completed", lambda s: s["completed"], _int),
        ("rejected", lambda s: s["rejected"], _int),
        ("errors", lambda s: s["errors"], _int),
        ("block hit rate", lambda s: s["block_hit_rate"], lambda v: f"{100 * v:.1f}%"),
        ("hit / total blocks", lambda s: (s["hit_blocks"], s["total_blocks"]), lambda v: f"{v[0]:,} / {v[1]:,}"),
        ("prefill tokens saved", lambda s: s["prefill_tokens_saved"], _int),
    ]
    for metric in ("ttft_ms", "tbt_ms"):
        name = metric.split("_")[0].upper()
        for stat in ("mean", *(f"p{p}" for p in PERCENTILES)):
            rows.append((f"{name} {stat} (ms)", lambda s, m=metric, k=stat: s[m][k], _ms))
    rows += [
        (
            "throughput (tokens/s)",
            lambda s: s["throughput_tokens_per_s"],
            lambda v: "-" if v is None else f"{v:,.1f}",
        ),
        ("duration (s)", lambda s: s["duration_s"], lambda v: f"{v:.2f}"),
    ]
    # Live runs only (``kv_save``, see save_summary); "-" elsewhere.
    rows += [
        ("KV save mode", lambda s: _save(s, "mode"), lambda v: v or "-"),
        ("prefill total (ms)", lambda s: _save(s, "prefill_ms_total"), _ms),
        ("KV save total (ms)", lambda s: _save(s, "save_ms_total"), _ms),
        ("  hidden behind compute (ms)", lambda s: _save(s, "hidden_ms_total"), _ms),
        ("  exposed (ms)", lambda s: _save(s, "exposed_ms_total"), _ms),
    ]
    return rows


def _save(summary: dict[str, Any], field: str) -> Any:
    return (summary.get("kv_save") or {}).get(field)


def render_summary(summary: dict[str, Any]) -> Table:
    """Lays one summary out as a two-column (metric, value) table."""
    table = Table(title=f"replay: {summary['mode']}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, get, fmt in _rows():
        table.add_row(label, fmt(get(summary)))
    return table


def render_comparison(
    a: dict[str, Any], b: dict[str, Any], labels: tuple[str, str] | None = None
) -> Table:
    """Lays two summaries side by side, with the ratio ``a / b`` per numeric row.

    Args:
        a: the first summary (e.g. the cached run).
        b: the second summary (e.g. the no-cache run).
        labels: column titles; defaults to the summaries' modes.

    Returns:
        A table with columns metric, a, b, a/b.
    """
    label_a, label_b = labels if labels is not None else (a["mode"], b["mode"])
    table = Table(title=f"replay: {label_a} vs {label_b}")
    table.add_column("metric")
    table.add_column(label_a, justify="right")
    table.add_column(label_b, justify="right")
    table.add_column(f"{label_a} / {label_b}", justify="right")
    for label, get, fmt in _rows():
        va, vb = get(a), get(b)
        ratio = "-"
        if isinstance(va, (int, float)) and isinstance(vb, (int, float)) and vb:
            ratio = f"{va / vb:.2f}x"
        table.add_row(label, fmt(va), fmt(vb), ratio)
    mismatched = mismatched_outputs(a, b)
    table.caption = "outputs identical" if not mismatched else f"{len(mismatched)} outputs differ"
    return table


__all__ = [
    "PERCENTILES",
    "RequestResult",
    "mismatched_outputs",
    "output_digest",
    "render_comparison",
    "render_summary",
    "save_summary",
    "summarize",
]
