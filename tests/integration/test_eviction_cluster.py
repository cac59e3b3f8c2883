"""Eviction on real nodes: what list / exists / get report stays true under pressure."""

from __future__ import annotations

import random

import pytest

from kvstore.client import KVClient, NotFound
from kvtest import cluster_running, node_stats, wait_for

KiB, MiB = 1024, 1024 * 1024


@pytest.fixture(scope="module")
def evicting(tmp_path_factory):
    with cluster_running(str(tmp_path_factory.mktemp("evict-logs")), num_nodes=2, dram="4MiB",
                         eviction_policy="default") as running:
        yield running


def value(i: int, size: int) -> bytes:
    return random.Random(i).randbytes(size)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_pressure_never_returns_wrong_bytes(evicting, transport):
    rng = random.Random(7)
    written: dict[str, bytes] = {}
    with KVClient(evicting.master, prefer_shm=transport == "shm") as kv:
        for i in range(120):                      # ~24 MiB into 8 MiB of DRAM
            size = rng.choice([1, 4 * KiB, 64 * KiB, 256 * KiB, 512 * KiB])
            key = f"{transport}/p{i}"
            data = value(i, size)
            assert kv.put(key, data) is True
            written[key] = data
            if i % 10 == 9:                       # reads in between
                for k in rng.sample(sorted(written), 5):
                    try:
                        assert kv.get(k) == written[k]
                    except NotFound:
                        pass
        for meta in kv.list(f"{transport}/"):
            try:
                assert kv.get(meta.key) == written[meta.key]
            except NotFound:
                pass                              # evicted after the listing: allowed
        # After a heartbeat the master's view is the nodes' own count, within capacity.
        wait_for(lambda: all(n.used_bytes <= n.capacity_bytes for n in node_stats(kv).values()))
        st = kv.stat()[0]
        assert st.counters["replicas_evicted"] > 0
        # The index catches up with the nodes: exists agrees with get.
        keys = sorted(written)

        mismatches: list = []

        def consistent() -> bool:
            ex = kv.batch_exists(keys)
            got = kv.batch_get(keys)
            mismatches[:] = [(k, e, repr(g)[:80]) for k, e, g in zip(keys, ex, got)
                             if e != (not isinstance(g, NotFound))]
            return not mismatches
        try:
            wait_for(consistent, timeout_s=10)
        except BaseException:
            raise AssertionError(f"exists disagrees with get: {mismatches[:5]}")
        assert all(g == written[k] for k, g in zip(keys, kv.batch_get(keys))
                   if not isinstance(g, NotFound))
