"""kvstore.tools.cli.top: rates and quantiles from two fixed scrapes, the summary of two
samples, and the scraper against a real metrics port (token, TLS)."""

from __future__ import annotations

import math

import pytest
from rich.console import Console
from rich.table import Table

from kvstore.auth import TokenFile
from kvstore.health import Health
from kvstore.metrics import MetricsServer, ProcessMetrics
from kvstore.tls import TlsFiles
from kvstore.tools.cli import top
from kvstore.types import NodeAddress, NodeStatus, ShardStatus, TierKind, TierStats

BEFORE = """\
# TYPE kvstore_requests_total counter
kvstore_requests_total{code="OK",op="Get"} 100
kvstore_requests_total{code="NOT_FOUND",op="Get"} 0
kvstore_requests_total{code="OK",op="Put"} 50
# TYPE kvstore_request_duration_seconds histogram
kvstore_request_duration_seconds_bucket{le="0.001",op="Get"} 10
kvstore_request_duration_seconds_bucket{le="0.01",op="Get"} 50
kvstore_request_duration_seconds_bucket{le="0.1",op="Get"} 100
kvstore_request_duration_seconds_bucket{le="+Inf",op="Get"} 100
kvstore_request_duration_seconds_count{op="Get"} 100
kvstore_request_duration_seconds_sum{op="Get"} 1.5
kvstore_request_duration_seconds_bucket{le="0.001",op="Put"} 0
kvstore_request_duration_seconds_bucket{le="0.01",op="Put"} 0
kvstore_request_duration_seconds_bucket{le="0.1",op="Put"} 40
kvstore_request_duration_seconds_bucket{le="+Inf",op="Put"} 50
kvstore_request_duration_seconds_count{op="Put"} 50
kvstore_request_duration_seconds_sum{op="Put"} 9.0
# TYPE kvstore_evicted_objects_total counter
kvstore_evicted_objects_total{tier="DRAM"} 7
kvstore_evicted_objects_total{tier="SSD"} 5
"""

# 2 s later: Get +80 requests (20 of them NOT_FOUND), Put none, a first Stat;
# the SSD eviction counter went down (the process restarted).
AFTER = """\
# TYPE kvstore_requests_total counter
kvstore_requests_total{code="OK",op="Get"} 160
kvstore_requests_total{code="NOT_FOUND",op="Get"} 20
kvstore_requests_total{code="OK",op="Put"} 50
kvstore_requests_total{code="OK",op="Stat"} 4
# TYPE kvstore_request_duration_seconds histogram
kvstore_request_duration_seconds_bucket{le="0.001",op="Get"} 30
kvstore_request_duration_seconds_bucket{le="0.01",op="Get"} 130
kvstore_request_duration_seconds_bucket{le="0.1",op="Get"} 180
kvstore_request_duration_seconds_bucket{le="+Inf",op="Get"} 180
kvstore_request_duration_seconds_count{op="Get"} 180
kvstore_request_duration_seconds_sum{op="Get"} 2.5
kvstore_request_duration_seconds_bucket{le="0.001",op="Put"} 0
kvstore_request_duration_seconds_bucket{le="0.01",op="Put"} 0
kvstore_request_duration_seconds_bucket{le="0.1",op="Put"} 40
kvstore_request_duration_seconds_bucket{le="+Inf",op="Put"} 50
kvstore_request_duration_seconds_count{op="Put"} 50
kvstore_request_duration_seconds_sum{op="Put"} 9.0
kvstore_request_duration_seconds_bucket{le="0.001",op="Stat"} 0
kvstore_request_duration_seconds_bucket{le="0.01",op="Stat"} 0
kvstore_request_duration_seconds_bucket{le="0.1",op="Stat"} 1
kvstore_request_duration_seconds_bucket{le="+Inf",op="Stat"} 4
kvstore_request_duration_seconds_count{op="Stat"} 4
kvstore_request_duration_seconds_sum{op="Stat"} 3.0
# TYPE kvstore_evicted_objects_total counter
kvstore_evicted_objects_total{tier="DRAM"} 13
kvstore_evicted_objects_total{tier="SSD"} 3
"""

