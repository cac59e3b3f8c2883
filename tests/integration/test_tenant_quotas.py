"""Issue 35's quotas on real processes with ``--auth`` and two tenants, alpha and beta:
beta's puts past its 100 MiB hard limit are NoSpace naming beta and its figures (alpha
goes on), ``kvctl tenants`` shows each tenant's figures (a tenant's token its own only),
a quota changed by SIGHUP is in force without a restart, and alpha's objects, within
alpha's guaranteed share of a node, are not evicted by beta's pressure, nor by a put of
beta's that is refused."""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
import urllib.request

import pytest
from typer.testing import CliRunner

from kvstore.client.client import KVClient
from kvstore.errors import NoSpace
from kvstore.tools.cli.kvctl import app as kvctl_app
from kvtest import start_store_cluster, wait_for

pytestmark = pytest.mark.slow

MiB = 1 << 20
TOKENS = {"admin": f"admin-{secrets.token_hex(16)}", "node": f"node-{secrets.token_hex(16)}",
          "alpha": f"alpha-{secrets.token_hex(16)}", "beta": f"beta-{secrets.token_hex(16)}"}


def auth_text(tenant_lines: str) -> str:
    return (f"admin {TOKENS['admin']}\nnode {TOKENS['node']}\n"
            f"client {TOKENS['alpha']} tenants=alpha\nclient {TOKENS['beta']} tenants=beta\n"
            + tenant_lines)


def start(tmp, tenant_lines: str, dram: str, policy: str = "none", node_args=()):
    auth = tmp / "tokens"
    auth.write_text(auth_text(tenant_lines))
    c = start_store_cluster(nodes=1, log_dir=str(tmp), dram=dram, eviction_policy=policy,
                            master_args=("--auth", str(auth)),
                            node_args=("--auth", str(auth), *node_args),
                            env={"KVSTORE_TOKEN": TOKENS["node"]})
    c.auth_file = auth
    return c


def scrape(address: str, token: str) -> dict[str, float]:
    """The ``kvstore_*tenant*`` samples of a /metrics page: "name{labels}" -> value."""
    req = urllib.request.Request(f"http://{address}/metrics",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if "tenant" in line and not line.startswith("#")}


def kvctl_tenants(master: str, token: str) -> dict[str, dict]:
    result = CliRunner().invoke(kvctl_app, ["--master", master, "tenants", "--json"],
                                env={"KVSTORE_TOKEN": token}, prog_name="kvctl")
    assert result.exit_code == 0, result.output
    return {t["tenant"]: t for t in json.loads(result.stdout)["tenants"]}


def admin_stat(cluster):
    with KVClient(cluster.master, token=TOKENS["admin"], prefer_shm=False) as admin:
        return admin.stat()


def hup(cluster, text: str) -> None:
    cluster.auth_file.write_text(text)
    for child in [*cluster.shards[0], *cluster.nodes.values()]:
        child.proc.send_signal(signal.SIGHUP)


def test_a_hard_limit_refuses_the_tenant_naming_it_and_sighup_changes_it(tmp_path):
    c = start(tmp_path, "tenant beta bytes=100MiB\n", dram="192MiB")
    try:
        value = os.urandom(MiB)
        with KVClient(c.master, token=TOKENS["beta"], prefer_shm=False) as beta:
            for i in range(100):
                assert beta.put(f"@beta/{i}", value)
            with pytest.raises(NoSpace) as err:
                beta.put("@beta/100", value)
            assert "tenant beta: 100.0 MiB of 100.0 MiB used" in err.value.message
            with KVClient(c.master, token=TOKENS["alpha"], prefer_shm=False) as alpha:
                assert alpha.put("@alpha/0", value)         # another tenant is not limited
            figures = kvctl_tenants(c.master, TOKENS["admin"])
            assert figures["beta"]["objects"] == 100 and figures["beta"]["bytes"] == 100 * MiB
            assert figures["beta"]["max_bytes"] == 100 * MiB
            assert figures["beta"]["counters"]["refusals"] >= 1
            assert figures["beta"]["counters"]["puts"] == 100
            assert figures["alpha"]["objects"] == 1
            assert set(kvctl_tenants(c.master, TOKENS["beta"])) == {"beta"}   # its own only

            hup(c, auth_text("tenant beta bytes=101MiB\n"))

            def raised() -> bool:
                try:
                    return beta.put("@beta/100", value)
                except NoSpace:
                    return False
            wait_for(raised, timeout_s=10, what="the new quota in force")
            with pytest.raises(NoSpace, match="tenant beta: 101.0 MiB of 101.0 MiB"):
                beta.put("@beta/101", value)
        c.procs.check()
    finally:
        c.stop()


