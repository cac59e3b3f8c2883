"""One SGLang process for the HiCache backend tests (SGLang's interpreter; see
tools/cluster/sglang_env.py).

    python sglang_run.py MODE MASTER OUT_JSON

Builds ``KVStoreHiCacheStorage`` the way SGLang's HiCacheController does:
``StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(...,
extra_config=<--hicache-storage-backend-extra-config>), pool)``, then
``register_mem_pool_host(pool)``, for four ranks of two deployments: an MHA
model at TP 2 (ranks 0 and 1) and an MLA model at TP 2 (ranks 0 and 1).

The host pool is :class:`CpuHostPool` (below), not SGLang's
``MHATokenToKVPoolHost``: SGLang's pools import its model configs, which
import transformers and torchvision, and PyPI's torchvision fails on the CPU
torch (tools/cluster/sglang_env.py). It has the attributes and the one method
the backend uses, with SGLang's ``page_first`` layout: ``kv_buffer``
``[2, size, layers, heads, head_dim]`` (MHA; K then V) or ``[size, layers,
1, dim]`` (MLA), and ``get_page_buffer_meta`` giving each page's K and V
(MHA) or its one piece (MLA) as (pointer, size).

Modes (what each writes to OUT_JSON, besides ``hashes``: SGLang's own page
hashes of tokens 1..10 at page size 4, and ``keys``: their kvstore keys per rank):

- ``set``: fills each rank's pool with bytes that are a function of (page
  hash, rank, deployment) and ``batch_set_v1``s the first SET_PAGES pages of
  TOKENS (twice: the second call finds them stored), and ``batch_set``s two
  flat pages (the legacy interface); ``results``, ``again``, ``legacy``, ``stats``.
- ``get``: ``batch_exists`` per rank over all pages; ``batch_get_v1`` of
  SET_PAGES pages into other pool slots and a byte compare with the bytes
  ``set`` wrote; the flat pages back through ``batch_get`` and ``get``;
  ``exists`` of a stored and an unstored page; ``exists``, ``read``, ``exact``,
  ``legacy_exact``, ``legacy_fresh``, ``exists_one``, ``stats``.
- ``dead``: (the node is gone) ``batch_exists``, ``batch_get_v1`` and
  ``batch_set_v1`` per rank, and the same of a backend whose master does not
  exist (``down``); no exception may escape; ``exists``, ``read``, ``written``.
- ``clear`` (MHA rank 0 only): writes a page under another tenant, checks the
  first tenant does not see it, ``clear()``s the other tenant; ``other_before``,
  ``first_tenant``, ``cleared``, ``other_after``, ``first_tenant_kept``.
"""

import json
import sys

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

PAGE = 4
TOKENS = [(i * 37 + 11) % 30000 for i in range(48)]       # 12 pages
SET_PAGES = 8
LAYERS, HEADS, HEAD_DIM, MLA_DIM = 3, 2, 16, 40
POOL_TOKENS = 32 * PAGE


class CpuHostPool:
    """A host pool over CPU tensors in SGLang's page_first layout (see the module doc)."""

    def __init__(self, mla: bool, dtype=torch.bfloat16):
        self.page_size, self.layout, self.dtype, self.layer_num = PAGE, "page_first", dtype, LAYERS
        self.size = POOL_TOKENS
        if mla:
            self.head_num, self.head_dim = 1, MLA_DIM
            self.kv_buffer = torch.zeros(POOL_TOKENS, LAYERS, 1, MLA_DIM, dtype=dtype)
        else:
            self.head_num, self.head_dim = HEADS, HEAD_DIM
            self.kv_buffer = torch.zeros(2, POOL_TOKENS, LAYERS, HEADS, HEAD_DIM, dtype=dtype)
        self.mla = mla
        self.token_bytes = LAYERS * self.head_num * self.head_dim * dtype.itemsize

    def get_page_buffer_meta(self, indices):
        base, out = self.kv_buffer.data_ptr(), []
        v_offset = POOL_TOKENS * self.token_bytes
        for first in indices.tolist()[::PAGE]:
            k = base + first * self.token_bytes
            out += [k] if self.mla else [k, k + v_offset]
        return out, [PAGE * self.token_bytes] * len(out)

    def page(self, slot: int) -> torch.Tensor:
        """The bytes of the page at pool slot ``slot`` (a page index), K and V, as uint8."""
        parts = self.kv_buffer.view(torch.uint8).reshape(1 if self.mla else 2, -1)
        n = PAGE * self.token_bytes
        return parts[:, slot * n:(slot + 1) * n].clone()


def backend(master: str, mla: bool, tp_rank: int, **extra):
    cfg = HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=True,
        model_name="org/tiny-mla" if mla else "org/tiny-mha",
        extra_config={"backend_name": "kvstore",
                      "module_path": "kvstore.client.integrations.sglang.backend",
                      "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
                      "master": master, "tenant": "t1", "timeout_s": 2.0, **extra})
    pool = CpuHostPool(mla)
    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    return b, pool


