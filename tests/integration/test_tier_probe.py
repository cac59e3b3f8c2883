"""Existence probes never hold eviction back, and a node says why it cannot evict.

A real node's DRAM is pushed above its high watermark with every object held
by a shared-memory reader, so nothing can go: its stats must say why. Then,
while threads call batch_exists on every resident key as fast as they can,
the readers let go -- and eviction must still reach the low watermark. The
probes must not have touched the node (no read counted) nor the master's
access statistics.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvstore.client import KVClient
from kvstore.transfer.protocol import Op
from kvstore.transfer.tcp import NodeConnection
from kvtest import cluster_running, wait_for

MiB = 1024 * 1024
DRAM = 64 * MiB


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    base = tmp_path_factory.mktemp("probe")
    with cluster_running(str(base / "logs"), num_nodes=1, dram="64MiB", ssd="256MiB",
                         ssd_dir=str(base), eviction_policy="default") as running:
        yield running


def dram_stats(kv: KVClient) -> dict:
    (stats,) = kv.node_stats().values()
    return stats


def test_exists_probes_do_not_stop_eviction(probed):
    host, port = probed.nodes["n0"].address.rsplit(":", 1)
    with KVClient(probed.master, prefer_shm=False) as kv:
        conn = NodeConnection(host, int(port))
        keys, held = [], []
        for i in range(62):                        # 62 MiB held > 0.95 * 64 MiB
            key = f"probe/{i}"
            kv.put(key, bytes([i]) * MiB)
            oid, *_ = conn.call(Op.SHM_ACQUIRE, key)   # a reader holds it (promoted if need be)
            keys.append(key)
            held.append((key, oid))
        stats = dram_stats(kv)
        dram = stats["tiers"][0]
        assert dram["used_bytes"] > dram["high_watermark"] * DRAM
        assert dram["evictable_bytes"] == 0
        assert "being read" in dram["eviction_blocked"], dram   # the stats say why
        gets_before = stats["counters"]["gets"]
        lookups_before = kv.stat()[0].counters["lookup_hits"]

        stop = threading.Event()
        probes = [0]

        def probe() -> None:
            with KVClient(probed.master, prefer_shm=False) as prober:
                while not stop.is_set():
                    assert all(prober.batch_exists(keys))
                    probes[0] += 1

        threads = [threading.Thread(target=probe) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: probes[0] > 0, what="the probes to run")
            calls_at_release = probes[0]
            for key, oid in held:                  # the readers let go, probes go on
                conn.call(Op.SHM_RELEASE, key, oid)
            t0 = time.monotonic()
            # Generous: demotion writes 62 MiB to lmdb with fsync, slow on a busy
            # disk; what matters is that it completes while the probes go on.
            wait_for(lambda: dram_stats(kv)["tiers"][0]["used_bytes"] <= 0.85 * DRAM,
                     timeout_s=30)
            evict_s = time.monotonic() - t0
            assert probes[0] > calls_at_release     # probing went on all along
        finally:
            stop.set()
            for t in threads:
                t.join()
        stats = dram_stats(kv)
        dram = stats["tiers"][0]
        assert dram["used_bytes"] <= dram["low_watermark"] * DRAM + MiB
        assert not dram["eviction_blocked"]
        assert stats["counters"]["gets"] == gets_before            # no probe reached the node
        assert kv.stat()[0].counters["lookup_hits"] == lookups_before  # nor counted an access
        assert stats["counters"]["demotions"] > 0 and stats["counters"]["evictions"] == 0
        assert all(kv.batch_exists(keys))          # demoted, not lost
        conn.close()
    print(f"\nDRAM reached its low watermark {evict_s:.2f} s after release, "
          f"under {probes[0]} batch_exists probes of {len(keys)} keys")


def test_prefetch_and_pins_over_the_wire(probed):
    with KVClient(probed.master, prefer_shm=True) as kv:
        def put_mib(prefix: str, n: int) -> list[str]:
            keys = [f"{prefix}/{i}" for i in range(n)]
            for k in keys:
                assert kv.put(k, k.encode().ljust(MiB, b".")) is True
            return keys

        def tier(key: str) -> str:
            return kv.locate([key])[0][0][1]

        cold = put_mib("lookahead", 100)               # 100 MiB through 64 MiB of DRAM
        on_ssd = wait_for(lambda: [k for k, w in zip(cold, kv.locate(cold)) if w[0][1] == "SSD"])
        key, late = on_ssd[0], on_ssd[1]
        before = dram_stats(kv)["counters"]
        assert kv.prefetch([key, "lookahead/missing"], deadline_ms=60_000)[0] is None
        assert isinstance(kv.prefetch(["lookahead/missing"], deadline_ms=1)[0], Exception)
        wait_for(lambda: tier(key) == "DRAM")           # promoted by the node, event to the index
        assert dram_stats(kv)["tiers"][0]["num_protected"] >= 1
        put_mib("lookahead-more", 80)                   # pressure: the prefetched one stays
        assert tier(key) == "DRAM"
        assert kv.get(key) == key.encode().ljust(MiB, b".")
        assert kv.prefetch([late], deadline_ms=50) == [None]
        wait_for(lambda: dram_stats(kv)["counters"]["prefetch_wasted"] > before["prefetch_wasted"])
        after = dram_stats(kv)["counters"]
        assert after["prefetch_used"] == before["prefetch_used"] + 1
        assert after["prefetches"] == before["prefetches"] + 2

        hard, soft = put_mib("pinned", 2)
        kv.pin(hard)
        kv.pin(soft, ttl_ms=60_000)
        dram = dram_stats(kv)["tiers"][0]
        assert dram["num_pinned"] >= 1 and dram["num_soft_pinned"] >= 1
        put_mib("pinned-more", 100)
        assert tier(hard) == "DRAM"                     # never evicted while hard-pinned
        kv.unpin(hard)
        put_mib("pinned-after", 100)
        wait_for(lambda: tier(hard) == "SSD")           # unpinned: it may go now
        assert kv.get(hard) == hard.encode().ljust(MiB, b".")