CONDUCTOR_BEFORE = """\
# TYPE kvstore_ttft_seconds histogram
kvstore_ttft_seconds_bucket{le="0.1"} 5
kvstore_ttft_seconds_bucket{le="0.5"} 5
kvstore_ttft_seconds_bucket{le="1.0"} 5
kvstore_ttft_seconds_bucket{le="+Inf"} 5
kvstore_ttft_seconds_count 5
kvstore_ttft_seconds_sum 0.2
# TYPE kvstore_requests_rejected_total counter
kvstore_requests_rejected_total{reason="no_instance"} 1
kvstore_requests_rejected_total{reason="invalid"} 0
# TYPE kvstore_generations_total counter
kvstore_generations_total{outcome="completed"} 5
kvstore_generations_total{outcome="rejected"} 1
"""

# 4 s later: 10 more first tokens (2 under 100 ms, 6 up to 500 ms, 2 up to 1 s),
# 4 invalid requests refused.
CONDUCTOR_AFTER = """\
# TYPE kvstore_ttft_seconds histogram
kvstore_ttft_seconds_bucket{le="0.1"} 7
kvstore_ttft_seconds_bucket{le="0.5"} 13
kvstore_ttft_seconds_bucket{le="1.0"} 15
kvstore_ttft_seconds_bucket{le="+Inf"} 15
kvstore_ttft_seconds_count 15
kvstore_ttft_seconds_sum 3.0
# TYPE kvstore_requests_rejected_total counter
kvstore_requests_rejected_total{reason="no_instance"} 1
kvstore_requests_rejected_total{reason="invalid"} 4
# TYPE kvstore_generations_total counter
kvstore_generations_total{outcome="completed"} 15
kvstore_generations_total{outcome="rejected"} 5
"""


@pytest.fixture
def scrapes():
    return top.parse_scrape(BEFORE), top.parse_scrape(AFTER)


def test_parse_scrape_keys_samples_by_name_and_sorted_labels():
    s = top.parse_scrape(BEFORE)
    assert s[("kvstore_requests_total", (("code", "OK"), ("op", "Get")))] == 100.0
    assert s[("kvstore_request_duration_seconds_bucket", (("le", "+Inf"), ("op", "Put")))] == 50
    with pytest.raises(ValueError):
        top.parse_scrape("not { prometheus")


def test_increase_counts_a_reset_or_a_new_series_from_zero():
    assert top.increase(10, 25) == 15
    assert top.increase(10, 4) == 4          # went down: restarted, counted from zero
    assert top.increase(None, 6) == 6


def test_rates_by_label_with_resets_and_new_series(scrapes):
    before, after = scrapes
    assert top.rates(before, after, top.REQUESTS, 2.0, by="op") == {
        "Get": 40.0, "Put": 0.0, "Stat": 2.0}
    errors = top.rates(before, after, top.REQUESTS, 2.0, by="op",
                       where=lambda lab: lab["code"] != "OK")
    assert errors == {"Get": 10.0}
    # DRAM +6; SSD went from 5 down to 3 by a restart: 3 since, as rate() counts it.
    assert top.rates(before, after, top.EVICTED, 2.0, by="tier") == {"DRAM": 3.0, "SSD": 1.5}
    assert top.rates(before, after, top.EVICTED, 2.0) == {"": 4.5}
    with pytest.raises(ValueError):
        top.rates(before, after, top.REQUESTS, 0.0)


def test_bucket_increases_are_per_op_and_sorted(scrapes):
    before, after = scrapes
    got = top.bucket_increases(before, after, top.REQUEST_SECONDS, by="op")
    assert got["Get"] == [(0.001, 20.0), (0.01, 80.0), (0.1, 80.0), (math.inf, 80.0)]
    assert got["Put"] == [(0.001, 0.0), (0.01, 0.0), (0.1, 0.0), (math.inf, 0.0)]


