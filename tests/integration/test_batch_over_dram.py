"""A same-host batch read of more bytes than the node's DRAM, from its SSD tier.

The client acquires every key of the batch (SHM_ACQUIRE) before it copies and
releases any, so the node's DRAM fills with that batch's own references. A
promotion that only their release could make room for used to wait for it
(room_wait_s, per key): every key of the batch timed out and the node stayed
blocked after the client had gone. It must answer NO_SPACE at once instead, and
the client then reads those keys over TCP, after releasing the rest.
"""

from __future__ import annotations

import random

import pytest

from kvstore.client import KVClient
from kvtest import cluster_running, wait_for

COUNT, SIZE = 300, 200_000           # 60 MB through 16 MiB of DRAM


@pytest.mark.slow
def test_a_shm_batch_larger_than_dram_reads_every_value(tmp_path):
    rng = random.Random(7)
    keys = [f"{i:032x}" for i in range(COUNT)]
    values = [rng.randbytes(SIZE) for _ in range(COUNT)]
    with cluster_running(str(tmp_path / "logs"), num_nodes=1, dram="16MiB", ssd="96MiB",
                         ssd_dir=str(tmp_path), eviction_policy="default") as running:
        with KVClient(running.master, prefer_shm=True) as kv:
            for s in range(0, COUNT, 20):
                assert kv.batch_put(keys[s:s + 20], values[s:s + 20]) == [None] * 20

            def demoted():
                tiers = next(iter(kv.node_stats().values()))["tiers"]
                return tiers[0]["num_objects"] < COUNT // 4
            wait_for(demoted, what="most objects demoted to the SSD")
            got = kv.batch_get(keys)     # before the fix: every key timed out
            assert [bytes(g) if isinstance(g, bytearray) else g for g in got] == values
            assert kv.batch_get(keys[:20]) == values[:20]   # nothing left blocked
