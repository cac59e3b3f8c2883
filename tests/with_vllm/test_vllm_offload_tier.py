"""KVStoreTier, kvstore as a secondary tier of vLLM's OffloadingConnector, tested as vLLM
tests its file tier on CPU (tests/v1/kv_offload/tiering/test_fs_tier.py): the tier built
by vLLM's SecondaryTierFactory from its out-of-tree config over a CPU primary tier,
here against a real kvstore master and node, each phase in its own vLLM-venv process
(offload_tier_run.py)."""

import json
import os
import subprocess
from pathlib import Path

from vllm_harness import PYTHON, kill_node

from kvstore.tools.cluster.launcher import start_store_cluster

RUN = Path(__file__).with_name("offload_tier_run.py")
CHUNK_BYTES = 16 * 1024 * 4


def _phase(tmp: Path, master: str, phase: str) -> dict:
    out = tmp / f"{phase}.json"
    proc = subprocess.run([PYTHON, str(RUN), master, str(out), phase], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_kvstore_tier_stores_loads_and_fails_cleanly(tmp_path):
    with start_store_cluster(1, 1, node_ttl_ms=10_000, log_dir=str(tmp_path)) as cluster:
        a = _phase(tmp_path, cluster.master, "store")
        b = _phase(tmp_path, cluster.master, "load")
        kill_node(cluster)
        c = _phase(tmp_path, cluster.master, "dead")
    # One process: misses, a store, hits, a byte-exact load into other chunks.
    assert a["empty"] == ["MISS", "MISS"]
    assert a["stored"] == [{"job_id": 1, "success": True, "successful_keys": None,
                            "transfer_bytes": 4 * CHUNK_BYTES}]
    assert a["after_store"] == ["HIT"] * 4
    assert a["loaded"][0]["success"] and a["exact"]
    # A chunk never stored fails its load; the stored ones of the job are named.
    assert [(r["job_id"], r["success"], r["successful_keys"]) for r in a["missing"]] == \
        [(3, False, None), (4, False, [1, 2])]
    assert [(r["job_id"], r["success"]) for r in a["two_jobs"]] == [(5, True), (6, True)]
    # Another process (another vLLM instance) finds and loads them byte-exact; another
    # model shares none.
    assert b["found"] == ["HIT"] * 4
    assert b["loaded"][0]["success"] and b["exact"]
    assert b["other_model"] == ["MISS"] * 4
    # The node is gone, the master still lists the chunks: the load fails (no error
    # raised into vLLM) and the failed chunks are misses from then on.
    assert c["listed"] == ["HIT", "HIT"]
    assert [(r["success"], r["successful_keys"]) for r in c["loaded"]] == [(False, None)]
    assert c["after_failure"] == ["MISS", "MISS"]
