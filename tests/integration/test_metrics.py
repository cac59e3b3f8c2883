"""Metrics and health on real processes: the figures move as the work done says.

    store    puts, gets, misses, evictions, an operator eviction: node and master
             counters equal what the client did and what the node itself reports
    HA       kill -9 of a shard leader: the standby's is_leader, leader_changes and
             gRPC health flip; /health 503 and /ready 200 while it stands by
    serving  requests through the conductor: TTFT / TBT observed per request and
             token, prefix hits equal the prefill's, tokens computed + loaded = prompt
    drain    SIGTERM with --drain-s: health flips first, the call in flight finishes
    auth     /metrics needs an admin or metrics token; /health and /ready do not
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvstore.client import KVClient, NotFound
from kvstore.tools.cluster.launcher import ClusterSpec, LocalCluster, start_store_cluster
from kvstore.tools.cluster.processes import ProcessGroup, service_args
from kvstore.transfer.shm import SEGMENT_PUT_MIN_BYTES
from waits import wait_until

OBSERVED = ("--metrics-port", "0")
VALUE = 256 * 1024


def scrape(address: str, token: str | None = None) -> dict[str, list[tuple[dict, float]]]:
    """Sample name -> [(labels, value)] from ``http://address/metrics``."""
    req = urllib.request.Request(f"http://{address}/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(m: dict, name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def http_status(address: str, path: str) -> int:
    try:
        return urllib.request.urlopen(f"http://{address}{path}", timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code


def grpc_health(address: str, service: str = "") -> str:
    with grpc.insecure_channel(address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_for(pred, timeout_s: float = 15.0, what: str = "condition"):
    return wait_until(pred, timeout_s=timeout_s, interval_s=0.1, what=what)


# ---- the store ----

@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with start_store_cluster(1, 1, standbys=1, etcd="local", dram="4MiB",
                             eviction_policy="default", master_args=OBSERVED,
                             node_args=OBSERVED,
                             log_dir=str(tmp_path_factory.mktemp("logs"))) as cluster:
        yield cluster


def test_node_and_master_count_what_happened(store):
    node = store.nodes["n0"]
    leader = store.shards[0][0]
    kv = KVClient(store.master)
    try:
        keys = [f"m/{i}" for i in range(40)]           # 10 MiB into a 4 MiB DRAM tier
        for k in keys:
            kv.put(k, os.urandom(VALUE))
        found = missing = 0
        for k in keys:
            try:
                kv.get(k)
                found += 1
            except NotFound:
                missing += 1
        victim = next(k for k in reversed(keys) if kv.exists(k))
        kv.remove(victim, reason="evict")
        own = wait_for(lambda: kv.node_stats().get("n0"), what="node stats")
        m = scrape(node.info["metrics_address"])
        dram = next(t for t in own["tiers"] if t["kind"] == "DRAM")
        assert value(m, "kvstore_tier_used_bytes", tier="DRAM") == dram["used_bytes"]
        assert value(m, "kvstore_tier_capacity_bytes", tier="DRAM") == dram["capacity_bytes"]
        assert value(m, "kvstore_tier_objects", tier="DRAM") == dram["num_objects"]
        evictions = own["counters"]["evictions"]
        assert evictions > 0
        assert value(m, "kvstore_evicted_objects_total") == evictions
        assert value(m, "kvstore_node_events_total", event="evictions") == evictions
        # Same host: a put under SEGMENT_PUT_MIN_BYTES is a PUT frame on the node's Unix
        # socket (a larger one SHM_ALLOC + SHM_COMMIT), every get an SHM_ACQUIRE.
        assert VALUE < SEGMENT_PUT_MIN_BYTES
        assert value(m, "kvstore_requests_total", op="put", code="OK") == len(keys)
        assert value(m, "kvstore_requests_total", op="shm_commit") == 0
        assert value(m, "kvstore_requests_total", op="shm_acquire", code="OK") >= found
        assert value(m, "kvstore_transfer_bytes_total", transport="shm",
                     direction="in") == len(keys) * VALUE
        assert value(m, "kvstore_transfer_bytes_total", transport="shm",
                     direction="out") >= found * VALUE
        assert value(m, "kvstore_connections", transport="shm") >= 1
        assert value(m, "kvstore_request_duration_seconds_count", op="put") == len(keys)

        mm = scrape(leader.info["metrics_address"])
        (st,) = kv.stat()
        assert value(mm, "kvstore_master_is_leader") == 1
        assert value(mm, "kvstore_objects") == st.num_objects
        assert value(mm, "kvstore_object_bytes") == st.total_bytes
        assert value(mm, "kvstore_nodes", state="alive") == 1
        assert value(mm, "kvstore_master_events_total", event="puts") == len(keys)
        assert value(mm, "kvstore_master_events_total", event="evicts") == 1
        assert value(mm, "kvstore_master_events_total",
                     event="replicas_evicted") == st.counters["replicas_evicted"]
        assert value(mm, "kvstore_lookup_keys_total", result="miss") >= missing
        assert value(mm, "kvstore_requests_total", op="GrantPlacement", code="OK") >= 1
        assert value(mm, "kvstore_request_duration_seconds_count", op="GrantPlacement") >= 1
        # Every request counted with its code: the Stat calls above are admin's (no auth here).
        assert value(mm, "kvstore_requests_total", op="Stat", code="OK") >= 1
    finally:
        kv.close()


def test_leader_kill_flips_is_leader_health_and_leader_changes(store):
    leader, standby = store.shards[0]
    sm = standby.info["metrics_address"]
    assert value(scrape(sm), "kvstore_master_is_leader") == 0
    assert grpc_health(standby.address, "kvstore.v1.Master") == "NOT_SERVING"
    assert grpc_health(leader.address) == "SERVING"
    assert http_status(sm, "/health") == 503 and http_status(sm, "/ready") == 200
    assert http_status(leader.info["metrics_address"], "/health") == 200
    leader.proc.send_signal(signal.SIGKILL)
    leader.proc.wait(10)
    wait_for(lambda: value(scrape(sm), "kvstore_master_is_leader") == 1, 20, "the standby to lead")
    m = scrape(sm)
    assert value(m, "kvstore_leader_changes_total") == 1
    # SERVING once the new term's warm-up (nodes re-registering) is over.
    wait_for(lambda: grpc_health(standby.address, "kvstore.v1.Master") == "SERVING", 10,
             "gRPC health of the new leader")
    assert http_status(sm, "/health") == 200


# ---- serving ----

@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    spec = ClusterSpec(num_nodes=1, node_dram="64MiB", metrics=True,
                       log_dir=str(tmp_path_factory.mktemp("serving")))
    with LocalCluster(spec) as cluster:
        yield cluster


def _generate(conductor: str, prompts: list[list[int]], max_tokens: int) -> list:
    from kvstore._proto import serving_pb2 as spb
    from kvstore._proto import serving_pb2_grpc as spb_grpc

    async def run():
        async with grpc.aio.insecure_channel(conductor) as ch:
            stub = spb_grpc.ConductorStub(ch)
            out = []
            for i, p in enumerate(prompts):
                last = None
                async for chunk in stub.Generate(spb.GenerateRequest(
                        request_id=f"r{i}-{time.monotonic_ns()}", prompt_tokens=p,
                        max_tokens=max_tokens)):
                    last = chunk
                out.append(last)
            return out
    return asyncio.run(run())


def test_engines_and_conductor_count_tokens_and_latencies(serving):
    prompt = [(7 * i) % 250 + 1 for i in range(96)]        # 6 blocks of 16 tokens
    done = _generate(serving.conductor, [prompt, prompt, prompt[:64] + [3] * 20], 5)
    assert all(c.done and not c.error for c in done), [c.error for c in done]
    cached = sum(c.metrics.cached_tokens for c in done)
    assert cached > 0
    total = sum(c.metrics.prompt_tokens for c in done)
    cm = scrape(serving.process("conductor").info["metrics_address"])
    assert value(cm, "kvstore_ttft_seconds_count") == 3
    assert value(cm, "kvstore_tbt_seconds_count") == 3 * 4     # 4 gaps after the first token
    assert value(cm, "kvstore_prefix_hit_tokens_total") == cached
    assert value(cm, "kvstore_prompt_tokens_total") == total
    assert value(cm, "kvstore_generations_total", outcome="completed") == 3
    assert value(cm, "kvstore_requests_rejected_total") == 0
    assert value(cm, "kvstore_requests_total", op="Generate", code="OK") == 3
    assert "kvstore_queue_depth" in cm
    pm = scrape(serving.process("prefill0").info["metrics_address"])
    assert value(pm, "kvstore_prefill_tokens_total", source="loaded") == cached
    assert value(pm, "kvstore_prefill_tokens_total") == total
    assert value(pm, "kvstore_kv_save_seconds_count") == 3
    assert value(pm, "kvstore_kv_load_seconds_count") == sum(c.metrics.hit_blocks > 0 for c in done)
    dm = scrape(serving.process("decode0").info["metrics_address"])
    assert value(dm, "kvstore_kv_load_seconds_count") == 3
    assert value(dm, "kvstore_decode_batch_size_count") >= 4
    assert value(dm, "kvstore_requests_total", op="Decode", code="OK") == 3


# ---- drain and credentials ----

def test_sigterm_flips_health_first_and_finishes_the_call_in_flight(tmp_path):
    spec = ClusterSpec(num_nodes=1, node_dram="64MiB", metrics=True,
                       conductor_args=("--drain-s", "1.5"), log_dir=str(tmp_path))
    with LocalCluster(spec) as cluster:
        conductor = cluster.process("conductor")
        maddr = conductor.info["metrics_address"]
        assert grpc_health(cluster.conductor) == "SERVING"

        async def one_long_call():
            from kvstore._proto import serving_pb2 as spb
            from kvstore._proto import serving_pb2_grpc as spb_grpc

            async with grpc.aio.insecure_channel(cluster.conductor) as ch:
                stub = spb_grpc.ConductorStub(ch)
                tokens, last = 0, None
                async for chunk in stub.Generate(spb.GenerateRequest(
                        request_id="long", prompt_tokens=list(range(1, 40)), max_tokens=60)):
                    if chunk.tokens and tokens == 0:
                        conductor.proc.send_signal(signal.SIGTERM)
                    tokens += len(chunk.tokens)
                    last = chunk
                return tokens, last

        tokens, last = asyncio.run(one_long_call())
        assert last.done and not last.error and tokens == 60
        # Still within --drain-s, or stopping: never SERVING again.
        status = http_status(maddr, "/health") if conductor.proc.poll() is None else 503
        assert status == 503
        assert conductor.proc.wait(15) == 0


def test_metrics_need_an_admin_or_metrics_token(tmp_path):
    from kvstore.tools.cluster.multihost import make_credentials

    creds = make_credentials(tmp_path / "creds", ["127.0.0.1"], tls=False)
    tokens = creds.tokens
    auth = tmp_path / "auth"
    auth.write_text(creds.auth_file.read_text() + f"metrics {'m' * 32}\n")
    with ProcessGroup(log_dir=str(tmp_path / "logs")) as procs:
        master = procs.start("master", service_args("master", "--auth", str(auth), *OBSERVED))
        maddr = master.info["metrics_address"]
        for token, want in ((None, 401), ("w" * 32, 401), (tokens["client"], 403),
                            (tokens["node"], 403)):
            with pytest.raises(urllib.error.HTTPError) as err:
                scrape(maddr, token)
            assert err.value.code == want, token
        assert "kvstore_master_is_leader" in scrape(maddr, tokens["admin"])
        assert "kvstore_master_is_leader" in scrape(maddr, "m" * 32)
        # SERVING once its warm-up (nodes re-registering) is over; no token needed.
        wait_for(lambda: http_status(maddr, "/health") == 200, 10, "/health")
        assert http_status(maddr, "/ready") == 200
        assert grpc_health(master.address) == "SERVING"    # probes carry no token


def test_check_config_reads_the_files_and_serves_nothing(tmp_path):
    import subprocess
    import sys

    def check(*argv):
        return subprocess.run([sys.executable, "-m", "kvstore.tools.cli.services", *argv,
                               "--check-config"], capture_output=True, text=True, timeout=60)

    auth = tmp_path / "auth"
    auth.write_text(f"admin {'a' * 20}\n")
    ok = check("master", "--host", "0.0.0.0", "--port", "7000", "--auth", str(auth),
               "--metrics-port", "9100", "--drain-s", "5")
    assert ok.returncode == 0 and ok.stdout.strip() == "kvstore master: configuration ok", ok
    for argv, words in ((("master", "--host", "0.0.0.0"), "--auth"),
                        (("master", "--auth", str(tmp_path / "missing")), "missing"),
                        (("node", "--master", "m:1", "--dram", "lots"), "lots"),
                        (("conductor", "--master", "m:1", "--prefill", "p:1", "--decode", "d:1",
                          "--http-port", "0", "--http-host", "0.0.0.0"), "--auth")):
        bad = check(*argv)
        assert bad.returncode == 2, (argv, bad)
        assert len(bad.stderr.strip().splitlines()) == 1 and words in bad.stderr, bad.stderr
    typo = check("master", "--metrics-prot", "9100")
    assert typo.returncode == 2 and "unrecognized arguments" in typo.stderr


def test_a_public_metrics_port_needs_auth_at_start_too(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "kvstore.tools.cli.services", "master",
                          "--port", "0", "--metrics-port", "0", "--metrics-host", "0.0.0.0"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "READY" not in run.stdout
    assert len(run.stderr.strip().splitlines()) == 1 and "--auth" in run.stderr


def test_health_watch_and_a_lower_case_bearer(tmp_path):
    auth = tmp_path / "auth"
    auth.write_text(f"admin {'a' * 20}\n")
    with ProcessGroup(log_dir=str(tmp_path / "logs")) as procs:
        master = procs.start("master", service_args("master", "--auth", str(auth), *OBSERVED))
        with grpc.insecure_channel(master.address) as ch:
            stream = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service="kvstore.v1.Master"), timeout=10)
            statuses = []
            for reply in stream:          # NOT_SERVING during the warm-up, then SERVING
                statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                if statuses[-1] == "SERVING":
                    break
        assert statuses[-1] == "SERVING"
        req = urllib.request.Request(f"http://{master.info['metrics_address']}/metrics",
                                     headers={"Authorization": "bearer " + "a" * 20})
        assert urllib.request.urlopen(req, timeout=10).status == 200


def test_a_conductor_without_live_engines_is_up_but_not_serving(tmp_path):
    with ProcessGroup(log_dir=str(tmp_path)) as procs:
        master = procs.start("master", service_args("master"))
        conductor = procs.start("conductor", service_args(
            "conductor", "--master", master.address, "--prefill", "p0=127.0.0.1:9",
            "--decode", "d0=127.0.0.1:9", "--http-port", "0", "--probe-interval-s", "0.1",
            "--probe-timeout-s", "0.2", *OBSERVED))
        maddr = conductor.info["metrics_address"]
        wait_for(lambda: http_status(maddr, "/health") == 503, 15, "engines marked dead")
        assert http_status(maddr, "/ready") == 200
        assert http_status(conductor.info["http_address"], "/health") == 503
        m = scrape(maddr)               # the HTTP front's requests are counted too
        assert value(m, "kvstore_requests_total", op="GET /health", code="503") >= 1


def test_a_standby_that_cannot_reach_etcd_is_not_ready(tmp_path):
    with ProcessGroup(log_dir=str(tmp_path)) as procs:
        master = procs.start("master", service_args(
            "master", "--etcd", "http://127.0.0.1:9", "--lease-ttl-s", "1", *OBSERVED))
        maddr = master.info["metrics_address"]
        wait_for(lambda: http_status(maddr, "/ready") == 200, 15, "a standby at first")
        wait_for(lambda: http_status(maddr, "/ready") == 503, 15, "/ready 503 without etcd")
        assert http_status(maddr, "/health") == 503
        assert master.proc.poll() is None            # it keeps trying
