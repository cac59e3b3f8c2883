"""kvstore.client.integrations.vllm.loads: a load's read on a background thread, polled by
the engine thread, and its copy into the blocks of every layer (no vLLM, no store:
the read is a function of the test, gated by an event)."""

from __future__ import annotations

import threading
import time

import torch

from kvstore.client.integrations.vllm.loads import Loader, LoadJob
from kvstore.client.integrations.vllm.staging import BlockLayout, HostBuffers

NUM_BLOCKS = 5


def _block_slice(t: torch.Tensor, block_id: int) -> torch.Tensor:
    return t[block_id]


def _caches() -> dict[str, torch.Tensor]:
    return {f"layer.{i}": torch.zeros(NUM_BLOCKS, 4, 8) for i in range(2)}


def _object(layout: BlockLayout, value: float) -> torch.Tensor:
    return torch.full((layout.object_bytes // 4,), value, dtype=torch.float32).view(torch.uint8)


def test_read_in_background_then_copied_into_each_layer():
    caches, host = _caches(), HostBuffers(pin=False)
    layout = BlockLayout.of(caches, _block_slice)
    gate = threading.Event()

    def read(keys, dests):
        gate.wait(10)
        for i, d in enumerate(dests):
            d.copy_(_object(layout, float(i + 1)))
        return [layout.object_bytes] * len(keys)

    loader = Loader(read, host, layout.object_bytes, threads=1)
    loader.submit(LoadJob("r1", ["a", "b"], [3, 1]))
    assert loader.in_flight == 1 and loader.take_done() == []   # submit did not wait
    gate.set()
    deadline = time.monotonic() + 10
    while not (done := loader.take_done()) and time.monotonic() < deadline:
        time.sleep(0.01)
    (job,) = done
    assert loader.in_flight == 0 and job.req_id == "r1" and job.read_s > 0
    loaded, failed = job.copy_in(caches, layout, _block_slice, host)
    assert (loaded, failed) == (2, [])
    for layer in caches.values():
        assert torch.all(layer[3] == 1.0) and torch.all(layer[1] == 2.0)
        assert torch.all(layer[0] == 0.0) and torch.all(layer[2] == 0.0)
    assert job.buf is None                      # given back
    assert loader.close() == []


def test_failed_reads_and_wrong_sizes_are_reported_per_block():
    caches, host = _caches(), HostBuffers(pin=False)
    layout = BlockLayout.of(caches, _block_slice)

    def broken(keys, dests):
        raise ConnectionError("node gone")

    job = LoadJob("r", ["a", "b"], [0, 1])
    job.read(broken, host, layout.object_bytes)
    loaded, failed = job.copy_in(caches, layout, _block_slice, host)
    assert loaded == 0 and [bid for bid, _ in failed] == [0, 1]
    assert all(isinstance(e, ConnectionError) for _, e in failed)

    def short(keys, dests):
        return [layout.object_bytes, layout.object_bytes - 4, KeyError("missing")]

    job = LoadJob("r", ["a", "b", "c"], [2, 3, 4])
    job.read(short, host, layout.object_bytes)
    loaded, failed = job.copy_in(caches, layout, _block_slice, host)
    assert loaded == 1 and [bid for bid, _ in failed] == [3, 4]
    assert isinstance(failed[0][1], ValueError) and isinstance(failed[1][1], KeyError)
