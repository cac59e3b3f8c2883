"""Zero-copy views of a host pool's pages (no SGLang needed: a pool with the
contract of SGLang's ``get_page_buffer_meta``): the views are the pool's own
memory, every piece is bounds-checked, a layout with a piece per layer is refused."""

import pytest
import torch

from kvstore.client.integrations.sglang.pool import PoolPages, UnsupportedPool

PAGE, LAYERS, HEADS, DIM, TOKENS = 4, 2, 2, 8, 32


class Pool:
    """page_first (K then V per page) or layer_first (a piece per layer and K/V)."""

    def __init__(self, layout="page_first", dtype=torch.bfloat16, shift=0):
        self.page_size, self.layout, self.dtype = PAGE, layout, dtype
        self.kv_buffer = torch.zeros(2, TOKENS, LAYERS, HEADS, DIM, dtype=dtype)
        self.token = LAYERS * HEADS * DIM * dtype.itemsize
        self.shift = shift                     # a wrong pointer, for the bounds check

    def get_page_buffer_meta(self, indices):
        base, ptrs = self.kv_buffer.data_ptr() + self.shift, []
        v = TOKENS * self.token
        for first in indices.tolist()[::PAGE]:
            k = base + first * self.token
            if self.layout == "page_first":
                ptrs += [k, k + v]
            else:
                ptrs += [p for layer in range(LAYERS) for p in (k + layer, k + layer + v)]
        size = PAGE * self.token // (1 if self.layout == "page_first" else LAYERS)
        return ptrs, [size] * len(ptrs)


def _indices(*pages):
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE) for p in pages])


def test_views_are_the_pools_memory():
    pool = Pool()
    pages = PoolPages(pool, 2)
    views = pages.views(_indices(3, 1), 2)
    assert [len(v) for v in views] == [PAGE * pool.token] * 4
    views[0][:] = b"\x01" * len(views[0])            # page 3's K
    views[3][:] = b"\x02" * len(views[3])            # page 1's V
    raw = pool.kv_buffer.view(torch.uint8)
    assert bool((raw[0, 3 * PAGE:4 * PAGE] == 1).all()) and int(raw[0].sum()) == len(views[0])
    assert bool((raw[1, PAGE:2 * PAGE] == 2).all()) and int(raw[1].sum()) == 2 * len(views[3])


def test_a_piece_outside_the_buffer_is_an_error_not_a_write():
    pages = PoolPages(Pool(), 2)
    pages.pool.shift = 1 << 20
    with pytest.raises(ValueError, match="outside"):
        pages.views(_indices(0), 1)


def test_indices_must_cover_whole_pages():
    pages = PoolPages(Pool(), 2)
    with pytest.raises(ValueError, match="host indices"):
        pages.views(_indices(0)[:-1], 1)


def test_a_piece_per_layer_is_refused_naming_the_layout_to_use():
    with pytest.raises(UnsupportedPool, match="page_first"):
        PoolPages(Pool("layer_first"), 2)


def test_a_pool_without_one_cpu_buffer_is_refused():
    pool = Pool()
    pool.kv_buffer = [pool.kv_buffer]
    with pytest.raises(UnsupportedPool, match="kv_buffer"):
        PoolPages(pool, 2)
