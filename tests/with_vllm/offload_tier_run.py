"""One process's part of the offload-tier test: KVStoreTier built by vLLM's own
SecondaryTierFactory over a CPU primary tier, as vLLM's tests build its file tier.

    python offload_tier_run.py MASTER OUT_JSON PHASE

PHASE ``store``: lookups of an empty store miss; chunks 0..3 are stored under
keys 1..4 and read back into chunks 4..7 byte-exact; a load of a key never
stored fails, one with such a key among stored ones fails with the stored
keys in ``successful_keys``; two jobs are reported apart. PHASE ``load`` (a
second process): a fresh tier finds keys 1..4 and loads them byte-exact
(the primary's data is a fixed-seed function of the chunk), and an engine of
another model finds none. PHASE ``dead`` (the store's node killed, the
master still listing the chunks): loads fail, and the failed chunks become
misses. OUT_JSON gets what was seen; the test compares it.
"""

import json
import sys
import time
import types

import numpy as np
import torch
from vllm.v1.kv_offload.base import (LookupResult, OffloadingKVEventsConfig, ReqContext,
                                     ScheduleEndContext, make_offload_key)
from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig,
                                       OffloadingModelConfig, OffloadingParallelConfig)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

NUM_CHUNKS = 8
CHUNK_ELEMENTS = 16 * 1024          # 64 KiB float32 chunks
CTX = ReqContext(req_id="test")


def spec(model: str = "tiny-model"):
    """What the tier reads of vLLM's OffloadingSpec: its config."""
    config = OffloadingConfig(
        groups=(), worker_kv_bytes_per_block=0, enable_kv_cache_events=False, extra_config={},
        engine_id="test-engine", model=OffloadingModelConfig(name=model, dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1,
                                          pcp_size=1, dcp_size=1, data_parallel_index=0,
                                          data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False))
    return types.SimpleNamespace(config=config, blocks_per_chunk=1, kv_events_config=
                                 OffloadingKVEventsConfig(enable_kv_cache_events=False,
                                                          self_describing_kv_events=False))


def key(n: int):
    return make_offload_key(n.to_bytes(8, "big"), 0)


def data(n: int) -> torch.Tensor:
    """The bytes stored under key n (the same in every process)."""
    return torch.from_numpy(np.random.default_rng(n).random(CHUNK_ELEMENTS, dtype=np.float32))


def job(job_id: int, keys: list[int], chunk_ids: list[int], promotion: bool) -> TransferJob:
    return TransferJob(job_id=job_id, keys=[key(k) for k in keys],
                       chunk_ids=np.array(chunk_ids, dtype=np.int64), is_promotion=promotion,
                       req_context=CTX)


def build(master: str, model: str = "tiny-model"):
    primary = torch.zeros(NUM_CHUNKS, CHUNK_ELEMENTS, dtype=torch.float32)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "KVStoreTier", "module_path": "kvstore.client.integrations.vllm.offload_tier",
         "master": master, "timeout_s": 2.0, "threads": 2},
        memoryview(primary.numpy()), spec(model))
    return tier, primary


def drain(tier) -> list[dict]:
    tier.drain_jobs()
    return sorted(({"job_id": r.job_id, "success": r.success,
                    "successful_keys": None if r.successful_keys is None else
                    sorted(int.from_bytes(bytes(k)[:8], "big") for k in r.successful_keys),
                    "transfer_bytes": r.transfer_bytes} for r in tier.get_finished_jobs()),
                  key=lambda r: r["job_id"])


def lookup(tier, keys: list[int]) -> list[str]:
    """A full async lookup cycle: ask, end the step, ask again until answered."""
    deadline = time.monotonic() + 10
    while True:
        got = [tier.lookup(key(k), CTX) for k in keys]
        if LookupResult.RETRY not in got or time.monotonic() > deadline:
            return [g.name for g in got]
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
        time.sleep(0.01)


def main() -> None:
    master, out, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    seen: dict = {}
    tier, primary = build(master)
    try:
        if phase == "store":
            seen["empty"] = lookup(tier, [1, 2])
            for i in range(4):
                primary[i] = data(i + 1)
            tier.submit_store(job(1, [1, 2, 3, 4], [0, 1, 2, 3], False))
            seen["stored"] = drain(tier)
            tier.on_request_finished(CTX)         # forget the cached misses of 1, 2
            seen["after_store"] = lookup(tier, [1, 2, 3, 4])
            tier.submit_load(job(2, [1, 2, 3, 4], [4, 5, 6, 7], True))
            seen["loaded"] = drain(tier)
            seen["exact"] = all(torch.equal(primary[4 + i], data(i + 1)) for i in range(4))
            tier.submit_load(job(3, [99], [0], True))
            tier.submit_load(job(4, [1, 2, 99], [5, 6, 7], True))
            seen["missing"] = drain(tier)
            tier.submit_store(job(5, [5], [0], False))
            tier.submit_store(job(6, [6], [1], False))
            seen["two_jobs"] = drain(tier)
            tier.touch([key(1)], CTX)
            tier.drain_jobs()
        elif phase == "load":
            seen["found"] = lookup(tier, [1, 2, 3, 4])
            tier.submit_load(job(1, [1, 2, 3, 4], [0, 1, 2, 3], True))
            seen["loaded"] = drain(tier)
            seen["exact"] = all(torch.equal(primary[i], data(i + 1)) for i in range(4))
            other, _ = build(master, model="another-model")
            try:
                seen["other_model"] = lookup(other, [1, 2, 3, 4])
            finally:
                other.shutdown()
        elif phase == "dead":
            seen["listed"] = lookup(tier, [1, 2])
            tier.submit_load(job(1, [1, 2], [0, 1], True))
            seen["loaded"] = drain(tier)
            seen["after_failure"] = lookup(tier, [1, 2])
    finally:
        tier.shutdown()
    with open(out, "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
