"""What the vLLM tests share in the pytest process (which needs no vLLM): the interpreter
that runs vLLM, the prompts, and starting, finishing and configuring one vLLM run.

Each vLLM run is its own process (vllm_run.py, or another script of this folder taking the
same arguments: MODEL_DIR OUT_JSON PROMPT(S)_JSON [KV_TRANSFER_CONFIG_JSON]) with
VLLM_ENABLE_V1_MULTIPROCESSING=0; the tiny random Llama and its tokenizer are built in
the test's tmp dir. The runs use the interpreter named by $KVSTORE_VLLM_PYTHON (a virtual
environment from ``tools/cluster/vllm_env.py``, as .ci/run builds), else this one when it
has vLLM. Importing this module without either skips the importing test module.

The store the runs talk to is each test's own ``start_store_cluster(1, 1, ...)`` (a master
and one node), started in the test itself: tests/fastlane.py marks a test slow by the
launcher it sees in the test's own source.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm_run import BLOCK

from kvstore.client.integrations.vllm.keys import kv_transfer_config


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


#: The interpreter of the vLLM runs.
PYTHON = _vllm_python()
HERE = Path(__file__).parent
RUN = HERE / "vllm_run.py"
#: The environment of every vLLM run, over this process's: vLLM in the run's own
#: process, nothing fetched from a hub.
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
PROMPT = [(i * 7 + 3) % 500 + 3 for i in range(100)]       # 3 full blocks + 4 tokens
LONGER = PROMPT + [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12]
FULL = len(PROMPT) // BLOCK                                 # full blocks of PROMPT


def start(tmp: Path, name: str, prompt, kv: dict | None = None, *, script: Path = RUN,
          **env: str) -> tuple[subprocess.Popen, Path]:
    """Start ``script`` on ``prompt`` (token ids, or a list of them for vllm_batch_run.py)
    with the connector config ``kv`` (None: none) and ``env`` over :data:`ENV`; returns the
    process and the JSON file it writes (tmp/NAME.json). The model is tmp/model."""
    out = tmp / f"{name}.json"
    args = [PYTHON, str(script), str(tmp / "model"), str(out), json.dumps(prompt)]
    if kv is not None:
        args.append(json.dumps(kv))
    return subprocess.Popen(args, env={**os.environ, **ENV, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True), out


def finish(proc: subprocess.Popen, out: Path) -> dict:
    """Wait for a run (300 s, then killed); it must exit 0. Returns what it wrote."""
    try:
        _stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        _stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-4000:]
    return json.loads(out.read_text())


def run(tmp: Path, name: str, prompt, kv: dict | None = None, **env: str) -> dict:
    """One run of vllm_run.py, start to finish: see :func:`start`."""
    return finish(*start(tmp, name, prompt, kv, **env))


def stats(tmp: Path, name: str, role: str) -> dict:
    """The connector's counters of run NAME's ``role`` ("scheduler", "worker"); {} if none."""
    path = tmp / f"{name}.{role}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def kv_config(master: str, tmp: Path, name: str, role: str = "kv_both", **extra) -> dict:
    """The connector's config for run NAME against ``master``: its counters go to
    tmp/NAME.ROLE.json (:func:`stats`); ``extra`` into kv_connector_extra_config."""
    cfg = kv_transfer_config(master, role)
    cfg["kv_connector_extra_config"].update(stats_path=str(tmp / name), **extra)
    return cfg


def device_kv_config(master: str, tmp: Path, name: str) -> dict:
    """:func:`kv_config` for device_connector.DeviceKVConnector: the connector given vLLM's KV
    tensors as device tensors (tests/device_tensor.py), as on a GPU."""
    cfg = kv_config(master, tmp, name)
    cfg.update(kv_connector="DeviceKVConnector", kv_connector_module_path="device_connector")
    return cfg


def kill_node(cluster) -> None:
    """SIGKILL the cluster's node n0 and remove its shared memory (a killed node cannot)."""
    node = cluster.nodes["n0"].proc
    node.kill()
    node.wait()
    for segment in Path("/dev/shm").glob(f"kvstore-{node.pid}-*"):
        segment.unlink(missing_ok=True)


def run_killing_the_node(cluster, tmp: Path, name: str, prompt, kv: dict, **start_kw) -> dict:
    """Start a run, kill the store's node once vLLM is up (the master still lists the
    blocks while the node's TTL has not passed), then let the request(s) come; returns
    what the run wrote. ``start_kw``: :func:`start`'s ``script`` and ``env``."""
    ready, go = tmp / f"{name}.ready", tmp / f"{name}.go"
    proc, out = start(tmp, name, prompt, kv, READY_FILE=str(ready), GO_FILE=str(go), **start_kw)
    deadline = time.monotonic() + 300
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_node(cluster)
    go.write_text("go")
    return finish(proc, out)
