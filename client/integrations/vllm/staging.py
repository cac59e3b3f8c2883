"""Copies of paged KV blocks between an engine's KV tensors and the store, through host buffers.

An engine's KV cache is usually in GPU memory, where the store's transports
cannot read (they take host memory: bytes, numpy, CPU tensors). A block's
object is the block's slice of every layer, back to back, in the layers'
order (:class:`BlockLayout`)::

    object of block b:  | layer 0 [b] | layer 1 [b] | ... | layer L-1 [b] |
                        ^ offsets[0]  ^ offsets[1]                        ^ object_bytes

A save copies each layer's slice once, device to host, straight into its
place in a staging buffer of ``[blocks, object_bytes]`` bytes, whose rows go to
``batch_put`` as they are (the SDK reads CPU tensors without a copy); a load
reads each object with ``batch_get_into`` into such a row and copies each
slice once, host to device. Buffers come from :class:`HostBuffers`, which
reuses them; where CUDA is available they are page-locked (pinned), so the
copies are DMA that may run asynchronously on the current stream
(:func:`copy_between`); the caller then waits with :func:`copies_done` before the
buffer is read or reused. CPU tensors take the same path (one copy, where
``.contiguous().numpy().tobytes()`` made two); bfloat16 too (numpy has no
bfloat16).

Thread safety: :class:`HostBuffers` may be taken from and given back to by any
thread; a buffer belongs to one holder from ``take`` to ``give``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

#: Staging buffers are allocated in multiples of this, so that a later, slightly
#: larger batch still fits a buffer kept from an earlier one.
ALLOC_GRANULE_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Where each layer's slice of one block lies in the block's object."""

    names: tuple[str, ...]          # layers in object order
    offsets: tuple[int, ...]        # byte offset of each layer's slice in the object
    sizes: tuple[int, ...]          # bytes of each layer's slice
    object_bytes: int               # one block's object: the sum of ``sizes``

    @classmethod
    def of(cls, layers: dict[str, torch.Tensor],
           block_slice: Callable[[torch.Tensor, int], torch.Tensor]) -> "BlockLayout":
        """The layout of ``layers`` (in their order) whose block ``b`` is ``block_slice(t, b)``."""
        sizes = tuple(block_slice(t, 0).numel() * t.element_size() for t in layers.values())
        offsets = tuple(sum(sizes[:i]) for i in range(len(sizes)))
        return cls(tuple(layers), offsets, sizes, sum(sizes))

    def place(self, name: str) -> tuple[int, int]:
        """``(offset, size)`` in bytes of layer ``name``'s slice.

        Raises:
            KeyError: not a layer of this layout.
        """
        try:
            i = self.names.index(name)
        except ValueError:
            raise KeyError(f"layer {name!r} is not among the registered KV caches") from None
        return self.offsets[i], self.sizes[i]


class HostBuffers:
    """Reusable host staging buffers: 1-D ``uint8`` CPU tensors, pinned where CUDA is.

    Args:
        pin: page-lock the buffers (default: when CUDA is available).
        keep: buffers kept for reuse once given back (the largest); more are freed.
            A buffer per step is in use at a time, plus those whose puts are under way.
    """

    def __init__(self, pin: bool | None = None, keep: int = 2):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0                  # buffers made so far (a reuse makes none)

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes (the smallest kept one that fits, else a
        new one); its contents are undefined. Give it back with :meth:`give`."""
        with self._lock:
            fits = [b for b in self._free if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=torch.Tensor.numel)
                self._free.remove(buf)
                return buf
            self.allocated += 1
        size = -(-max(nbytes, 1) // ALLOC_GRANULE_BYTES) * ALLOC_GRANULE_BYTES
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        """Return ``buf`` for reuse; the caller no longer touches it (nor do its copies)."""
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            del self._free[self._keep:]


def rows(buf: torch.Tensor, n: int, object_bytes: int) -> torch.Tensor:
    """``buf``'s first ``n * object_bytes`` bytes as ``[n, object_bytes]``: row ``i`` is
    block ``i``'s object (a contiguous CPU tensor the SDK reads or fills in place)."""
    return buf[:n * object_bytes].view(n, object_bytes)


def copy_between(host: torch.Tensor, device: torch.Tensor, *, to_host: bool,
                 pinned: bool) -> bool:
    """Copy one layer's block slice between ``device`` (any device, any strides) and
    ``host`` (its bytes in a row of a staging buffer), in the direction ``to_host``.

    Returns:
        True when the copy was issued asynchronously (pinned host memory and a CUDA
        tensor): wait with :func:`copies_done` before the host bytes are read or reused.

    Raises:
        RuntimeError: the sizes differ, or the bytes cannot hold ``device``'s dtype.
    """
    typed = host.view(device.dtype).view(device.shape)
    non_blocking = pinned and device.is_cuda
    if to_host:
        typed.copy_(device, non_blocking=non_blocking)
    else:
        device.copy_(typed, non_blocking=non_blocking)
    return non_blocking


def copies_done():
    """An event recorded after the copies issued so far on the current CUDA stream;
    ``.synchronize()`` waits for them. Only for asynchronous copies (:func:`copy_between`
    returned True)."""
    event = torch.cuda.Event()
    event.record()
    return event


@dataclass
class StagedSave:
    """One step's blocks to save, their objects staged as the rows of one host buffer
    (plan by plan, block by block)."""

    plans: list                         # the step's plans (connector._ReqPlan) with save blocks
    buf: torch.Tensor | None = None     # from HostBuffers; given back once the put is done
    objects: torch.Tensor | None = None  # [blocks, object_bytes] uint8 view of buf
    layers: set[str] = field(default_factory=set)   # layers copied in so far
    pending: bool = False               # asynchronous (CUDA) copies were issued
    error: BaseException | None = None  # a copy failed: nothing of this step is saved

    @property
    def num_blocks(self) -> int:
        return sum(len(p.save_blocks) for p in self.plans)
