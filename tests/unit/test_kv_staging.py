"""kvstore.client.integrations.vllm.staging: KV blocks between device tensors and host rows,
one copy each way.

The KV caches here are :class:`device_tensor.DeviceTensor` (the stand-in for
CUDA tensors: no numpy, no host pointer) in vLLM's ``[2, num_blocks, ...]``
layout, whose block slices are not contiguous.
"""

from __future__ import annotations

import pytest
import torch

from device_tensor import DeviceTensor
from kvstore.client.integrations.vllm.staging import BlockLayout, HostBuffers, copy_between, rows

NUM_BLOCKS, BLOCK, HEADS, DIM = 6, 4, 2, 8


def _block_slice(t: torch.Tensor, block_id: int) -> torch.Tensor:
    return t[:, block_id]                     # [2, num_blocks, block, heads, dim] layout


def _caches(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer.{i}": torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, DIM, generator=g).to(dtype)
            for i in range(3)}


def _gather(layout: BlockLayout, caches: dict[str, torch.Tensor], block_ids: list[int],
            host: HostBuffers) -> tuple[torch.Tensor, torch.Tensor]:
    buf = host.take(len(block_ids) * layout.object_bytes)
    objects = rows(buf, len(block_ids), layout.object_bytes)
    for name, layer in caches.items():
        off, size = layout.place(name)
        for row, bid in enumerate(block_ids):
            copy_between(objects[row, off:off + size], _block_slice(layer, bid), to_host=True,
                         pinned=host.pin)
    return buf, objects


def _scatter(layout: BlockLayout, caches: dict[str, torch.Tensor], block_ids: list[int],
             objects: torch.Tensor, host: HostBuffers) -> None:
    for name, layer in caches.items():
        off, size = layout.place(name)
        for row, bid in enumerate(block_ids):
            copy_between(objects[row, off:off + size], _block_slice(layer, bid), to_host=False,
                         pinned=host.pin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_blocks_of_device_tensors_go_to_host_rows_and_back(dtype):
    src = _caches(dtype, seed=1)
    device = {name: DeviceTensor(t) for name, t in src.items()}
    with pytest.raises(RuntimeError):
        _block_slice(device["layer.0"], 2).contiguous().numpy()     # the path that crashed
    layout = BlockLayout.of(device, _block_slice)
    per_layer = 2 * BLOCK * HEADS * DIM * src["layer.0"].element_size()
    assert layout.sizes == (per_layer,) * 3 and layout.offsets == (0, per_layer, 2 * per_layer)
    assert layout.object_bytes == 3 * per_layer
    host = HostBuffers()
    assert host.pin == torch.cuda.is_available()
    blocks = [4, 0, 2]
    buf, objects = _gather(layout, device, blocks, host)
    # An object is the block's slice of every layer, in order, as bytes.
    for row, bid in enumerate(blocks):
        want = torch.cat([_block_slice(t, bid).contiguous().reshape(-1).view(torch.uint8)
                          for t in src.values()])
        assert torch.equal(objects[row], want)
    dest_cpu = {name: torch.zeros_like(t) for name, t in src.items()}
    dest = {name: DeviceTensor(t) for name, t in dest_cpu.items()}
    _scatter(layout, dest, blocks, objects, host)
    for name in src:
        for bid in range(NUM_BLOCKS):
            got, want = _block_slice(dest_cpu[name], bid), _block_slice(src[name], bid)
            assert torch.equal(got, want if bid in blocks else torch.zeros_like(want))
    host.give(buf)


def test_a_layer_not_registered_has_no_place():
    layout = BlockLayout.of(_caches(torch.float32, seed=2), _block_slice)
    with pytest.raises(KeyError, match="layer.9"):
        layout.place("layer.9")


def test_host_buffers_are_reused_and_bounded():
    host = HostBuffers(pin=False, keep=2)
    a = host.take(100)
    assert a.dtype == torch.uint8 and a.device.type == "cpu" and a.numel() >= 100
    host.give(a)
    b = host.take(50)
    assert b.data_ptr() == a.data_ptr() and host.allocated == 1       # reused
    c = host.take(a.numel() + 1)                                      # does not fit: a new one
    assert host.allocated == 2 and c.numel() > a.numel()
    d = host.take(10)
    assert host.allocated == 3
    for buf in (b, c, d):
        host.give(buf)
    assert sorted(x.numel() for x in host._free) == sorted([b.numel(), c.numel()])[-2:]
    assert host.take(c.numel()).data_ptr() == c.data_ptr()           # the largest was kept
