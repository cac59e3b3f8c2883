"""Objects on dead nodes, on real processes (issue 31, bugs 3 and 4).

    an old version a node brings back     put K=X on A (on its SSD), stop A; put K=Y on B;
                                          restart B (Y gone); restart A: K is NotFound,
                                          never X (the shard acknowledged Y since)
    one counting rule                     with a node dead, stat, kvctl ls, the RESP front's
                                          DBSIZE and SCAN and kvstore_objects all count the
                                          readable objects; the others are counted apart
"""

from __future__ import annotations

import os
import signal
import urllib.request

import pytest

from kvstore.client import KVClient
from kvstore.errors import NotFound
from kvstore.tools.cluster.launcher import start_store_cluster
from kvstore.tools.cluster.processes import free_port, service_args
from kvtest import wait_for

pytestmark = pytest.mark.slow


def test_a_node_back_with_a_version_the_shard_replaced_since_does_not_serve_it(tmp_path):
    c = start_store_cluster(1, 0, dram="4MiB", ssd="64MiB", ssd_dir=str(tmp_path / "ssd"),
                            eviction_policy="default", log_dir=str(tmp_path))
    try:
        a = c.start_node("a")
        with KVClient(c.master) as kv:
            assert kv.put("k", b"X" * 4096)
            for i in range(2000):                    # 8 MiB: K=X goes down to A's SSD
                kv.put(f"filler/{i}", b"f" * 4096)
            wait_for(lambda: ("a", "SSD") in kv.locate(["k"])[0], timeout_s=20)
        a.proc.send_signal(signal.SIGTERM)           # A stops (cleanly: dead at once)
        a.proc.wait()
        b = c.start_node("b")
        with KVClient(c.master) as kv:
            assert kv.put("k", b"Y" * 4096)          # the key's only version was on A
            assert kv.get("k") == b"Y" * 4096
        os.kill(b.proc.pid, signal.SIGKILL)         # B restarts: Y was in DRAM only
        b.proc.wait()
        c.start_node("b")
        c.start_node("a")                            # A comes back with X on its SSD
        with KVClient(c.master) as kv:
            with pytest.raises(NotFound):
                kv.get("k")
            assert kv.stat()[0].counters["stale_replicas_dropped"] >= 1
            assert kv.put("k", b"Z" * 10)            # and the key takes a new value
            assert kv.get("k") == b"Z" * 10
    finally:
        c.stop()


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_every_count_of_objects_follows_one_rule_while_a_node_is_dead(tmp_path):
    redis = pytest.importorskip("redis")
    metrics_port = free_port()
    c = start_store_cluster(1, 2, dram="16MiB", node_ttl_ms=1000, log_dir=str(tmp_path),
                            master_args=("--metrics-port", str(metrics_port)))
    try:
        keys = [f"count/{i}" for i in range(40)]
        with KVClient(c.master) as kv:
            assert kv.batch_put(keys, [b"v" * 100] * len(keys)) == [None] * len(keys)
            where = {k: loc[0][0] for k, loc in zip(keys, kv.locate(keys))}
        on_dead = sorted(k for k, node in where.items() if node == "n1")
        assert 0 < len(on_dead) < len(keys)
        os.kill(c.nodes["n1"].proc.pid, signal.SIGKILL)
        c.nodes["n1"].proc.wait()
        with KVClient(c.master) as kv:
            wait_for(lambda: not [n for n in kv.stat()[0].nodes if n.address.node_id == "n1"
                                  and n.alive], timeout_s=10)
            (st,) = kv.stat()
            readable = len(keys) - len(on_dead)
            assert len(list(kv.list("count/"))) == readable
            assert st.num_objects == readable and st.total_bytes == 100 * readable
            assert st.unavailable_objects == len(on_dead)
        assert _metric(metrics_port, "kvstore_objects") == readable
        assert _metric(metrics_port, "kvstore_objects_unavailable") == len(on_dead)
        front = c.procs.start("resp", service_args("resp", "--master", c.master))
        host, port = front.address.rsplit(":", 1)
        r = redis.Redis(host=host, port=int(port))
        assert r.dbsize() == readable
        assert len(list(r.scan_iter("count/*"))) == readable
    finally:
        c.stop()
