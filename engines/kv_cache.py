"""Paged KV cache: one tensor of pages, a free-list allocator, block tables.

Layout (float32 by default)::

    data : [num_pages, num_layers, 2, page_tokens, num_kv_heads, head_dim]
             |          |          |
             |          |          +-- 0 = K, 1 = V
             |          +-- data[p, l] is one layer of page p (contiguous)
             +-- data[p] is page p (contiguous) == one store object
                 [num_layers, 2, block_tokens, num_kv_heads, head_dim]

    Sequence.page_ids = [p0, p1, p2]      (the block table)
    token t lives in page page_ids[t // page_tokens], slot t % page_tokens
    tokens [0, num_computed) have their KV written; later slots are garbage-free
    zeros until written (pages are zeroed when allocated)

``page_tokens`` equals the store's ``block_tokens``, so block ``i`` of a prompt
is page ``page_ids[i]`` byte for byte, and the store SDK reads and writes
``cache.page(p)`` in place with no copy.

Contract, by side:

* Scheduler side (the engine's request loop): :meth:`PagedKVCache.try_reserve`
  / :meth:`~PagedKVCache.reserve` grow a sequence's block table before the
  model runs (running out is ``False`` / :class:`OutOfPages`, never a crash);
  :meth:`~PagedKVCache.free` returns the pages when the request ends. Pages
  filled from the store are declared with :meth:`~PagedKVCache.mark_computed`.
* Model side (:mod:`kvstore.engines.model`): :meth:`~PagedKVCache.write_kv` and
  :meth:`~PagedKVCache.gather_kv`; the model advances ``seq.num_computed``.

Thread safety: none. One worker thread owns a cache and every sequence in it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvstore.errors import NoSpace

if TYPE_CHECKING:
    from kvstore.client.models import ModelConfig

logger = logging.getLogger(__name__)

#: Default tokens per page; equals the store's default ``block_tokens``.
DEFAULT_PAGE_TOKENS = 16


class OutOfPages(NoSpace):
    """Not enough free pages for a reservation; nothing was allocated (the
    engine's own :class:`~kvstore.errors.NoSpace`).

    Attributes:
        needed_pages: pages the reservation asked for on top of what the
            sequence holds.
        free_pages: pages free at the time.
        total_pages: pages in the cache.
    """

    def __init__(self, needed_pages: int, free_pages: int, total_pages: int):
        super().__init__(f"need {needed_pages} KV pages, {free_pages} of {total_pages} free")
        self.needed_pages = needed_pages
        self.free_pages = free_pages
        self.total_pages = total_pages


@dataclass(slots=True)
class Sequence:
    """One request's view of the cache: its block table and progress.

    Attributes:
        seq_id: the request id, for logs only.
        page_ids: block table; ``page_ids[b]`` holds tokens
            ``[b * page_tokens, (b + 1) * page_tokens)``.
        num_computed: tokens whose KV is in the pages (positions
            ``0 .. num_computed - 1``); the next token goes at this position.
    """

    seq_id: str = ""
    page_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


class PageAllocator:
    """Free list of page ids; all-or-nothing allocation.

    Pages come out in ascending id order from a fresh allocator, which keeps
    test runs easy to read; nothing depends on the order.
    """

    __slots__ = ("num_pages", "_free", "_in_use")

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() takes the lowest
        self._in_use = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        """Pages not allocated."""
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take ``n`` pages, or none at all.

        Returns:
            The page ids, or ``None`` when fewer than ``n`` are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._in_use[p] = 1
        return out

    def release(self, page_ids: list[int]) -> None:
        """Give pages back. Releasing a page that is not in use is a bug."""
        for p in page_ids:
            if not self._in_use[p]:
                raise RuntimeError(f"page {p} released but not in use (double free)")
            self._in_use[p] = 0
            self._free.append(p)


class PagedKVCache:
    """The KV pages of one model replica and their allocator.

    Args:
        num_pages: pages to allocate up front.
        num_layers, num_kv_heads, head_dim: KV layout of the model.
        page_tokens: tokens per page (== the store's ``block_tokens``).
        dtype: element type of the KV (the model computes in float32).
        device: where the pages live.
    """

    def __init__(self, num_pages: int, num_layers: int, num_kv_heads: int, head_dim: int,
                 page_tokens: int = DEFAULT_PAGE_TOKENS, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        if page_tokens <= 0:
            raise ValueError(f"page_tokens must be positive, got {page_tokens}")
        self.page_tokens = page_tokens
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.allocator = PageAllocator(num_pages)
        self.page_shape = (num_layers, 2, page_tokens, num_kv_heads, head_dim)
        self.data = torch.zeros((num_pages, *self.page_shape), dtype=dtype, device=device)
        logger.info("KV cache: %d pages x %d tokens, %.1f MiB (%d bytes per page)",
                    num_pages, page_tokens, self.data.nbytes / 2**20, self.page_nbytes)

    @classmethod
    def for_model(cls, cfg: "ModelConfig", num_pages: int,
                  page_tokens: int = DEFAULT_PAGE_TOKENS) -> "PagedKVCache":
        """A float32 CPU cache shaped for ``cfg``."""
        return cls(num_pages, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_tokens)

    # -- geometry ----------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page (== one store object)."""
        return self.data[0].nbytes

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_tokens)

    def capacity(self, seq: Sequence) -> int:
        """Tokens the sequence's pages can hold."""
        return len(seq.page_ids) * self.page_tokens

    def page(self, page_id: int) -> torch.Tensor:
        """Page ``page_id`` as a contiguous view.

        Returns:
            ``[num_layers, 2, page_tokens, num_kv_heads, head_dim]``, the cache's
            dtype; writes into it land in the cache.
        """
        return self.data[page_id]

    # -- scheduler side ----------------------------------------------------

    def try_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens.

        New pages are zeroed, so a partly filled page has the same bytes
        whatever the page held before.

        Returns:
            ``True`` when the pages are there; ``False`` (nothing changed) when
            too few pages are free.
        """
        extra = self.pages_for(num_tokens) - len(seq.page_ids)
        if extra <= 0:
            return True
        got = self.allocator.allocate(extra)
        if got is None:
            return False
        self.data[got] = 0
        seq.page_ids.extend(got)
        return True

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Like :meth:`try_reserve`, but raises.

        Raises:
            OutOfPages: too few free pages; nothing was allocated.
        """
        if not self.try_reserve(seq, num_tokens):
            raise OutOfPages(self.pages_for(num_tokens) - len(seq.page_ids),
                             self.num_free_pages, self.num_pages)

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s pages and reset it to empty."""
        self.allocator.release(seq.page_ids)
        seq.page_ids = []
        seq.num_computed = 0

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Declare that the KV of tokens ``[0, num_tokens)`` is in ``seq``'s pages.

        Used after filling pages from outside (the store). Prefill continues
        from here; for bit-identical results with an uncached run, prefill
        needs ``num_tokens`` to be a multiple of ``page_tokens``.

        Raises:
            ValueError: the pages cannot hold ``num_tokens`` tokens.
        """
        if not 0 <= num_tokens <= self.capacity(seq):
            raise ValueError(f"{seq.seq_id}: {num_tokens} tokens computed but pages hold "
                             f"{self.capacity(seq)}")
        seq.num_computed = num_tokens

    # -- model side --------------------------------------------------------

    def write_kv(self, seq: Sequence, layer: int, start: int,
                 k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K and V of tokens ``[start, start + T)`` of one layer.

        Args:
            k, v: ``[T, num_kv_heads, head_dim]``, the cache's dtype.
        """
        end = start + k.shape[0]
        if end > self.capacity(seq):
            raise ValueError(f"{seq.seq_id}: writing tokens up to {end}, pages hold "
                             f"{self.capacity(seq)}")
        pos = start
        while pos < end:
            page, slot = divmod(pos, self.page_tokens)
            n = min(self.page_tokens - slot, end - pos)
            kv = self.data[seq.page_ids[page], layer]
            kv[0, slot:slot + n] = k[pos - start:pos - start + n]
            kv[1, slot:slot + n] = v[pos - start:pos - start + n]
            pos += n

    def gather_kv(self, seq: Sequence, layer: int,
                  num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens ``[0, num_tokens)`` of one layer, as new tensors.

        Returns:
            ``(k, v)``, each ``[num_tokens, num_kv_heads, head_dim]``.
        """
        n_pages = self.pages_for(num_tokens)
        ids = torch.tensor(seq.page_ids[:n_pages], dtype=torch.long)
        kv = self.data[ids, layer]  # [n_pages, 2, page_tokens, kvh, hd]
        flat = kv.transpose(0, 1).reshape(2, n_pages * self.page_tokens,
                                           self.num_kv_heads, self.head_dim)
        return flat[0, :num_tokens], flat[1, :num_tokens]
