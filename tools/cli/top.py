"""``kvctl top``: the cluster's figures from two samples, and their live view.

A sample (:func:`take_sample`) is every master shard's Stat reply, plus one
scrape of each ``/metrics`` port the cluster advertises (each shard's
answering master, each live node) and of the conductors named on the
command line. :func:`summarize` turns two samples into one JSON-able dict;
:func:`render` draws it with rich.

The math follows PromQL over the window between the two samples:

* a rate is a counter's increase over the seconds between its two readings,
  per series, then summed by a label (``sum by (op) (rate(x[w]))``); a
  counter that went down (its process restarted) counts from zero, as
  ``rate()`` does, and a series missing from the first sample counts from
  zero too (a process's counters start at zero, so its first requests show);
* a quantile is ``histogram_quantile(q, sum by (le, op) (rate(x_bucket[w])))``:
  the bucket increases, the rank ``q * count``, linear interpolation inside the
  bucket it falls in, the largest finite bound when it falls in ``+Inf``, and
  none (JSON null) when nothing was observed in the window.

Units are in the JSON keys: ``_bytes``, ``_per_s`` (per second), ``_ms``
(milliseconds); ``hit_rate`` is a fraction from 0 to 1.
"""

from __future__ import annotations

import http.client
import math
import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.table import Table

from kvstore.sizes import format_size
from kvstore.tls import TlsFiles, client_context
from kvstore.types import NodeStatus, ShardStatus

#: (sample name, its labels sorted) -> value: one scrape of a /metrics page.
Labels = tuple[tuple[str, str], ...]
Scrape = dict[tuple[str, Labels], float]

REQUESTS = "kvstore_requests_total"
REQUEST_SECONDS = "kvstore_request_duration_seconds_bucket"
EVICTED = "kvstore_evicted_objects_total"
TTFT_SECONDS = "kvstore_ttft_seconds_bucket"
REJECTED = "kvstore_requests_rejected_total"
GENERATIONS = "kvstore_generations_total"


# ---- scrape math (pure) ----

def parse_scrape(text: str) -> Scrape:
    """Every sample of a Prometheus text exposition, keyed by name and labels.

    Raises:
        ValueError: the text is not Prometheus' text format.
    """
    out: Scrape = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def increase(before: float | None, after: float) -> float:
    """A counter's increase: ``after - before``, or ``after`` when it is new
    (``before`` None) or went down (a reset)."""
    if before is None or after < before:
        return after
    return after - before


def _grouped(before: Scrape, after: Scrape, name: str, by: str | None,
             where: Callable[[dict[str, str]], bool] = lambda labels: True,
             extra: str | None = None) -> dict:
    """Per-series increases of ``name``, summed by label ``by`` (and ``extra``)."""
    out: dict = {}
    for (sample, labels), value in after.items():
        if sample != name:
            continue
        lab = dict(labels)
        if not where(lab):
            continue
        key = lab.get(by, "") if by else ""
        if extra is not None:
            key = (key, lab.get(extra, ""))
        out[key] = out.get(key, 0.0) + increase(before.get((sample, labels)), value)
    return out


def rates(before: Scrape, after: Scrape, name: str, seconds: float, by: str | None = None,
          where: Callable[[dict[str, str]], bool] = lambda labels: True) -> dict[str, float]:
    """Per second increase of counter ``name`` over ``seconds``, by label ``by``
    ("" as the key without ``by``); only the series whose labels pass ``where``.

    Raises:
        ValueError: ``seconds`` is not positive.
    """
    if seconds <= 0:
        raise ValueError(f"a rate needs a positive window, not {seconds} s")
    return {k: v / seconds for k, v in _grouped(before, after, name, by, where).items()}


def totals(scrape: Scrape, name: str, by: str | None = None) -> dict[str, float]:
    """The current value of ``name`` summed by label ``by`` ("" without ``by``)."""
    out: dict[str, float] = {}
    for (sample, labels), value in scrape.items():
        if sample == name:
            key = dict(labels).get(by, "") if by else ""
            out[key] = out.get(key, 0.0) + value
    return out