def page_bytes(h: str, rank: int, mla: bool, nbytes: int) -> torch.Tensor:
    """Deterministic page content for (hash, rank, deployment)."""
    g = torch.Generator().manual_seed(int(h[:12], 16) ^ (rank << 1) ^ int(mla))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def fill(pool: CpuHostPool, slots, hashes, rank: int) -> None:
    n = PAGE * pool.token_bytes
    parts = pool.kv_buffer.view(torch.uint8).reshape(1 if pool.mla else 2, -1)
    for slot, h in zip(slots, hashes):
        data = page_bytes(h, rank, pool.mla, n * parts.shape[0]).reshape(parts.shape[0], n)
        parts[:, slot * n:(slot + 1) * n] = data


def indices(slots) -> torch.Tensor:
    return torch.cat([torch.arange(s * PAGE, (s + 1) * PAGE) for s in slots])


RANKS = [(False, 0), (False, 1), (True, 0), (True, 1)]
LEGACY = [f"{i:064x}" for i in (0xF1A70, 0xF1A71)]   # flat pages (the copying calls)


def main() -> None:
    mode, master, out = sys.argv[1], sys.argv[2], sys.argv[3]
    hashes = get_hash_str(TOKENS, None, page_size=PAGE)
    report = {"hashes": get_hash_str(list(range(1, 11)), None, page_size=PAGE), "keys": {}}
    from kvstore.client.integrations.sglang.keys import page_keys
    for mla, rank in RANKS:
        name = f"{'mla' if mla else 'mha'}{rank}"
        b, pool = backend(master, mla, rank)
        report["keys"][name] = page_keys(b.identity, report["hashes"])
        if mode == "set":
            slots = list(range(SET_PAGES))
            fill(pool, slots, hashes[:SET_PAGES], rank)
            first = b.batch_set_v1(hashes[:SET_PAGES], indices(slots))
            again = b.batch_set_v1(hashes[:SET_PAGES], indices(slots))
            legacy = b.batch_set(LEGACY, [page_bytes(k, rank, mla, 100) for k in LEGACY])
            report[name] = {"results": first, "again": again, "legacy": legacy,
                            "stats": b.stats()}
        elif mode == "get":
            count = b.batch_exists(hashes)
            slots = list(range(31, 31 - SET_PAGES, -1))       # other slots, reversed
            read = b.batch_get_v1(hashes[:SET_PAGES], indices(slots))
            writer_rank = 0 if mla else rank
            exact = [torch.equal(pool.page(s).reshape(-1),
                                 page_bytes(h, writer_rank, mla, pool.page(s).numel()))
                     for s, h in zip(slots, hashes[:SET_PAGES])]
            into = [torch.empty(100, dtype=torch.uint8) for _ in LEGACY]
            legacy = b.batch_get(LEGACY, into)
            fresh = b.get(LEGACY[0])
            report[name] = {"exists": count, "read": read, "exact": exact, "stats": b.stats(),
                            "metrics_pgs": b.get_stats().prefetch_pgs,
                            "legacy_exact": [t is not None and torch.equal(
                                t, page_bytes(k, writer_rank, mla, 100))
                                for t, k in zip(legacy, LEGACY)],
                            "legacy_fresh": fresh is not None and torch.equal(
                                fresh, page_bytes(LEGACY[0], writer_rank, mla, 100)),
                            "exists_one": [b.exists(hashes[0]), b.exists(hashes[-1])]}
        elif mode == "dead":
            slots = list(range(SET_PAGES))
            if name == "mha0":                   # and a master that is not there at all
                down, _ = backend("127.0.0.1:1", mla, rank)
                report["down"] = {"exists": down.batch_exists(hashes),
                                  "read": down.batch_get_v1(hashes[:2], indices([0, 1])),
                                  "written": down.batch_set_v1(hashes[:2], indices([0, 1])),
                                  "stats": down.stats()}
                down.close()
            report[name] = {"exists": b.batch_exists(hashes),
                            "read": b.batch_get_v1(hashes[:SET_PAGES], indices(slots)),
                            "written": b.batch_set_v1(hashes[SET_PAGES:], indices(
                                list(range(len(hashes) - SET_PAGES)))),
                            "stats": b.stats()}
        elif mode == "clear" and (mla, rank) == (False, 0):
            other, other_pool = backend(master, mla, rank, tenant="t2")
            page = hashes[SET_PAGES:SET_PAGES + 1]         # a page tenant t1 never stored
            fill(other_pool, [0], page, rank)
            other.batch_set_v1(page, indices([0]))
            report[name] = {"other_before": other.batch_exists(page),
                            "first_tenant": b.batch_exists(page),
                            "cleared": other.clear(), "other_after": other.batch_exists(page),
                            "first_tenant_kept": b.batch_exists(hashes)}
            other.close()
        b.close()
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