def test_histogram_quantile_interpolates_inside_the_bucket(scrapes):
    before, after = scrapes
    get = top.bucket_increases(before, after, top.REQUEST_SECONDS, by="op")["Get"]
    # 80 requests: 20 under 1 ms, 60 between 1 and 10 ms. The median's rank 40
    # is the 20th of the 60: 1 ms + 9 ms * 20/60; p99's rank 79.2: 1 + 9 * 59.2/60.
    assert top.histogram_quantile(0.5, get) == pytest.approx(0.004)
    assert top.histogram_quantile(0.99, get) == pytest.approx(0.00988)
    # In the first bucket the lower bound is 0: rank 8 of its 20 -> 0.4 ms.
    assert top.histogram_quantile(0.1, get) == pytest.approx(0.0004)
    assert top.histogram_quantile(0.0, get) == 0.0
    assert top.histogram_quantile(1.0, get) == pytest.approx(0.01)


def test_histogram_quantile_edges(scrapes):
    before, after = scrapes
    # Stat: 3 of 4 above the largest finite bound: p99 is that bound (0.1 s).
    stat = top.bucket_increases(before, after, top.REQUEST_SECONDS, by="op")["Stat"]
    assert top.histogram_quantile(0.99, stat) == 0.1
    # Nothing observed in the window, or no +Inf bucket: no estimate.
    assert top.histogram_quantile(0.99, [(0.1, 0.0), (math.inf, 0.0)]) is None
    assert top.histogram_quantile(0.99, [(0.1, 3.0), (1.0, 5.0)]) is None
    assert top.histogram_quantile(0.5, []) is None
    # Buckets scraped mid-update (a lower count above a higher one) are made monotonic.
    assert top.histogram_quantile(0.5, [(1.0, 4.0), (2.0, 3.0), (math.inf, 4.0)]) == 0.5
    with pytest.raises(ValueError):
        top.histogram_quantile(1.5, stat)


def test_request_figures(scrapes):
    before, after = scrapes
    got = top.request_figures(before, after, 2.0)
    assert got["Get"] == {"requests_total": 180, "requests_per_s": 40.0, "errors_per_s": 10.0,
                          "p50_ms": 4.0, "p99_ms": 9.88}
    assert got["Put"] == {"requests_total": 50, "requests_per_s": 0.0, "errors_per_s": 0.0,
                          "p50_ms": None, "p99_ms": None}
    assert got["Stat"]["requests_total"] == 4 and got["Stat"]["p99_ms"] == 100.0


def test_conductor_figures():
    before, after = top.parse_scrape(CONDUCTOR_BEFORE), top.parse_scrape(CONDUCTOR_AFTER)
    got = top.conductor_figures(before, after, 4.0)
    # 10 first tokens: median rank 5 is the 3rd of 6 in 100-500 ms: 100 + 400 * 3/6;
    # p99 rank 9.9 is 1.9 of 2 in 0.5-1 s: 500 + 500 * 1.9/2.
    assert got["ttft_p50_ms"] == pytest.approx(300.0)
    assert got["ttft_p99_ms"] == pytest.approx(975.0)
    assert got["generations_per_s"] == {"completed": 2.5, "rejected": 1.0}
    assert got["generations_total"] == {"completed": 15, "rejected": 5}
    assert got["rejections_per_s"] == {"invalid": 1.0, "no_instance": 0.0}
    assert got["rejections_total"] == {"invalid": 4, "no_instance": 1}


# ---- summaries of two samples ----

