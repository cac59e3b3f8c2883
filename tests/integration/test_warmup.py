"""A master's warm-up on real processes: it ends when the index is whole, never on a timer.

    kill -9 the master of a node with many objects   no old key is NotFound at any time
                                                     after READY; each is found once the
                                                     node's inventory is applied
    kill -9 a node with objects on its SSD           every SSD key is found after its READY
    a fresh master (empty roster)                    serves at once
    a master whose roster names a node not back      Unavailable saying what it waits for
                                                     (Stat, kvctl stats, /health), until the
                                                     node's ttl passes
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import pytest

from kvstore.client import KVClient
from kvstore.errors import IndexIncomplete, NotFound, Unavailable
from kvstore.tools.cluster.launcher import start_store_cluster
from kvstore.tools.cluster.processes import ProcessGroup, free_port, service_args
from kvtest import wait_for

pytestmark = pytest.mark.slow


def keys(n: int) -> list[str]:
    return [f"warm/{i:08d}" for i in range(n)]


def poll_until_found(master: str, sample: list[str], timeout_s: float = 60.0) -> dict:
    """Look ``sample`` up from now on (no SDK wait on an incomplete index): counts of
    each answer, until every key was found."""
    seen = {"found": 0, "not_found": 0, "unavailable": 0}
    missing = set(sample)
    deadline = time.monotonic() + timeout_s
    with KVClient(master, failover_wait_s=0.0) as kv:
        while missing:
            assert time.monotonic() < deadline, f"{len(missing)} keys never found: {seen}"
            try:
                answers = kv.lookup(sorted(missing))
            except Unavailable:
                seen["unavailable"] += 1
                time.sleep(0.02)
                continue
            for key, meta in zip(sorted(missing), answers):
                if isinstance(meta, NotFound):
                    seen["not_found"] += 1
                elif not isinstance(meta, Exception):
                    seen["found"] += 1
                    missing.discard(key)
    return seen


def test_no_old_key_is_not_found_after_a_killed_master_is_ready_again(tmp_path):
    n = 30_000
    c = start_store_cluster(1, 1, dram="64MiB", log_dir=str(tmp_path))
    try:
        with KVClient(c.master) as kv:
            for i in range(0, n, 3000):
                batch = keys(n)[i:i + 3000]
                assert kv.batch_put(batch, [b"v" * 64] * len(batch)) == [None] * len(batch)
        master = c.shards[0][0]
        os.kill(master.proc.pid, signal.SIGKILL)
        master.proc.wait()
        c.restart_master(0)                       # READY: the roster names n0
        seen = poll_until_found(c.master, keys(n)[::30])
        assert seen["not_found"] == 0, seen
        with KVClient(c.master) as kv:
            (st,) = kv.stat()
            assert st.num_objects == n and st.warmup_left_ms == 0
            assert st.counters["reindexed"] == n
            assert kv.get(keys(n)[-1]) == b"v" * 64
    finally:
        c.stop()


def test_every_ssd_key_is_found_once_a_killed_node_is_ready_again(tmp_path):
    c = start_store_cluster(1, 1, dram="4MiB", ssd="256MiB", ssd_dir=str(tmp_path / "ssd"),
                            eviction_policy="default", log_dir=str(tmp_path))
    try:
        n = 2000
        value = b"s" * 4096                       # 8 MiB: half of it must go to the SSD
        with KVClient(c.master) as kv:
            for i in range(0, n, 500):
                assert kv.batch_put(keys(n)[i:i + 500], [value] * 500) == [None] * 500
            where = dict(zip(keys(n), kv.locate(keys(n))))
        on_ssd = [k for k, w in where.items() if not isinstance(w, Exception)
                  and any(t == "SSD" for _, t in w)]
        assert len(on_ssd) > n // 3
        node = c.nodes["n0"]
        os.kill(node.proc.pid, signal.SIGKILL)
        node.proc.wait()
        c.start_node("n0")                        # READY: its inventory is applied
        seen = poll_until_found(c.master, on_ssd, timeout_s=10)
        assert seen["not_found"] == 0 and seen["unavailable"] == 0, seen
        with KVClient(c.master) as kv:
            assert kv.get(on_ssd[-1]) == value
    finally:
        c.stop()


def test_a_fresh_master_serves_at_once(tmp_path):
    with ProcessGroup(log_dir=str(tmp_path)) as procs:
        m = procs.start("master", service_args("master", "--state-dir", str(tmp_path / "st")))
        with KVClient(m.address, failover_wait_s=0.0) as kv:
            assert isinstance(kv.lookup(["nothing"])[0], NotFound)   # not Unavailable
            assert kv.stat()[0].warmup_left_ms == 0


def health(port: int) -> tuple[int, dict]:
    """/health's status code and JSON body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_master_says_what_it_waits_for_until_the_node_is_back_or_its_ttl_passed(tmp_path):
    state = tmp_path / "st"
    state.mkdir()
    (state / "nodes.json").write_text(json.dumps({"nodes": ["n0"]}))
    port = free_port()
    with ProcessGroup(log_dir=str(tmp_path)) as procs:
        m = procs.start("master", service_args(
            "master", "--state-dir", str(state), "--node-ttl-ms", "10000",
            "--metrics-port", str(port)))
        with KVClient(m.address, failover_wait_s=0.0) as kv:
            with pytest.raises(IndexIncomplete, match=r"n0 \(not registered\)"):
                kv.get("k")
            (st,) = kv.stat()
            assert st.warmup_left_ms > 0
            assert [(w.node_id, w.state) for w in st.warmup_nodes] == [("n0", "waiting")]
        code, body = health(port)
        assert code == 503 and "n0 (not registered)" in body["detail"]
        # The node comes back: the index is whole once its inventory is applied.
        procs.start("n0", service_args("node", "--master", m.address, "--node-id", "n0",
                                       "--dram", "16MiB"))
        with KVClient(m.address, failover_wait_s=0.0) as kv:
            wait_for(lambda: kv.stat()[0].warmup_left_ms == 0, timeout_s=10)
            assert isinstance(kv.lookup(["k"])[0], NotFound)
        wait_for(lambda: health(port)[0] == 200, timeout_s=10)
