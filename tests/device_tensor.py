"""A stand-in for a GPU tensor on a machine without one.

:class:`DeviceTensor` wraps a CPU tensor and reports the ``meta`` device. As
with a CUDA tensor, Python code cannot reach its memory directly (``.numpy()``
raises, there is no host pointer), while torch's own operations work on it,
through ``__torch_dispatch__`` on the wrapped tensor: indexing and views (which
stay DeviceTensors sharing the memory), and ``copy_`` in both directions, the
host-device copies. Code that moves KV blocks with ``copy_`` works on it as it
does on CUDA; code that assumes host memory fails as it does on CUDA.

Importable from every test module as ``device_tensor`` (pytest puts ``tests/``
on ``sys.path``).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map


class DeviceTensor(torch.Tensor):
    """A tensor whose data lives off the host as far as Python can tell (see the module doc).

    Args:
        elem: the CPU tensor holding the data (shared, not copied).
    """

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        if isinstance(elem, DeviceTensor):
            return elem
        t = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, device="meta", requires_grad=False)
        t.elem = elem
        return t

    def __repr__(self) -> str:
        return f"DeviceTensor({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.elem if isinstance(x, DeviceTensor) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        schema = func._schema
        if schema.arguments and schema.arguments[0].alias_info is not None \
                and schema.arguments[0].alias_info.is_write:
            return args[0]          # in place (copy_, fill_, ...): the tensor written to
        # Wrappers are made outside inference mode (vLLM runs in it): a view of a
        # normal tensor must be a normal tensor, whose version counter torch shares.
        with torch.inference_mode(False):
            return tree_map(lambda x: cls(x) if isinstance(x, torch.Tensor) else x, out)


def on_device(t: torch.Tensor) -> DeviceTensor:
    """``t``'s memory seen as a device tensor (writes through either one show in both)."""
    return DeviceTensor(t)