def _node(node_id: str, metrics: str = "", used: int = 100, evictions: int = 0,
          heartbeat_ms: int = 1, alive: bool = True) -> NodeStatus:
    tiers = (TierStats(TierKind.DRAM, 1000, used, 1000 - used, num_objects=2),
             TierStats(TierKind.SSD, 5000, 0, 5000))
    return NodeStatus(NodeAddress(node_id, "127.0.0.1", 7000, metrics_address=metrics), alive,
                      1000, used, 2, heartbeat_ms, tiers, {"evictions": evictions})


def _shard(hits: int, misses: int, nodes: tuple[NodeStatus, ...], puts: int = 0) -> ShardStatus:
    return ShardStatus(0, 1, nodes, num_objects=4, total_bytes=400,
                       counters={"lookup_hits": hits, "lookup_misses": misses, "puts": puts},
                       metrics_address="127.0.0.1:9100")


def _samples(node_error: str = ""):
    m_before, m_after = top.parse_scrape(BEFORE), top.parse_scrape(AFTER)
    before = top.Sample(10.0, (_shard(10, 10, (_node("n0", "127.0.0.1:9200", evictions=1),
                                               _node("n1", evictions=5))),),
                        {0: "127.0.0.1:5000"},
                        {"127.0.0.1:9100": top.Scraped(10.0, m_before),
                         "127.0.0.1:9200": top.Scraped(10.1, m_before)})
    after_node = (top.Scraped(12.1, None, node_error) if node_error
                  else top.Scraped(12.1, m_after))
    after = top.Sample(12.0, (_shard(40, 20, (_node("n0", "127.0.0.1:9200", evictions=9),
                                              _node("n1", evictions=11, heartbeat_ms=2)),
                                     puts=8),),
                       {0: "127.0.0.1:5000"},
                       {"127.0.0.1:9100": top.Scraped(12.0, m_after),
                        "127.0.0.1:9200": after_node})
    return before, after


def test_summarize_shards_nodes_and_processes():
    summary = top.summarize(*_samples())
    assert summary["interval_s"] == 2.0
    (shard,) = summary["shards"]
    # 30 hits and 10 misses in 2 s.
    assert shard == {"shard_id": 0, "leader": "127.0.0.1:5000",
                     "metrics_address": "127.0.0.1:9100", "num_objects": 4, "total_bytes": 400,
                     "nodes": 2, "nodes_alive": 2, "puts_per_s": 4.0,
                     "lookups_per_s": 20.0, "hit_rate": 0.75}
    n0, n1 = summary["nodes"]
    assert n0["tiers"] == {"DRAM": {"used_bytes": 100, "capacity_bytes": 1000, "num_objects": 2},
                           "SSD": {"used_bytes": 0, "capacity_bytes": 5000, "num_objects": 0}}
    # n0 scraped: its eviction counter (DRAM +6, SSD 3 since its reset) over 2.0 s.
    assert n0["evictions_total"] == 16 and n0["evictions_per_s"] == 4.5
    # n1 has no metrics port: its counters in Stat, 11 - 5 over 2 s.
    assert n1["evictions_total"] == 11 and n1["evictions_per_s"] == 3.0
    master, node0, node1 = summary["processes"]
    assert (master["role"], master["name"]) == ("master", "shard 0")
    assert master["requests"]["Get"]["requests_per_s"] == 40.0
    assert node0["requests"]["Get"]["p99_ms"] == 9.88 and node0["scrape_error"] is None
    assert node1 == {"role": "node", "name": "n1", "metrics_address": "", "scrape_error": None,
                     "requests": None}


def test_summarize_keeps_a_failed_scrape_apart():
    summary = top.summarize(*_samples(node_error="HTTP 401 Unauthorized"))
    node0 = summary["processes"][1]
    assert node0["requests"] is None and node0["scrape_error"] == "HTTP 401 Unauthorized"
    # Evictions fall back to the node's counters in Stat: 9 - 1 over 2 s.
    assert summary["nodes"][0]["evictions_per_s"] == 4.0


