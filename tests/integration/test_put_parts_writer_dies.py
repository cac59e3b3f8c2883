"""A layer-wise writer killed (SIGKILL) or hung (SIGSTOP) mid-``put_parts`` blocks no one.

``put_parts`` is placed by a grant like every put: the master holds nothing
for it until a node reports the value STORED, so another writer's put of the
same key goes through at once (it used to get PutInProgress until the
master's 30 s put timeout revoked the dead writer's PENDING entry). The node
gives the dead writer's shared-memory reservation back when its connection
drops, or when a hung writer sends nothing for ``--write-timeout-s``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from kvstore.client import KVClient
from kvtest import cluster_running, wait_for
from parts_writer_worker import write_first_layer

LAYERS, LAYER_BYTES = 4, 64 * 1024
WRITE_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with cluster_running(str(tmp_path_factory.mktemp("parts-dies-logs")), num_nodes=1,
                         dram="64MiB",
                         extra_node_args=("--write-timeout-s", str(WRITE_TIMEOUT_S))) as running:
        yield running


@pytest.mark.parametrize("prefer_shm", [True, False], ids=["shm", "tcp"])
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_writer_gone_mid_put_parts_blocks_no_one(cluster, prefer_shm, how):
    key = f"parts-dies/{how.name}/{'shm' if prefer_shm else 'tcp'}"
    value = os.urandom(LAYERS * LAYER_BYTES)
    ctx = mp.get_context("spawn")
    opened = ctx.Queue()
    writer = ctx.Process(target=write_first_layer,
                         args=(cluster.master, prefer_shm, key, LAYERS, LAYER_BYTES, opened))
    with KVClient(cluster.master, prefer_shm=prefer_shm) as kv:
        used = kv.node_stats()["n0"]["used_bytes"]
        stalls = kv.node_stats()["n0"]["counters"].get("stalled_writes", 0)
        writer.start()
        try:
            assert opened.get(timeout=60) is True
            if prefer_shm:      # its reservation is in the node's segment
                assert kv.node_stats()["n0"]["used_bytes"] >= used + len(value)
            os.kill(writer.pid, how)
            # Another writer's put of the key is not held up by the one that stopped.
            assert kv.put(key, value) is True
            assert bytes(kv.get(key)) == value
            kv.remove(key)
            # Nothing of the stopped writer's is left on the node: a killed one's
            # connection dropped, a hung one's stalled past --write-timeout-s.
            wait_for(lambda: kv.node_stats()["n0"]["used_bytes"] == used,
                     timeout_s=WRITE_TIMEOUT_S + 10)
            if prefer_shm and how is signal.SIGSTOP:
                assert kv.node_stats()["n0"]["counters"]["stalled_writes"] == stalls + 1
        finally:
            writer.kill()
            writer.join(timeout=10)
    cluster.procs.check()
