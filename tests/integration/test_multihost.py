"""kvstore across hosts: network namespaces on this machine, ``--auth`` and TLS on.

    a: etcd, shards 0 and 1 (leader + standby each)   b: nodes b0 (0.0.0.0), b1
    c: node c0      d: prefill0, decode0, conductor (+ HTTP)      e: the clients

Processes reach each other only over the hosts' bridge (198.18.0.0/24);
the test removes the namespaces at the end, also on failure. Skipped
without root (network namespaces cannot be made).

    the demo replay from host e      same output digests as on loopback
    bad credentials on every port    refused (401/403, UNAUTHENTICATED, PERMISSION_DENIED)
    kvstore chaos --attach from e    kill -9 of node b0 and of shard 0's leader:
                                     0 lost, 0 wrong reads
    binding, in a namespace alone    no --auth: exit 2; kvctl without a token: refused;
                                     a node on 0.0.0.0 advertises its namespace's address
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from kvstore.tools.cluster import netns
from kvstore.tools.cluster.multihost import make_credentials, start_multihost
from kvstore.tools.cluster.processes import ProcessGroup, service_args
from kvstore.tools.demo.report import mismatched_outputs

REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"multi-host tests: {REASON}")

REPLAY_REQUESTS = 30
PROBE = Path(__file__).with_name("netns_probe.py")


def _figure(name: str, value) -> None:
    """Print a figure the closing notes quote (pytest -s, or the log on failure)."""
    print(f"MULTIHOST {name}: {value}", file=sys.stderr)


@pytest.fixture(scope="module")
def layout(tmp_path_factory):
    folder = tmp_path_factory.mktemp("multihost")
    hosts = netns.NetHosts(["a", "b", "c", "d", "e"])
    hosts.start()
    try:
        t0 = time.monotonic()
        mh = start_multihost(hosts, str(folder))
        _figure("start_s", round(time.monotonic() - t0, 1))
        try:
            mh.folder = folder
            yield mh
        finally:
            mh.stop()
    finally:
        hosts.close()
    assert not any(h.netns in _netns_list() for h in hosts.hosts.values())


def _netns_list() -> str:
    import subprocess

    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_nodes_advertise_their_hosts_addresses_and_identities(layout):
    listed = layout.run_client([sys.executable, "-m", "kvstore.tools.cli.kvctl", "--master",
                                layout.seed, "nodes", "--json"], role="admin")
    assert listed.returncode == 0, listed.stderr
    nodes = {n["node_id"]: n for n in json.loads(listed.stdout)["nodes"]}
    for name, host in (("b0", "b"), ("b1", "b"), ("c0", "c")):   # b0 is bound to 0.0.0.0
        assert nodes[name]["host"] == layout.hosts[host].address
        assert layout.store.nodes[name].address.startswith(layout.hosts[host].address + ":")
    # Shared memory only within a host: the host identity differs per namespace.
    assert nodes["b0"]["host_id"] == nodes["b1"]["host_id"] != nodes["c0"]["host_id"]
    mine = layout.run_client([sys.executable, "-c",
                              "from kvstore.transfer.shm import host_id; print(host_id())"])
    assert mine.stdout.strip() not in {n["host_id"] for n in nodes.values()}


def test_replay_from_host_e_matches_loopback(layout, tmp_path):
    import subprocess

    loop_out, far_out = tmp_path / "loopback.json", tmp_path / "multihost.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_T")}
    # One mode on the trace's first requests at its 0.25x clock: what replay sends.
    loop = subprocess.run([sys.executable, "-m", "kvstore.tools.cli.cli", "demo", "--cache-only",
                           "-n", str(REPLAY_REQUESTS), "--warmup", "0", "--window-start", "0",
                           "--time-scale", "0.25", "--out", str(loop_out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert loop.returncode == 0, loop.stdout[-2000:] + loop.stderr[-2000:]
    far = layout.run_client([sys.executable, "-m", "kvstore.tools.cli.cli", "replay", "--conductor",
                             layout.conductor.address, "-n", str(REPLAY_REQUESTS), "--out",
                             str(far_out)], timeout_s=600)
    assert far.returncode == 0, far.stdout[-2000:] + far.stderr[-2000:]
    a, b = json.loads(loop_out.read_text()), json.loads(far_out.read_text())
    assert a["completed"] == b["completed"] == REPLAY_REQUESTS
    assert a["errors"] == b["errors"] == 0
    assert mismatched_outputs(a, b) == []
    assert sorted(r["output_digest"] for r in a["per_request"]) == \
        sorted(r["output_digest"] for r in b["per_request"])
    _figure("replay", f"{REPLAY_REQUESTS} requests: loopback {a['duration_s']:.1f} s, "
                      f"multi-host (auth+TLS) {b['duration_s']:.1f} s, digests equal")


def test_bad_credentials_are_refused_on_every_port(layout, tmp_path):
    cluster, tokens = tmp_path / "cluster.json", tmp_path / "tokens.json"
    cluster.write_text(json.dumps(layout.describe()))
    tokens.write_text(json.dumps(layout.creds.tokens))
    probe = layout.run_client([sys.executable, str(PROBE), str(cluster), str(tokens)],
                              role=None, timeout_s=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    got: dict[str, str] = json.loads(probe.stdout)
    expected = {}
    for name in got:
        kind, what = name.split(" ", 1)[0], name.rsplit(" ", 1)[-1]
        if "anonymous" in name or "wrong token" in name:
            expected[name] = {"node": "Unauthenticated", "http": "401"}.get(kind,
                                                                           "UNAUTHENTICATED")
        elif "client:" in name or "node role" in name:
            expected[name] = "403" if kind == "http" else "PERMISSION_DENIED"
        elif what == "plaintext":
            expected[name] = got[name] if got[name] not in ("ok", "200") else "refused"
        elif what == "client":
            expected[name] = "200" if kind == "http" else "ok"
    assert got == expected
    ports = {" ".join(n.split()[:2]) if n.split()[0] in ("master", "node") else n.split()[0]
             for n in got}
    _figure("refusals", f"{len(got)} checks on {len(ports)} ports")


def test_chaos_from_host_e_loses_nothing(layout, tmp_path):
    desc = tmp_path / "cluster.json"
    desc.write_text(json.dumps(layout.describe()))
    run = layout.run_client([sys.executable, "-m", "kvstore.tools.cli.cli", "chaos", "--json",
                             "--attach", str(desc), "--kill-node", "b0", "--duration-s", "20",
                             "--kill-node-at-s", "5", "--kill-leader-at-s", "11"],
                            timeout_s=300)
    report = json.loads(run.stdout.strip().splitlines()[-1])
    _figure("chaos", report)
    assert run.returncode == 0, run.stderr[-3000:]
    assert report["lost"] == 0 and report["wrong_reads"] == 0
    assert report["acked_puts"] > 0 and report["failover_s"] > 0


# ---- binding, in a namespace of its own ----

@pytest.fixture()
def lone_host(tmp_path):
    with netns.NetHosts(["x"], subnet="198.18.1.0/24") as hosts:
        yield hosts


def test_binding_rules_in_a_namespace(lone_host, tmp_path):
    import subprocess

    host = lone_host["x"].address
    creds = make_credentials(tmp_path / "creds", [host], tls=False)
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_T")}

    def run(argv, role=None):
        env = dict(base, **({"KVSTORE_TOKEN": creds.tokens[role]} if role else {}))
        return lone_host.run("x", [sys.executable, "-m", *argv], env=env, capture_output=True,
                             text=True, timeout=120)

    refused = run(["kvstore.tools.cli.services", "master", "--host", host, "--port", "0"])
    assert refused.returncode == 2
    assert len(refused.stderr.strip().splitlines()) == 1 and "--auth" in refused.stderr
    with ProcessGroup(log_dir=str(tmp_path / "logs")) as procs:
        on_x = lone_host.exec_args("x")
        master = procs.start("master", service_args(
            "master", "--host", host, "--port", "0", "--auth", str(creds.auth_file)),
            prefix=on_x, env=base)
        assert master.address.startswith(host + ":")
        procs.start("node", service_args(
            "node", "--master", master.address, "--host", "0.0.0.0", "--node-id", "x0",
            "--auth", str(creds.auth_file)), prefix=on_x, env=dict(base, KVSTORE_TOKEN=creds.tokens["node"]))
        kvctl = ["kvstore.tools.cli.kvctl", "--master", master.address]
        anon = run([*kvctl, "nodes"])
        assert anon.returncode != 0 and "unauthenticated" in anon.stderr.lower(), anon.stderr
        nodes = run([*kvctl, "nodes", "--json"], role="admin")
        assert nodes.returncode == 0, nodes.stderr
        (node,) = json.loads(nodes.stdout)["nodes"]
        assert node["host"] == host, node
        put = lone_host.run(
            "x", [sys.executable, "-c", "import sys; from kvstore.client import KVClient; "
                  "KVClient(sys.argv[1]).put('k', b'v')", master.address],
            env=dict(base, KVSTORE_TOKEN=creds.tokens["client"]), capture_output=True,
            text=True, timeout=120)
        assert put.returncode == 0, put.stderr
        denied = run([*kvctl, "evict", "k"], role="client")
        assert denied.returncode != 0 and "permission" in denied.stderr.lower(), denied.stderr
        evicted = run([*kvctl, "evict", "k"], role="admin")
        assert evicted.returncode == 0, evicted.stderr


def test_namespaces_of_a_killed_owner_are_swept():
    import subprocess

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = f"kvs-{dead}.beef-a"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        with netns.NetHosts(["y"], subnet="198.18.2.0/24") as hosts:
            assert stale not in _netns_list().split()
            assert hosts["y"].netns in _netns_list()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
