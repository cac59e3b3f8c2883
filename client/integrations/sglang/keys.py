"""Key namespacing for the SGLang HiCache backend, free of any SGLang or torch import.

SGLang names a page by its own hash: SHA-256 chained over the page's token
ids (4-byte little-endian), seeded by the previous page's hash and, for a
request with an ``extra_key`` or ``cache_salt``, by a seed of those
(``sglang.srt.mem_cache.utils.get_storage_hash_str``): the hash says which
tokens, and the request's own isolation, but not whose KV it is. Everything
else that decides a page's bytes goes into a kvstore :class:`Namespace`: the
model and its revision, the KV dtype and the host pool's layout (which
decides how a page's bytes are ordered), the layer count, heads and head
size, the page size, the tensor-parallel rank and size (MLA: rank 0 of 1,
since every rank holds the same latent KV), the pipeline and context-parallel
shard, and the deployment's tenant and salt. A page part's key is::

    sglang/<namespace id, 32 hex>/<SGLang page hash>_<part>
    @<tenant>/sglang/<namespace id>/<SGLang page hash>_<part>     (with a tenant)

with ``part`` ``k`` or ``v`` (an MHA page's K and V halves: two objects, each
one contiguous range of the host pool), ``k`` alone for MLA, or ``page`` (the
legacy, non-zero-copy interface's flat page). The namespace id leads, so two
models (or tenants, salts, TP layouts) never share a key, and one
deployment's keys share a prefix that ``list`` can find (``clear``). With a
``tenant`` the keys are that tenant's (:mod:`kvstore.tenants`): a store with
``--auth`` lets only tokens bound to it read them. Pure functions: no
``hash()``, no process state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvstore.keys import Namespace
from kvstore.tenants import tenant_key

KEY_PREFIX = "sglang/"
#: Part names of one page's objects.
MHA_PARTS = ("k", "v")
MLA_PARTS = ("k",)
FLAT_PART = "page"


@dataclass(frozen=True, slots=True)
class StorageIdentity:
    """What one SGLang rank's storage backend contributes to its keys.

    Attributes:
        model: SGLang's ``model_name`` ("" when SGLang gave none).
        page_size: tokens per page.
        tp_rank, tp_size: this rank's tensor-parallel place (ignored for MLA).
        is_mla: MLA (or another rank-replicated cache): one copy for all ranks.
        pp_rank, pp_size: the pipeline stage (its layers only are in a page).
        cp_rank, cp_size: the attention context-parallel shard.
        kv_dtype: element type of the host pool (``"bfloat16"``...; "" before
            the pool is registered).
        layout: the host pool's layout (``"page_first"``...; "" before).
        num_layers, num_kv_heads, head_dim: the host pool's geometry (0 before).
        revision, tenant, salt: from the backend's extra config.
    """

    model: str
    page_size: int
    tp_rank: int = 0
    tp_size: int = 1
    is_mla: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    kv_dtype: str = ""
    layout: str = ""
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    revision: str = ""
    tenant: str = ""
    salt: str = ""

    @property
    def parts(self) -> tuple[str, ...]:
        """The objects of one page in the zero-copy interface: K and V, or MLA's one."""
        return MLA_PARTS if self.is_mla else MHA_PARTS

    def namespace(self) -> Namespace:
        """The kvstore namespace of this rank's pages."""
        tp_rank, tp_size = (0, 1) if self.is_mla else (self.tp_rank, self.tp_size)
        shard = f"pp{self.pp_rank}/{self.pp_size};cp{self.cp_rank}/{self.cp_size}"
        return Namespace(model=self.model, revision=self.revision,
                         kv_dtype=f"{self.kv_dtype};sglang-{self.layout or 'unregistered'};"
                                  f"{'mla' if self.is_mla else 'mha'};{shard}",
                         num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, block_tokens=self.page_size,
                         tp_rank=tp_rank, tp_size=tp_size, tenant=self.tenant, salt=self.salt)

    def key_prefix(self) -> str:
        """``sglang/<namespace id>/`` (``@<tenant>/sglang/...`` with a tenant): the prefix
        every key of this identity starts with."""
        head = f"{KEY_PREFIX}{self.namespace().id().hex()}/"
        return tenant_key(self.tenant, head) if self.tenant else head


def page_keys(identity: StorageIdentity, page_hashes: Sequence[str],
              parts: Sequence[str] | None = None) -> list[str]:
    """Store keys of each page's parts, page-major: ``[p0_k, p0_v, p1_k, p1_v, ...]``.

    Args:
        page_hashes: SGLang's page hashes (as its ``batch_*`` calls pass them).
        parts: the part names (default: ``identity.parts``).
    """
    prefix = identity.key_prefix()
    parts = identity.parts if parts is None else parts
    return [f"{prefix}{h}_{p}" for h in page_hashes for p in parts]


def leading_pages(present: Sequence[bool], parts_per_page: int) -> int:
    """Pages from the start whose every part is present (a prefix is usable only up
    to its first hole); ``present`` is page-major as :func:`page_keys` orders it."""
    n = 0
    for i in range(0, len(present) - parts_per_page + 1, parts_per_page):
        if not all(present[i:i + parts_per_page]):
            break
        n += 1
    return n
