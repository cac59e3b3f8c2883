"""Zero-copy views of the pages of SGLang's registered host KV pool.

SGLang's host pool (``HostKVCache``) says where a page's bytes lie with
``get_page_buffer_meta(host_indices) -> (pointers, sizes)``: for each page,
in order, one (pointer, size) per contiguous piece -- K then V for MHA in the
``page_first``, ``page_first_direct`` and ``page_head`` layouts, one piece for
MLA. :class:`PoolPages` turns each piece into a ``memoryview`` slice of one
view over the pool's whole ``kv_buffer`` (made once, at registration), so the
SDK reads a page straight into the pool and writes it straight from there: no
per-page Python copy, no ctypes. Every pointer is checked to lie inside the
buffer before it is used: a pointer SGLang computed wrong is an error, never
a write outside the pool.

Layouts whose pages are not one piece per part (``layer_first``: one piece
per layer) are refused at registration, as Mooncake's backend refuses them
for MHA; SGLang's default layout is ``page_first``.
"""

from __future__ import annotations

from typing import Any

import torch


class UnsupportedPool(ValueError):
    """The host pool's memory or layout cannot be served zero-copy."""


class PoolPages:
    """Views of one host pool's page parts.

    Args:
        pool: SGLang's host pool (``kv_buffer``: one contiguous CPU tensor;
            ``page_size``; ``get_page_buffer_meta``).
        parts_per_page: pieces each page must give (2 for MHA's K and V, 1 for MLA).

    Raises:
        UnsupportedPool: ``kv_buffer`` is not one contiguous CPU tensor, or a
            page does not come as ``parts_per_page`` pieces.
    """

    def __init__(self, pool: Any, parts_per_page: int):
        buf = getattr(pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor):
            raise UnsupportedPool(f"host pool {type(pool).__name__} has no single kv_buffer "
                                  f"tensor (got {type(buf).__name__})")
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise UnsupportedPool(f"host pool kv_buffer must be a contiguous CPU tensor "
                                  f"(device {buf.device}, contiguous {buf.is_contiguous()})")
        self.pool = pool
        self.page_size = int(pool.page_size)
        self.parts_per_page = parts_per_page
        self._buf = buf                                  # keeps the memory alive
        self._base = buf.data_ptr()
        flat = buf.reshape(-1).view(torch.uint8)         # any dtype (bfloat16 too), no copy
        self._view = memoryview(flat.numpy())
        self.nbytes = len(self._view)
        first = torch.arange(self.page_size, dtype=torch.int64)
        ptrs, _sizes = pool.get_page_buffer_meta(first)
        if len(ptrs) != parts_per_page or not all(isinstance(p, int) for p in ptrs):
            raise UnsupportedPool(
                f"host pool layout {getattr(pool, 'layout', '?')!r} gives {len(ptrs)} pieces "
                f"per page, not {parts_per_page}: start SGLang with --hicache-mem-layout "
                "page_first (or page_first_direct, page_head)")

    def views(self, host_indices: Any, num_pages: int) -> list[memoryview]:
        """Each page's parts, page-major, as writable views into the pool.

        Args:
            host_indices: the pool's token slots of ``num_pages`` whole pages
                (a 1-D tensor, ``num_pages * page_size`` long), as SGLang passes them.
            num_pages: how many pages (SGLang's key count).

        Raises:
            ValueError: ``host_indices`` does not cover ``num_pages`` pages, or
                a piece lies outside the pool's buffer.
        """
        if len(host_indices) != num_pages * self.page_size:
            raise ValueError(f"{len(host_indices)} host indices for {num_pages} pages of "
                             f"{self.page_size} tokens")
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if len(ptrs) != num_pages * self.parts_per_page or len(sizes) != len(ptrs):
            raise ValueError(f"the pool gave {len(ptrs)} pieces for {num_pages} pages")
        out = []
        for ptr, size in zip(ptrs, sizes):
            offset = ptr - self._base
            if offset < 0 or size <= 0 or offset + size > self.nbytes:
                raise ValueError(f"page piece at offset {offset} of {size} B lies outside "
                                 f"the host pool's {self.nbytes} B")
            out.append(self._view[offset:offset + size])
        return out
