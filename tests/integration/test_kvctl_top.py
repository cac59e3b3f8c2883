"""kvctl top on a real cluster: its figures agree with kvctl stats / nodes.

A master and node n0 serve /metrics (``--metrics-port 0``); node n1 has no
metrics port (shown without request figures, not an error); a conductor runs
with engines that are not there, so the requests it is sent (empty prompts)
are refused without any model: its rejections are exact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from typer.testing import CliRunner

from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.client import KVClient
from kvstore.tools.cli.kvctl import app
from kvstore.tools.cluster.launcher import start_store_cluster
from kvstore.tools.cluster.processes import free_ports, service_args
from kvstore.tools.cli.top import REQUESTS, Scraper, totals
from kvtest import node_args, node_stats, wait_for

METRICS = ("--metrics-port", "0")
SIZES = [1000 * (i + 1) for i in range(12)]       # bytes of the objects put
REFUSED = 2                                       # empty prompts sent to the conductor


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("top"))
    c = start_store_cluster(1, 1, dram="16MiB", master_args=METRICS, node_args=METRICS,
                            log_dir=logs)
    try:
        c.nodes["n1"] = c.procs.start("n1", node_args(c.master, "n1", "16MiB", "none"))
        no_engine = [f"127.0.0.1:{p}" for p in free_ports(2)]
        c.conductor = c.procs.start("conductor", service_args(
            "conductor", "--master", c.master, "--prefill", f"p0={no_engine[0]}",
            "--decode", f"d0={no_engine[1]}", *METRICS))
        yield c
        c.procs.check()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def loaded(cluster):
    """Objects on both nodes, settled in the master's view, and refused generations."""
    keys = [f"top/{i}" for i in range(len(SIZES))]
    with KVClient(cluster.master, prefer_shm=False) as kv:
        assert kv.batch_put(keys, [bytes(n) for n in SIZES]) == [None] * len(keys)
        # Node figures reach the master with heartbeats: wait until both nodes' are in.
        wait_for(lambda: sum(n.num_objects for n in node_stats(kv).values()) == len(keys)
                 and all(n.num_objects for n in node_stats(kv).values()), timeout_s=10)
        on_n0 = next(k for k, m in zip(keys, kv.lookup(keys))
                     if m.replicas[0].node.node_id == "n0")
    with grpc.insecure_channel(cluster.conductor.address) as ch:
        stub = spb_grpc.ConductorStub(ch)
        for i in range(REFUSED):
            (last,) = list(stub.Generate(spb.GenerateRequest(request_id=f"r{i}", max_tokens=1),
                                         timeout=10))
            assert last.rejected and last.error_code == "INVALID_ARGUMENT"
    return {"keys": keys, "on_n0": on_n0}


def _kvctl(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.tools.cli.kvctl", *args],
                          capture_output=True, text=True, timeout=timeout)


def _in_process_json(master: str, *args: str) -> dict:
    result = CliRunner().invoke(app, ["--master", master, *args, "--json"], prog_name="kvctl")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def top(cluster, loaded):
    """``kvctl top --once --json`` run while a client reads from n0 and looks keys up."""
    stop = threading.Event()
    rounds = [0]

    def reads():
        with KVClient(cluster.master, prefer_shm=False, meta_cache_entries=0) as kv:
            while not stop.is_set():
                kv.get(loaded["on_n0"])                       # a Lookup hit, a get on n0
                kv.lookup([loaded["keys"][0], "top/missing"])   # a hit and a miss
                rounds[0] += 1

    reader = threading.Thread(target=reads, daemon=True)
    reader.start()
    try:
        wait_for(lambda: rounds[0] > 0, what="the reads to be under way")
        t0 = time.monotonic()
        run = _kvctl("--master", cluster.master, "top", "--once", "--json", "--interval", "0.5",
                     "--conductor-metrics", cluster.conductor.info["metrics_address"])
        elapsed = time.monotonic() - t0
    finally:
        stop.set()
        reader.join(10)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    out["_elapsed_s"] = elapsed
    return out


def _process(top: dict, role: str, name: str) -> dict:
    (p,) = [p for p in top["processes"] if (p["role"], p["name"]) == (role, name)]
    return p


