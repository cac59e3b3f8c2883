"""GPU tier: one device buffer (torch.cuda) with our own offset allocator.

    device buffer  uint8[capacity_bytes] on cuda:N
                   | obj A |  free  | obj B |      free      |
    each object = one Allocation, exactly as in the DRAM tier

Same placement and accounting as :class:`~kvstore.store.tiers.dram.DramTier`;
only the byte movement differs: the buffer is not host-addressable, so
``view`` is None and bytes move with host<->device copies (``write_many``,
``read_into``), each batch synchronised before it returns.

Where it sits in a node's chain: below DRAM (``DRAM -> GPU -> SSD``). Every
transport this store has (TCP frames, same-host shared memory) reads and
writes host memory, so DRAM stays the tier that serves reads and takes
writes; device memory is a second memory tier that DRAM victims fall to
before the SSD, and hits there are promoted back to DRAM like SSD hits.
A GPU-direct transport would make it a serving tier of its own.

Thread safety: accounting under the node's lock (see ``base``); copies may
run from any thread (torch serialises them on the device's stream).
"""

from __future__ import annotations

import warnings

from kvstore.store.allocator import Allocation
from kvstore.store.tiers.base import OffsetTier, TierIOError
from kvstore.types import TierKind


def cuda_available() -> bool:
    """True when torch sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


class GpuTier(OffsetTier):
    """Objects in one CUDA device buffer.

    Args:
        capacity_bytes: bytes of device memory to take (allocated up front).
        device: torch device string, e.g. ``"cuda"`` or ``"cuda:1"``. ``"cpu"``
            runs the same code on a host buffer (to test the tier without CUDA).

    Raises:
        RuntimeError: no CUDA device, or the device cannot hold ``capacity_bytes``
            (the message carries the device's free and total memory).
    """

    kind = TierKind.GPU

    def __init__(self, capacity_bytes: int, device: str = "cuda"):
        import torch

        super().__init__(capacity_bytes)
        self._torch = torch
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("GPU tier requested but torch sees no CUDA device")
            free, total = torch.cuda.mem_get_info(self.device)
            if capacity_bytes > free:
                raise RuntimeError(f"GPU tier of {capacity_bytes} B does not fit {self.device}: "
                                   f"{free} B free of {total} B")
        self.buffer = torch.empty(max(capacity_bytes, 1), dtype=torch.uint8, device=self.device)

    def _host(self, view: memoryview):
        """A uint8 CPU tensor over ``view`` (no copy; read-only buffers are only read)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # "buffer is not writable"
            return self._torch.frombuffer(view, dtype=self._torch.uint8)

    def write_many(self, items: list[tuple[Allocation, memoryview]]) -> None:
        """Host-to-device copies, synchronised before returning.

        Raises:
            TierIOError: the device failed.
        """
        try:
            for extent, src in items:
                if extent.size_bytes:
                    self.buffer[extent.offset:extent.offset + extent.size_bytes].copy_(
                        self._host(src[:extent.size_bytes]))
            self._sync()
        except RuntimeError as exc:
            raise TierIOError(f"GPU write failed: {exc}") from exc

    def read_into(self, extent: Allocation, dest: memoryview) -> None:
        """Device-to-host copy into ``dest[:extent.size_bytes]``, synchronised.

        Raises:
            TierIOError: the device failed.
        """
        if not extent.size_bytes:
            return
        try:
            self._host(dest[:extent.size_bytes]).copy_(
                self.buffer[extent.offset:extent.offset + extent.size_bytes])
            self._sync()
        except RuntimeError as exc:
            raise TierIOError(f"GPU read failed: {exc}") from exc

    def _sync(self) -> None:
        # Copies from pageable host memory may return before the DMA is done:
        # a batch counts as written only once the device has finished it.
        if self._cuda:
            self._torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.buffer = None