def test_a_tenant_within_its_share_is_not_evicted_by_anothers_pressure(tmp_path):
    c = start(tmp_path, "tenant alpha share=40%\ntenant beta bytes=100MiB\n", dram="48MiB",
              policy="lru", node_args=("--metrics-port", "0"))
    try:
        value = os.urandom(MiB)
        with KVClient(c.master, token=TOKENS["alpha"], prefer_shm=False) as alpha, \
                KVClient(c.master, token=TOKENS["beta"], prefer_shm=False) as beta:
            for i in range(16):                      # 16 MiB: within 40 % of 48 MiB
                assert alpha.put(f"@alpha/{i}", value)
            for i in range(150):                     # beta fills the node three times over
                assert beta.put(f"@beta/{i}", value)
            for i in range(16):
                assert bytes(alpha.get(f"@alpha/{i}")) == value
            figures = kvctl_tenants(c.master, TOKENS["admin"])
            assert figures["beta"]["counters"]["evictions"] > 0
            assert figures["alpha"]["counters"]["evictions"] == 0
            assert figures["alpha"]["objects"] == 16
            (node,) = [n for st in admin_stat(c) for n in st.nodes]
        node_figures = scrape(node.address.metrics_address, TOKENS["admin"])
        assert node_figures['kvstore_node_tenant_bytes{tenant="alpha"}'] == 16 * MiB
        assert node_figures['kvstore_node_tenant_share_bytes{tenant="alpha"}'] == int(0.4 * 48 * MiB)
        hup(c, auth_text("tenant alpha share=10%\ntenant beta bytes=100MiB\n"))   # no restart
        wait_for(lambda: scrape(node.address.metrics_address, TOKENS["admin"]).get(
            'kvstore_node_tenant_share_bytes{tenant="alpha"}') == int(0.1 * 48 * MiB),
            timeout_s=10, what="the node's new share")
        c.procs.check()
    finally:
        c.stop()


def test_a_refused_put_evicts_no_other_tenants_objects(tmp_path):
    """Issue 35 F1: beta's put over its hard limit (refused by the master only at
    STORED) or over its share with alpha within alpha's made room first by evicting
    alpha's objects. Now the node refuses it before evicting anything."""
    c = start(tmp_path, "tenant alpha share=10%\ntenant beta bytes=1MiB\n", dram="64MiB",
              policy="lru")
    try:
        value = os.urandom(MiB)
        with KVClient(c.master, token=TOKENS["alpha"], prefer_shm=False) as alpha, \
                KVClient(c.master, token=TOKENS["beta"], prefer_shm=False) as beta:
            for i in range(40):                      # 40 MiB: above alpha's 10 %
                assert alpha.put(f"@alpha/{i}", value)
            big = os.urandom(50 * MiB)
            with pytest.raises(NoSpace, match="tenant beta: put of 50.0 MiB refused"):
                beta.put("@beta/big", big)           # larger than beta's 1 MiB quota
            hup(c, auth_text("tenant alpha share=75%\n"))   # alpha within; beta no limit

            def refused_for_alphas_share() -> bool:      # (the old limit until reloaded)
                try:
                    beta.put("@beta/big", big)
                except NoSpace as exc:
                    return "tenant beta: 0 B on this node, its guaranteed share 0 B" in exc.message
                return False
            wait_for(refused_for_alphas_share, timeout_s=10, what="the node's new shares")
            figures = kvctl_tenants(c.master, TOKENS["admin"])
            assert figures["alpha"]["objects"] == 40
            assert figures["alpha"]["counters"]["evictions"] == 0
            assert all(bytes(alpha.get(f"@alpha/{i}")) == value for i in range(40))
        c.procs.check()
    finally:
        c.stop()