def test_hit_rate_is_none_without_lookups():
    before, after = _samples()
    quiet = top.Sample(14.0, (_shard(40, 20, after.shards[0].nodes),), after.leaders)
    assert top.summarize(after, quiet)["shards"][0]["hit_rate"] is None


def test_latest_nodes_takes_the_freshest_heartbeat():
    old, new = _node("n0", used=1), _node("n0", used=2, heartbeat_ms=5)
    shards = [_shard(0, 0, (old, _node("n1"))), _shard(0, 0, (new,))]
    assert [(n.address.node_id, n.used_bytes) for n in top.latest_nodes(shards)] == [
        ("n0", 2), ("n1", 100)]


def test_metrics_addresses_skip_empty_dead_and_repeated():
    nodes = (_node("n0", "h:1"), _node("n1"), _node("n2", "h:2", alive=False))
    shards = [_shard(0, 0, nodes), _shard(0, 0, nodes)]
    assert top.metrics_addresses(shards, ["h:9"]) == ["127.0.0.1:9100", "h:1", "h:9"]


def test_render_shows_every_table_and_the_processes_without_metrics():
    before, after = _samples()
    conductor = top.parse_scrape(CONDUCTOR_BEFORE), top.parse_scrape(CONDUCTOR_AFTER)
    before.metrics["c:1"] = top.Scraped(10.0, conductor[0])
    after.metrics["c:1"] = top.Scraped(14.0, conductor[1])
    after = top.Sample(after.at_s, after.shards, after.leaders, after.metrics, ("c:1",))
    console = Console(width=120, record=True, color_system=None)
    console.print(top.render(top.summarize(before, after),
                             lambda **kw: Table(box=None, **kw), title="kvctl top"))
    text = console.export_text()
    for part in ("shards", "nodes", "requests", "conductors", "no metrics port: n1",
                 "127.0.0.1:5000", "75.0", "9.88", "300.0", "975.0"):
        assert part in text, part


# ---- the scraper against a real metrics port ----

def _server(tmp_path, tls: TlsFiles | None = None):
    tokens = tmp_path / "tokens"
    tokens.write_text("metrics metrics-0123456789abcdef\nclient client-0123456789abcdef\n")
    metrics = ProcessMetrics("node")
    metrics.observe("get", "OK", 0.002)
    return MetricsServer(metrics, Health(), "127.0.0.1", 0, tokens=TokenFile(str(tokens)),
                         tls=tls).start()


def test_scraper_sends_the_token_and_reports_refusals(tmp_path):
    server = _server(tmp_path)
    address = f"127.0.0.1:{server.port}"
    try:
        got = top.Scraper("metrics-0123456789abcdef", timeout_s=5).scrape(address)
        assert got.error == "" and got.scrape[(top.REQUESTS, (("code", "OK"), ("op", "get")))] == 1
        assert top.Scraper(None, timeout_s=5).scrape(address).error.startswith("HTTP 401")
        assert top.Scraper("client-0123456789abcdef", timeout_s=5).scrape(address).error.startswith("HTTP 403")
    finally:
        server.stop()
    down = top.Scraper("metrics-0123456789abcdef", timeout_s=5).scrape(address)
    assert down.scrape is None and down.error


def test_scraper_speaks_https_with_a_ca(tmp_path):
    certs_mod = pytest.importorskip("kvstore.tools.cluster.certs")
    pytest.importorskip("cryptography")
    certs = certs_mod.make_certs(tmp_path / "certs", ["127.0.0.1"])
    server = _server(tmp_path, TlsFiles(str(certs.server_cert), str(certs.server_key)))
    address = f"127.0.0.1:{server.port}"
    try:
        got = top.Scraper("metrics-0123456789abcdef", TlsFiles(ca=str(certs.ca)), timeout_s=5).scrape(address)
        assert got.error == "" and got.scrape
        assert top.Scraper("metrics-0123456789abcdef", timeout_s=5).scrape(address).error   # plain HTTP: no
    finally:
        server.stop()
