"""Paged KV cache: allocator, block tables, page views."""

from __future__ import annotations

import pytest
import torch

from kvstore.client.models import ModelConfig
from kvstore.engines.kv_cache import OutOfPages, PageAllocator, PagedKVCache, Sequence


def _cache(num_pages: int = 4) -> PagedKVCache:
    return PagedKVCache.for_model(ModelConfig.tiny(), num_pages, page_tokens=16)


def test_page_is_a_contiguous_store_object():
    cache = _cache()
    page = cache.page(2)
    assert page.shape == (4, 2, 16, 2, 32) and page.is_contiguous()
    assert cache.page_nbytes == 4 * 2 * 16 * 2 * 32 * 4
    page.copy_(torch.full(page.shape, 7.0))  # writes land in the cache (zero copy)
    assert torch.all(cache.data[2] == 7.0) and torch.all(cache.data[1] == 0.0)


def test_allocator_all_or_nothing_and_double_free():
    alloc = PageAllocator(3)
    assert alloc.allocate(2) == [0, 1]
    assert alloc.allocate(2) is None and alloc.num_free == 1
    alloc.release([0])
    assert sorted(alloc.allocate(2)) == [0, 2]
    with pytest.raises(RuntimeError, match="double free"):
        alloc.release([1, 1])


def test_reserve_grows_block_table_and_reports_shortage():
    cache = _cache(4)
    a, b = Sequence("a"), Sequence("b")
    assert cache.try_reserve(a, 17) and a.page_ids == [0, 1]
    assert cache.try_reserve(a, 32) and a.page_ids == [0, 1]  # already enough
    assert not cache.try_reserve(b, 48) and b.page_ids == []
    with pytest.raises(OutOfPages) as err:
        cache.reserve(b, 48)
    assert (err.value.needed_pages, err.value.free_pages, err.value.total_pages) == (3, 2, 4)
    cache.free(a)
    assert a.page_ids == [] and cache.num_free_pages == 4


def test_reused_pages_are_zeroed():
    cache = _cache(2)
    a = Sequence("a")
    cache.reserve(a, 16)
    cache.page(a.page_ids[0]).fill_(3.0)
    cache.free(a)
    b = Sequence("b")
    cache.reserve(b, 32)
    assert torch.all(cache.data == 0.0)


def test_write_and_gather_across_pages():
    cache = PagedKVCache(num_pages=6, num_layers=2, num_kv_heads=1, head_dim=2, page_tokens=4)
    seq = Sequence("s")
    filler = Sequence("f")
    cache.reserve(filler, 4)  # so seq's pages are not 0..n
    cache.reserve(seq, 10)
    k = torch.arange(20.0).view(10, 1, 2)
    cache.write_kv(seq, 1, 0, k[:3], -k[:3])
    cache.write_kv(seq, 1, 3, k[3:10], -k[3:10])  # spans three pages
    kg, vg = cache.gather_kv(seq, 1, 10)
    assert torch.equal(kg, k) and torch.equal(vg, -k)
    assert torch.all(cache.data[:, 0] == 0) and torch.all(cache.page(filler.page_ids[0]) == 0)
    with pytest.raises(ValueError):
        cache.write_kv(seq, 0, 10, k[:3], k[:3])
    with pytest.raises(ValueError):
        cache.mark_computed(seq, 13)