def test_tenant_metrics_on_the_master_and_a_scoped_token_reads_its_own(tmp_path):
    auth = tmp_path / "tokens"
    metrics_beta = f"metrics-{secrets.token_hex(16)}"
    auth.write_text(auth_text("tenant beta bytes=1MiB\n") + f"metrics {metrics_beta} tenants=beta\n")
    c = start_store_cluster(nodes=1, log_dir=str(tmp_path),
                            master_args=("--auth", str(auth), "--metrics-port", "0"),
                            node_args=("--auth", str(auth)), env={"KVSTORE_TOKEN": TOKENS["node"]})
    try:
        with KVClient(c.master, token=TOKENS["beta"], prefer_shm=False) as beta, \
                KVClient(c.master, token=TOKENS["alpha"], prefer_shm=False) as alpha:
            assert beta.put("@beta/0", os.urandom(600 << 10))
            with pytest.raises(NoSpace):
                beta.put("@beta/1", os.urandom(600 << 10))
            assert alpha.put("@alpha/0", b"x" * 100)
            with KVClient(c.master, token=TOKENS["admin"], prefer_shm=False) as admin:
                address = admin.stat()[0].metrics_address

        samples = scrape(address, TOKENS["admin"])
        assert samples['kvstore_tenant_bytes{tenant="beta"}'] == 600 << 10
        assert samples['kvstore_tenant_refusals_total{tenant="beta"}'] == 1
        assert samples['kvstore_tenant_objects{tenant="alpha"}'] == 1
        assert samples['kvstore_tenant_limit_bytes{tenant="beta"}'] == 1 << 20
        own = " ".join(scrape(address, metrics_beta))
        assert 'tenant="beta"' in own and 'tenant="alpha"' not in own
        c.procs.check()
    finally:
        c.stop()


def test_quotas_from_etcd_are_in_force_without_a_signal_and_go_with_the_key(tmp_path):
    """With --etcd, /kvstore/CLUSTER/tenants holds tenant lines that every shard
    reads (kvstore.master.quota_source): set, they limit beta; deleted, the file's
    quotas (none) are back; a value that does not parse keeps the last good one."""
    from kvstore.master.election import Etcd
    from kvstore.master.quota_source import etcd_key

    auth = tmp_path / "tokens"
    auth.write_text(auth_text(""))
    c = start_store_cluster(nodes=1, log_dir=str(tmp_path), dram="64MiB", etcd="local",
                            master_args=("--auth", str(auth)), node_args=("--auth", str(auth)),
                            env={"KVSTORE_TOKEN": TOKENS["node"]})
    try:
        args = c.master_args
        etcd = Etcd(args[args.index("--etcd") + 1])
        key = etcd_key(args[args.index("--cluster-name") + 1])

        def beta_limit(kv) -> int:
            return next((t.max_objects for t in kv.tenant_stats() if t.tenant == "beta"), 0)

        with KVClient(c.master, token=TOKENS["beta"], prefer_shm=False) as beta:
            etcd.put(key, "# from etcd\ntenant beta objects=3\n")
            wait_for(lambda: beta_limit(beta) == 3, timeout_s=15)
            for i in range(3):
                beta.put(f"@beta/e{i}", b"x" * 1000)
            with pytest.raises(NoSpace, match="beta"):
                beta.put("@beta/e3", b"x" * 1000)
            etcd.put(key, "tenant beta objects=lots\n")       # refused: 3 stays in force
            time.sleep(2.5)
            assert beta_limit(beta) == 3
            etcd.delete(key)
            wait_for(lambda: beta_limit(beta) == 0, timeout_s=15)
            beta.put("@beta/e3", b"x" * 1000)
    finally:
        c.stop()
