"""Key namespacing of the SGLang HiCache backend (no SGLang needed): deployments that
differ in model, tenant, salt, revision, KV dtype, layout, page size, TP rank (MHA)
or pipeline stage share no key; MLA ranks share one; equal ones get equal keys in
every process. Golden keys pin the function."""

import dataclasses
import subprocess
import sys

import pytest

from kvstore.client.integrations.sglang.keys import (StorageIdentity, leading_pages,
                                                     page_keys)
from kvstore.tenants import tenant_of

# SGLang 0.5.23's get_hash_str(list(range(1, 11)), None, page_size=4)
# (tests/with_sglang/test_sglang_backend.py checks these against the wheel).
SGLANG_PAGE_HASHES_1_TO_10 = [
    "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72",
    "4ebfa8a1f3c341517621838c6e1b9aa350307e3f00b3cbd1a07ef740f54396d6",
    "6dc571acd2ccb712fb7a8b13854443ded3fba409ddd9aa84849d3840c1547ca3",
]
IDENT = StorageIdentity(model="org/tiny-mha", page_size=4, tp_rank=0, tp_size=2,
                        kv_dtype="bfloat16", layout="page_first", num_layers=3,
                        num_kv_heads=2, head_dim=16, tenant="t1")


def test_keys_are_namespaced_sglang_hashes_with_k_and_v_parts():
    keys = page_keys(IDENT, SGLANG_PAGE_HASHES_1_TO_10)
    prefix = IDENT.key_prefix()
    assert prefix.startswith("@t1/sglang/") and len(prefix) == len("@t1/sglang/") + 32 + 1
    assert keys == [f"{prefix}{h}_{p}" for h in SGLANG_PAGE_HASHES_1_TO_10 for p in "kv"]
    assert keys[0] == ("@t1/sglang/" + IDENT.namespace().id().hex() + "/"
                       "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72_k")


def test_golden_namespace_id():
    """Changing the mapping orphans every stored page: this pins it."""
    assert IDENT.key_prefix() == GOLDEN_PREFIX


# With a tenant the keys are the tenant's ("@t1/", kvstore.tenants); the namespace id
# after it is the one of before.
GOLDEN_PREFIX = "@t1/sglang/4464b4c7fd82477116ff643a2c935129/"


def test_keys_without_a_tenant_carry_no_tenant_prefix():
    plain = dataclasses.replace(IDENT, tenant="")
    assert plain.key_prefix() == f"sglang/{plain.namespace().id().hex()}/"
    assert page_keys(plain, SGLANG_PAGE_HASHES_1_TO_10)[0].startswith("sglang/")
    assert tenant_of(page_keys(IDENT, SGLANG_PAGE_HASHES_1_TO_10)[0]) == "t1"


@pytest.mark.parametrize("other", [
    dict(model="org/tiny-2"), dict(tenant="t2"), dict(salt="s"), dict(revision="r2"),
    dict(kv_dtype="float16"), dict(layout="page_head"), dict(page_size=8),
    dict(tp_rank=1), dict(tp_size=4), dict(pp_rank=1, pp_size=2), dict(num_layers=4),
    dict(is_mla=True),
])
def test_any_namespace_difference_shares_no_key(other):
    base = set(page_keys(IDENT, SGLANG_PAGE_HASHES_1_TO_10))
    assert not base & set(page_keys(dataclasses.replace(IDENT, **other),
                                    SGLANG_PAGE_HASHES_1_TO_10))


def test_mla_ranks_share_one_copy():
    mla = dataclasses.replace(IDENT, is_mla=True)
    keys = page_keys(mla, SGLANG_PAGE_HASHES_1_TO_10)
    assert len(keys) == 3 and all(k.endswith("_k") for k in keys)
    for rank, size in ((1, 2), (3, 4)):
        assert page_keys(dataclasses.replace(mla, tp_rank=rank, tp_size=size),
                         SGLANG_PAGE_HASHES_1_TO_10) == keys


def test_leading_pages_counts_the_prefix_of_whole_pages():
    assert leading_pages([True, True, True, False, True, True], 2) == 1
    assert leading_pages([True] * 6, 2) == 3
    assert leading_pages([False, True], 2) == 0
    assert leading_pages([True, True, False], 1) == 2
    assert leading_pages([], 2) == 0


def test_keys_do_not_depend_on_python_hash_seed():
    code = ("from kvstore.client.integrations.sglang.keys import StorageIdentity, page_keys;"
            f"print(page_keys(StorageIdentity(**{dataclasses.asdict(IDENT)!r}), "
            f"{SGLANG_PAGE_HASHES_1_TO_10!r})[-1])")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert len(outs) == 1 and outs == {page_keys(IDENT, SGLANG_PAGE_HASHES_1_TO_10)[-1] + "\n"}
