"""The GPU tier on a real CUDA device: accounting, host<->device copies, a node's tier chain.

Marked ``gpu`` and skipped without a CUDA device (tests/unit runs the same tier
code on torch's CPU device).
"""

from __future__ import annotations

import os
import time

import pytest

from kvstore.keys import value_checksum
from kvstore.store.tiers.base import ObjectRecord, copy_between
from kvstore.types import TierKind
from kvstore.store.tiers.gpu import cuda_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason="needs a CUDA device")]

KiB, MiB = 1024, 1024 * 1024


def record(key: str, data: bytes, object_id: int = 1) -> ObjectRecord:
    return ObjectRecord(key, object_id, len(data), value_checksum(data), None)


@pytest.fixture
def gpu():
    from kvstore.store.tiers.gpu import GpuTier

    tier = GpuTier(8 * MiB, "cuda")
    try:
        yield tier
    finally:
        tier.close()


def test_gpu_tier_roundtrip_and_accounting(gpu):
    assert gpu.kind is TierKind.GPU
    assert gpu.buffer.is_cuda and gpu.buffer.numel() == 8 * MiB
    blobs = {f"k{i}": os.urandom(n) for i, n in enumerate([0, 1, 4096, 3 * MiB + 5])}
    extents = {k: gpu.allocate(record(k, v)) for k, v in blobs.items()}
    assert all(gpu.view(e) is None for e in extents.values())    # not host-addressable
    gpu.write_many([(extents[k], memoryview(v)) for k, v in blobs.items()])
    for k, v in blobs.items():
        out = bytearray(len(v))
        gpu.read_into(extents[k], memoryview(out))
        assert out == v
    assert gpu.used_bytes + gpu.free_bytes == gpu.capacity_bytes
    gpu.check_invariants()
    assert gpu.allocate(record("too-big", b"x" * (8 * MiB))) is None   # a return value
    for e in extents.values():
        gpu.free(e)
    assert gpu.used_bytes == 0


def test_gpu_tier_copies_with_dram(gpu):
    from kvstore.store.tiers.dram import DramTier

    dram = DramTier(4 * MiB)
    try:
        data = os.urandom(2 * MiB)
        src = dram.allocate(record("k", data))
        dram.view(src)[:] = data
        dst = gpu.allocate(record("k", data))
        copy_between(dram, src, gpu, dst)               # host -> device from the shm view
        dram.free(src)
        back = dram.allocate(record("k", data))
        copy_between(gpu, dst, dram, back)              # device -> host into the shm view
        assert bytes(dram.view(back)) == data
    finally:
        dram.close()


def test_node_chain_through_a_real_gpu(tmp_path):
    from kvstore.store.node import StoreNode
    from kvstore.store.tiers.dram import DramTier
    from kvstore.store.tiers.gpu import GpuTier
    from kvstore.store.tiers.ssd import SsdTier

    node = StoreNode([DramTier(256 * KiB), GpuTier(512 * KiB), SsdTier(str(tmp_path), 4 * MiB)],
                     "lru", high_watermark=0.75, low_watermark=0.5, start_mover=True)
    try:
        values = {}
        for i in range(64):
            data = os.urandom(16 * KiB)
            values[f"k{i}"] = data
            obj, _ = node.begin_write(f"k{i}", i + 1, len(data), value_checksum(data))
            node.write_view(obj)[:] = data
            node.commit_write(obj)
        node.mover.wake()
        deadline = time.monotonic() + 10
        while node.stats().tiers[0].used_bytes > 0.75 * 256 * KiB and time.monotonic() < deadline:
            time.sleep(0.05)
        placed = {k: t for k, _, _, _, t in node.holdings()}
        assert TierKind.GPU in placed.values()
        for k, v in values.items():
            obj = node.acquire(k)
            try:
                assert bytes(node.read_view(obj)) == v
            finally:
                node.release(obj)
        assert node.counters["evictions"] == 0
        node.check_invariants()
    finally:
        node.close()
