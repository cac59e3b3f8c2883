"""Byte views over the values and destinations transports accept, without copies.

Accepted: ``bytes``, ``bytearray``, ``memoryview``, C-contiguous numpy arrays
and C-contiguous CPU torch tensors (any dtype, bfloat16 included). Torch is
imported only when a tensor is passed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.errors import InvalidArgument


def _is_tensor(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage")


def tensor_bytes_view(t) -> memoryview:
    """1-D byte view of a contiguous CPU tensor (shares its memory)."""
    if t.device.type != "cpu":
        raise InvalidArgument(f"tensor is on {t.device}; only CPU tensors go through the "
                              "TCP / shared-memory paths")
    if not t.is_contiguous():
        raise InvalidArgument("tensor must be contiguous (call .contiguous() first)")
    import torch

    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def readable_view(value: Any) -> memoryview:
    """A 1-D unsigned-byte view of ``value``.

    Raises:
        InvalidArgument: an unsupported type, or a non-contiguous array/tensor.
    """
    if isinstance(value, (bytes, bytearray)):
        return memoryview(value)
    if isinstance(value, memoryview):
        if not value.c_contiguous:
            raise InvalidArgument("memoryview must be C-contiguous")
        return value.cast("B") if value.format != "B" or value.ndim != 1 else value
    if isinstance(value, np.ndarray):
        if not value.flags.c_contiguous:
            raise InvalidArgument("numpy array must be C-contiguous (np.ascontiguousarray)")
        return memoryview(value.reshape(-1).view(np.uint8))
    if _is_tensor(value):
        return tensor_bytes_view(value)
    raise InvalidArgument(f"value must be bytes, bytearray, memoryview, numpy array or torch "
                          f"tensor, got {type(value).__name__}")


def writable_view(dest: Any) -> memoryview:
    """A writable 1-D unsigned-byte view of ``dest`` (the caller's memory).

    Raises:
        InvalidArgument: read-only or unsupported destination.
    """
    view = readable_view(dest)
    if view.readonly:
        raise InvalidArgument("destination is read-only")
    return view