def test_shards_and_nodes_equal_kvctl_stats_and_nodes(cluster, top):
    stats = _in_process_json(cluster.master, "stats")
    nodes = {n["node_id"]: n for n in _in_process_json(cluster.master, "nodes")["nodes"]}
    (shard,) = top["shards"]
    (want,) = stats["shards"]
    assert shard["num_objects"] == want["num_objects"] == len(SIZES)
    assert shard["total_bytes"] == want["total_bytes"] == sum(SIZES)
    assert shard["leader"] == cluster.master
    assert shard["metrics_address"] == cluster.shards[0][0].info["metrics_address"]
    assert (shard["nodes"], shard["nodes_alive"]) == (2, 2)
    assert [n["node_id"] for n in top["nodes"]] == ["n0", "n1"]
    per_tier: dict[str, dict[str, int]] = {}
    for n in top["nodes"]:
        ref = nodes[n["node_id"]]
        assert n["num_objects"] == ref["num_objects"] > 0
        assert (n["used_bytes"], n["capacity_bytes"]) == (ref["used_bytes"],
                                                         ref["capacity_bytes"])
        assert n["tiers"] == {t["tier"]: {"used_bytes": t["used_bytes"],
                                          "capacity_bytes": t["capacity_bytes"],
                                          "num_objects": t["num_objects"]}
                              for t in ref["tiers"]}
        for tier, t in n["tiers"].items():
            agg = per_tier.setdefault(tier, {"used_bytes": 0, "capacity_bytes": 0})
            agg["used_bytes"] += t["used_bytes"]
            agg["capacity_bytes"] += t["capacity_bytes"]
        assert n["evictions_total"] == 0 and n["evictions_per_s"] == 0.0
    assert per_tier == {k: {"used_bytes": v["used_bytes"], "capacity_bytes": v["capacity_bytes"]}
                        for k, v in want["tiers"].items()}
    assert top["nodes"][0]["metrics_address"] == cluster.nodes["n0"].info["metrics_address"]
    assert top["nodes"][1]["metrics_address"] == ""


def test_rates_lookups_and_latencies(top):
    assert top["interval_s"] >= 0.5
    (shard,) = top["shards"]
    assert shard["lookups_per_s"] > 0 and 0 < shard["hit_rate"] < 1
    master = _process(top, "master", "shard 0")
    assert master["scrape_error"] is None
    ops = master["requests"]
    assert ops["GrantPlacement"]["requests_total"] >= 1    # the batch put's grant
    assert ops["Lookup"]["requests_total"] > 0 and ops["Lookup"]["requests_per_s"] > 0
    assert ops["Lookup"]["p99_ms"] > 0 and ops["Lookup"]["p50_ms"] <= ops["Lookup"]["p99_ms"]
    assert ops["Stat"]["requests_total"] >= 2              # kvctl top's own two samples
    n0 = _process(top, "node", "n0")["requests"]
    assert n0["put"]["requests_total"] == top["nodes"][0]["num_objects"]
    assert n0["get"]["requests_per_s"] > 0 and n0["get"]["p99_ms"] > 0
    assert n0["get"]["errors_per_s"] == 0.0


def test_process_without_metrics_port_has_no_request_figures(top):
    assert _process(top, "node", "n1") == {"role": "node", "name": "n1", "metrics_address": "",
                                           "scrape_error": None, "requests": None}


def test_conductor_rejections(cluster, top):
    c = _process(top, "conductor", cluster.conductor.info["metrics_address"])
    assert c["scrape_error"] is None
    assert c["rejections_total"]["invalid"] == REFUSED
    assert c["generations_total"] == {"completed": 0, "failed": 0, "rejected": REFUSED}
    assert c["requests"]["Generate"]["requests_total"] == REFUSED
    assert c["ttft_p50_ms"] is None and c["ttft_p99_ms"] is None   # no first token, ever
    assert c["rejections_per_s"]["invalid"] == 0.0         # none in the window


def test_once_table(cluster, loaded):
    result = CliRunner().invoke(app, ["--master", cluster.master, "top", "--once",
                                      "--interval", "0.2"], prog_name="kvctl")
    assert result.exit_code == 0, result.output
    for part in ("shards", "nodes", "requests", "n0", "DRAM", "Lookup",
                 "no metrics port: n1"):
        assert part in result.stdout, part


def test_live_view_redraws_until_interrupted(cluster, loaded):
    address = cluster.shards[0][0].info["metrics_address"]

    def stats_served() -> int:        # each sample of kvctl top is one Stat call
        scrape = Scraper(timeout_s=5).scrape(address).scrape
        return int(totals(scrape, REQUESTS, by="op").get("Stat", 0))

    before = stats_served()
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli.kvctl", "--master",
                             cluster.master, "top", "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "COLUMNS": "100"})
    try:
        # A third sample has begun: the second one's frame was drawn.
        wait_for(lambda: stats_served() >= before + 3, timeout_s=20)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "kvctl top" in out and "shards" in out and "Traceback" not in err


def test_piped_output_is_a_table_per_interval(cluster, loaded, tmp_path):
    """Not a terminal: each sample is printed as it comes (nothing waits for Ctrl-C)."""
    out = tmp_path / "top.txt"
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli.kvctl", "--master",
                                 cluster.master, "top", "--interval", "0.2"],
                                stdout=f, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "COLUMNS": "100"})
    try:
        wait_for(lambda: out.read_text().count("kvctl top") >= 2, timeout_s=20)
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    text = out.read_text()
    assert text.count("shards") >= 2 and "\x1b[" not in text and "Traceback" not in err


def test_unreachable_master_is_one_error_line():
    run = _kvctl("--master", "127.0.0.1:1", "top", "--once", "--json", "--interval", "0.1")
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.startswith("kvctl: error: Unavailable") and run.stderr.count("\n") == 1
