"""A node that never busy-polls (``kvstore node --busy-poll-us 0``) serves as any
other: sequential and batched puts and gets over TCP and shared memory, each
value read back whole."""

from __future__ import annotations

import numpy as np

from kvstore.client import KVClient
from kvstore.tools.cluster.launcher import start_store_cluster


def test_a_node_that_never_polls_serves_every_path():
    values = {f"poll-{i}": np.random.default_rng(i).integers(0, 256, 40_000 + i, np.uint8)
              .tobytes() for i in range(24)}
    keys = list(values)
    with start_store_cluster(masters=1, nodes=1, dram="64MiB",
                             node_args=("--busy-poll-us", "0")) as c:
        with KVClient(c.master, prefer_shm=False) as tcp:
            for k in keys[:8]:
                tcp.put(k, values[k])
            tcp.batch_put(keys[8:16], [values[k] for k in keys[8:16]])
            assert [tcp.get(k) for k in keys[:16]] == [values[k] for k in keys[:16]]
        with KVClient(c.master, prefer_shm=True) as shm:
            shm.batch_put(keys[16:], [values[k] for k in keys[16:]])
            assert shm.batch_get(keys) == [values[k] for k in keys]