def bucket_increases(before: Scrape, after: Scrape, name: str,
                     by: str | None = None) -> dict[str, list[tuple[float, float]]]:
    """A histogram's buckets (``name`` ends in ``_bucket``) over the window:
    per value of label ``by``, (upper bound, cumulative increase) sorted by bound."""
    grouped = _grouped(before, after, name, by, extra="le")
    out: dict[str, list[tuple[float, float]]] = {}
    for (key, le), n in grouped.items():
        out.setdefault(key, []).append((float(le), n))
    return {k: sorted(v) for k, v in out.items()}


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """The ``q``-quantile (0..1) of cumulative ``buckets`` (upper bound, count),
    in the histogram's unit, as PromQL's histogram_quantile estimates it.

    Returns None without a ``+Inf`` bucket or without observations.

    Raises:
        ValueError: ``q`` outside 0..1.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside 0..1")
    ordered = sorted(buckets)
    if len(ordered) < 2 or not math.isinf(ordered[-1][0]):
        return None
    counts, top = [], 0.0
    for _, n in ordered:              # cumulative counts never go down (scrapes race)
        top = max(top, n)
        counts.append(top)
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    b = next((i for i, n in enumerate(counts[:-1]) if n >= rank), len(ordered) - 1)
    if b == len(ordered) - 1:
        return ordered[-2][0]         # in +Inf: the largest finite bound
    upper = ordered[b][0]
    if b == 0 and upper <= 0:
        return upper
    lower = ordered[b - 1][0] if b > 0 else 0.0
    below = counts[b - 1] if b > 0 else 0.0
    inside = counts[b] - below
    return lower + (upper - lower) * (rank - below) / inside


def quantiles(before: Scrape, after: Scrape, name: str, q: float,
              by: str | None = None) -> dict[str, float | None]:
    """:func:`histogram_quantile` of each group of :func:`bucket_increases`."""
    return {k: histogram_quantile(q, b)
            for k, b in bucket_increases(before, after, name, by).items()}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def _per_s(figures: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in sorted(figures.items())}


def request_figures(before: Scrape, after: Scrape, seconds: float) -> dict[str, dict]:
    """Per op: ``requests_total`` (since the process started), ``requests_per_s``,
    ``errors_per_s`` (replies other than OK), ``p50_ms`` and ``p99_ms`` of the
    window (None without requests in it)."""
    per_s = rates(before, after, REQUESTS, seconds, by="op")
    errors = rates(before, after, REQUESTS, seconds, by="op",
                   where=lambda lab: lab.get("code") != "OK")
    p50 = quantiles(before, after, REQUEST_SECONDS, 0.5, by="op")
    p99 = quantiles(before, after, REQUEST_SECONDS, 0.99, by="op")
    count = totals(after, REQUESTS, by="op")
    return {op: {"requests_total": int(count[op]), "requests_per_s": round(per_s.get(op, 0.0), 3),
                 "errors_per_s": round(errors.get(op, 0.0), 3),
                 "p50_ms": _ms(p50.get(op)), "p99_ms": _ms(p99.get(op))}
            for op in sorted(count)}


def conductor_figures(before: Scrape, after: Scrape, seconds: float) -> dict:
    """A conductor's window: TTFT p50 / p99 (ms, None without first tokens in it),
    generations by outcome and rejections by reason, per second and in total."""
    ttft = bucket_increases(before, after, TTFT_SECONDS).get("", [])
    return {
        "ttft_p50_ms": _ms(histogram_quantile(0.5, ttft)),
        "ttft_p99_ms": _ms(histogram_quantile(0.99, ttft)),
        "generations_per_s": _per_s(rates(before, after, GENERATIONS, seconds, by="outcome")),
        "generations_total": {k: int(v) for k, v in sorted(totals(after, GENERATIONS,
                                                                   by="outcome").items())},
        "rejections_per_s": _per_s(rates(before, after, REJECTED, seconds, by="reason")),
        "rejections_total": {k: int(v) for k, v in sorted(totals(after, REJECTED,
                                                                  by="reason").items())},
    }


# ---- samples ----

@dataclass(frozen=True, slots=True)
class Scraped:
    """One scrape of a /metrics port: its samples, or why there are none."""

    at_s: float                  # time.monotonic() when the reply came (s)
    scrape: Scrape | None = None
    error: str = ""


@dataclass(frozen=True, slots=True)
class Sample:
    """What the cluster said at one moment."""

    at_s: float                                  # time.monotonic() when Stat answered (s)
    shards: tuple[ShardStatus, ...]
    leaders: dict[int, str]                      # shard id -> the master that answered
    metrics: dict[str, Scraped] = field(default_factory=dict)   # metrics host:port -> scrape
    conductors: tuple[str, ...] = ()             # the conductors' metrics host:port


def latest_nodes(shards: Iterable[ShardStatus]) -> list[NodeStatus]:
    """Every node any shard knows, once each (the freshest heartbeat), by node id."""
    seen: dict[str, NodeStatus] = {}
    for st in shards:
        for n in st.nodes:
            prev = seen.get(n.address.node_id)
            if prev is None or n.last_heartbeat_ms > prev.last_heartbeat_ms:
                seen[n.address.node_id] = n
    return sorted(seen.values(), key=lambda n: n.address.node_id)


class Scraper:
    """Reads ``/metrics`` pages: over HTTPS when given a CA (a service with
    ``--tls-cert`` serves its metrics port so), with the token as ``Bearer``.

    Args:
        token: sent as ``Authorization: Bearer TOKEN`` (None: none sent).
        tls: the client's TLS files, with the CA (None: plain HTTP).
        timeout_s: each scrape's deadline (s).
    """

    def __init__(self, token: str | None = None, tls: TlsFiles | None = None,
                 timeout_s: float = 5.0):
        self.token = token
        self.timeout_s = timeout_s
        self.context: ssl.SSLContext | None = client_context(tls) if tls is not None else None

    def text(self, address: str) -> str:
        """The /metrics page of ``address`` (host:port).

        Raises:
            OSError: it cannot be read (refused, timed out, an HTTP error status).
        """
        scheme = "https" if self.context is not None else "http"
        req = urllib.request.Request(f"{scheme}://{address}/metrics")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s, context=self.context) as r:
                return r.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as exc:
            raise OSError(f"HTTP {exc.code} {exc.reason}") from None
        except urllib.error.URLError as exc:
            raise OSError(str(exc.reason)) from None
        except http.client.HTTPException as exc:      # not HTTP at all (e.g. TLS expected)
            raise OSError(f"bad reply: {type(exc).__name__}: {exc}") from None

    def scrape(self, address: str) -> Scraped:
        """One :class:`Scraped` of ``address``; never raises."""
        try:
            samples = parse_scrape(self.text(address))
        except (OSError, ValueError) as exc:
            return Scraped(time.monotonic(), None, str(exc) or type(exc).__name__)
        return Scraped(time.monotonic(), samples)


def metrics_addresses(shards: Sequence[ShardStatus], conductors: Sequence[str]) -> list[str]:
    """The /metrics ports to scrape: each shard's answering master, each live
    node, then the conductors; once each, in that order."""
    found = [st.metrics_address for st in shards]
    found += [n.address.metrics_address for n in latest_nodes(shards) if n.alive]
    found += list(conductors)
    return list(dict.fromkeys(a for a in found if a))


def take_sample(kv, scraper: Scraper, conductors: Sequence[str] = ()) -> Sample:
    """Stat every shard through ``kv`` (a KVClient), then scrape every metrics port
    at once (threads).

    Raises:
        KVStoreError: a shard's Stat failed.
    """
    shards = tuple(kv.stat())
    at = time.monotonic()
    leaders = {st.shard_id: kv.answering_master(st.shard_id) for st in shards}
    addresses = metrics_addresses(shards, conductors)
    scraped: dict[str, Scraped] = {}
    if addresses:
        with ThreadPoolExecutor(max_workers=min(16, len(addresses))) as pool:
            scraped = dict(zip(addresses, pool.map(scraper.scrape, addresses)))
    return Sample(at, shards, leaders, scraped, tuple(conductors))


# ---- summary (pure) ----

def _window(before: Sample, after: Sample, address: str):
    """(before, after, seconds) of two good scrapes of ``address``, else None."""
    a, b = before.metrics.get(address), after.metrics.get(address)
    if a is None or b is None or a.scrape is None or b.scrape is None or b.at_s <= a.at_s:
        return None
    return a.scrape, b.scrape, b.at_s - a.at_s


def _process(before: Sample, after: Sample, role: str, name: str, address: str,
             conductor: bool = False) -> dict:
    out = {"role": role, "name": name, "metrics_address": address, "scrape_error": None,
           "requests": None}
    if not address:
        return out
    window = _window(before, after, address)
    if window is None:
        errors = [s.error for s in (after.metrics.get(address), before.metrics.get(address))
                  if s is not None and s.error]
        out["scrape_error"] = errors[0] if errors else "not scraped in both samples"
        return out
    out["requests"] = request_figures(*window)
    if conductor:
        out.update(conductor_figures(*window))
    return out


def _counter_rate(before: Mapping[str, int], after: Mapping[str, int], names: Sequence[str],
                  seconds: float) -> float:
    n = sum(increase(before.get(k), after.get(k, 0)) for k in names if k in after)
    return round(n / seconds, 3) if seconds > 0 else 0.0


def _shard(before: ShardStatus | None, st: ShardStatus, leader: str, seconds: float) -> dict:
    prev = before.counters if before is not None else {}
    hits = increase(prev.get("lookup_hits"), st.counters.get("lookup_hits", 0))
    misses = increase(prev.get("lookup_misses"), st.counters.get("lookup_misses", 0))
    return {
        "shard_id": st.shard_id, "leader": leader, "metrics_address": st.metrics_address,
        "num_objects": st.num_objects, "total_bytes": st.total_bytes,
        "nodes": len(st.nodes), "nodes_alive": sum(1 for n in st.nodes if n.alive),
        "puts_per_s": _counter_rate(prev, st.counters, ("puts",), seconds),
        "lookups_per_s": round((hits + misses) / seconds, 3) if seconds > 0 else 0.0,
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
    }


def _node(before: Sample, after: Sample, n: NodeStatus, prev: NodeStatus | None,
          seconds: float) -> dict:
    a = n.address
    window = _window(before, after, a.metrics_address) if n.alive and a.metrics_address else None
    if window is not None:       # the node's own counter: fresher than its last heartbeat
        old, new, window_s = window
        evictions_total = int(sum(totals(new, EVICTED).values()))
        evictions_per_s = round(sum(rates(old, new, EVICTED, window_s).values()), 3)
    else:
        evictions_total = n.counters.get("evictions", 0)
        evictions_per_s = _counter_rate(prev.counters if prev else {}, n.counters,
                                        ("evictions",), seconds)
    return {
        "node_id": a.node_id, "address": f"{a.host}:{a.data_port}", "alive": n.alive,
        "metrics_address": a.metrics_address, "num_objects": n.num_objects,
        "used_bytes": n.used_bytes, "capacity_bytes": n.capacity_bytes,
        "tiers": {t.kind.name: {"used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
                                "num_objects": t.num_objects} for t in n.tiers},
        "evictions_total": evictions_total, "evictions_per_s": evictions_per_s,
    }


def summarize(before: Sample, after: Sample) -> dict:
    """The figures of the window from ``before`` to ``after`` (see the module doc)."""
    seconds = after.at_s - before.at_s
    old_shards = {st.shard_id: st for st in before.shards}
    old_nodes = {n.address.node_id: n for n in latest_nodes(before.shards)}
    nodes = latest_nodes(after.shards)
    shards = [_shard(old_shards.get(st.shard_id), st, after.leaders.get(st.shard_id, ""),
                     seconds) for st in after.shards]
    processes = [_process(before, after, "master", f"shard {s['shard_id']}",
                          s["metrics_address"]) for s in shards]
    processes += [_process(before, after, "node", n.address.node_id, n.address.metrics_address)
                  for n in nodes if n.alive]
    processes += [_process(before, after, "conductor", c, c, conductor=True)
                  for c in after.conductors]
    return {
        "interval_s": round(seconds, 3),
        "shards": shards,
        "nodes": [_node(before, after, n, old_nodes.get(n.address.node_id), seconds)
                  for n in nodes],
        "processes": processes,
    }


# ---- the view ----

def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(summary: dict, make_table: Callable[..., Table], title: str = "") -> Group:
    """The tables of a :func:`summarize` dict: shards, nodes (a row per tier),
    requests per process and op, conductors. ``make_table(title=..., ...)``
    makes an empty rich Table in kvctl's style."""
    parts: list = [title] if title else []
    shards = make_table(title="shards")
    for col in ("shard", "leader", "objects", "bytes", "puts/s", "lookups/s", "hit %"):
        shards.add_column(col, justify="left" if col in ("shard", "leader") else "right",
                          overflow="fold" if col == "leader" else "ellipsis")
    for s in summary["shards"]:
        hit = None if s["hit_rate"] is None else 100.0 * s["hit_rate"]
        shards.add_row(str(s["shard_id"]), s["leader"], str(s["num_objects"]),
                       format_size(s["total_bytes"]), _num(s["puts_per_s"]),
                       _num(s["lookups_per_s"]), _num(hit))
    parts.append(shards)

    nodes = make_table(title="nodes")
    for col in ("node", "alive", "tier", "used", "capacity", "use %", "objects", "evictions/s"):
        nodes.add_column(col, justify="left" if col in ("node", "alive", "tier") else "right")
    for n in summary["nodes"]:
        first = True
        for tier, t in (n["tiers"] or {"-": {"used_bytes": n["used_bytes"],
                                             "capacity_bytes": n["capacity_bytes"],
                                             "num_objects": n["num_objects"]}}).items():
            pct = 100.0 * t["used_bytes"] / t["capacity_bytes"] if t["capacity_bytes"] else None
            nodes.add_row(n["node_id"] if first else "",
                          ("yes" if n["alive"] else "[red]DEAD[/red]") if first else "", tier,
                          format_size(t["used_bytes"]), format_size(t["capacity_bytes"]),
                          _num(pct), str(t["num_objects"]),
                          _num(n["evictions_per_s"]) if first else "")
            first = False
    parts.append(nodes)

    without = [p["name"] for p in summary["processes"] if not p["metrics_address"]]
    failed = [f"{p['name']} ({p['metrics_address']}): {p['scrape_error']}"
              for p in summary["processes"] if p["metrics_address"] and p["scrape_error"]]
    caption = "\n".join(([f"no metrics port: {', '.join(without)}"] if without else [])
                        + [f"not scraped: {f}" for f in failed])
    reqs = make_table(title="requests (from /metrics)", caption=caption or None,
                      caption_justify="left")
    for col in ("process", "op", "req/s", "errors/s", "p50 ms", "p99 ms", "total"):
        reqs.add_column(col, justify="left" if col in ("process", "op") else "right")
    for p in summary["processes"]:
        ops = sorted((p["requests"] or {}).items(), key=lambda kv: -kv[1]["requests_per_s"])
        for i, (op, r) in enumerate(ops):
            reqs.add_row(f"{p['role']} {p['name']}" if i == 0 else "", op,
                         _num(r["requests_per_s"]), _num(r["errors_per_s"]),
                         _num(r["p50_ms"], 2), _num(r["p99_ms"], 2), str(r["requests_total"]))
    parts.append(reqs)

    conductors = [p for p in summary["processes"] if p["role"] == "conductor" and p["requests"]
                  is not None]
    if conductors:
        table = make_table(title="conductors (TTFT in ms)")
        for col in ("conductor", "TTFT p50", "TTFT p99", "done/s", "rejected/s", "failed/s",
                    "rejected"):
            table.add_column(col, justify="left" if col == "conductor" else "right",
                             overflow="fold" if col == "conductor" else "ellipsis")
        for c in conductors:
            gen = c["generations_per_s"]
            table.add_row(c["name"], _num(c["ttft_p50_ms"]), _num(c["ttft_p99_ms"]),
                          _num(gen.get("completed", 0.0)), _num(gen.get("rejected", 0.0)),
                          _num(gen.get("failed", 0.0)), str(sum(c["rejections_total"].values())))
        parts.append(table)
    return Group(*parts)
