"""Prefix keys and namespace ids: golden vectors pin the function for good.

If a golden vector changes, every cached block in every deployed store
becomes unreachable: change them only with a schema version bump.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.errors import InvalidArgument
from kvstore.keys import (Namespace, key_list, key_slot, prefix_hashes, prefix_keys, validate_key,
                          value_checksum)

LLAMA = Namespace(model="meta-llama/Llama-3-8B", revision="r1", kv_dtype="bfloat16",
                  num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=4)
TOKENS = list(range(10))   # two full blocks of 4, a partial block of 2

# ---- golden vectors (computed once, xxh3-128 / xxh3-64; never regenerate) ----
GOLDEN_LLAMA_ID = "81717a536c3883697804e04975906571"
GOLDEN_LLAMA_KEYS = ["a929005c30bb08d6f38fa0798dd2ac43", "ef90248158a047c1223b2869247ef2c4"]
GOLDEN_LLAMA_EXTRA_KEYS = ["7d14f5c6bfe4f12ddf07aaa7b50e8420", "c0e8dbdc8a77dba47267c2518f721285"]
GOLDEN_DEFAULT_ID = "626f889fc82aa47740c49fb2c788738d"
GOLDEN_DEFAULT_KEYS = ["ba57394d55168b4f8ee081b6e509584d", "9dcc37fde631a590b8e27799dd25b6d5"]
GOLDEN_WIDE_TOKENS_KEY = "8ea119cd8b7084b2a4113a07e390b38f"
GOLDEN_SLOT_HELLO = 7421
GOLDEN_CHECKSUM_HELLO = 10760762337991515389


def test_golden_namespace_ids():
    assert LLAMA.id().hex() == GOLDEN_LLAMA_ID
    assert Namespace(model="m").id().hex() == GOLDEN_DEFAULT_ID


def test_golden_prefix_keys():
    assert prefix_keys(TOKENS, LLAMA) == GOLDEN_LLAMA_KEYS
    assert prefix_keys(TOKENS, LLAMA, extra=[b"img:abc", b""]) == GOLDEN_LLAMA_EXTRA_KEYS
    assert prefix_keys([1] * 32, Namespace(model="m")) == GOLDEN_DEFAULT_KEYS
    # Token ids across the whole uint32 range, block_tokens 16.
    assert prefix_keys([0xFFFFFFFF, 0, 7, 100000] * 4,
                       Namespace(model="m", block_tokens=16)) == [GOLDEN_WIDE_TOKENS_KEY]


def test_golden_slot_and_checksum():
    assert key_slot("hello") == GOLDEN_SLOT_HELLO
    assert value_checksum(b"hello") == GOLDEN_CHECKSUM_HELLO


def test_keys_are_hex_digests_of_the_hashes():
    hashes = prefix_hashes(TOKENS, LLAMA)
    assert [h.hex() for h in hashes] == prefix_keys(TOKENS, LLAMA)
    assert all(len(h) == 16 for h in hashes)


def test_token_container_does_not_matter():
    expected = prefix_keys(TOKENS, LLAMA)
    assert prefix_keys(tuple(TOKENS), LLAMA) == expected
    assert prefix_keys(np.array(TOKENS, dtype=np.int64), LLAMA) == expected
    assert prefix_keys(np.array(TOKENS, dtype=np.uint32), LLAMA) == expected


@pytest.mark.parametrize("field,value", [("adapter", "lora-1"), ("salt", "s"),
                                         ("kv_dtype", "float16"), ("tenant", "acme"),
                                         ("revision", "r2"), ("tp_rank", 1)])
def test_namespaces_differing_in_one_field_give_disjoint_keys(field, value):
    other = dataclasses.replace(LLAMA, **{field: value})
    tokens = list(range(64))
    assert other.id() != LLAMA.id()
    assert set(prefix_keys(tokens, other)).isdisjoint(prefix_keys(tokens, LLAMA))


def test_field_boundaries_are_unambiguous():
    # Length-prefixed fields: moving bytes from one string field to the next
    # must change the id.
    a = Namespace(model="ab", revision="c")
    b = Namespace(model="a", revision="bc")
    assert a.encode() != b.encode() and a.id() != b.id()


def test_only_full_blocks_get_keys():
    assert prefix_keys([1, 2, 3], LLAMA) == []
    assert len(prefix_keys(list(range(7)), LLAMA)) == 1
    assert len(prefix_keys(list(range(8)), LLAMA)) == 2
    # The partial tail does not influence the full blocks' keys.
    assert prefix_keys(list(range(8)) + [99, 98], LLAMA) == prefix_keys(list(range(8)), LLAMA)


def test_keys_chain_the_prefix():
    base = prefix_keys(list(range(12)), LLAMA)
    changed = prefix_keys([0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11], LLAMA)
    assert changed[0] == base[0]           # blocks before the change keep their key
    assert changed[1] != base[1]           # the changed block and all after it differ
    assert changed[2] != base[2]
    # A block's key depends on everything before it, not only on its own tokens.
    assert prefix_keys([5, 5, 5, 5, 1, 2, 3, 4], LLAMA)[1] != prefix_keys([6, 6, 6, 6, 1, 2, 3, 4], LLAMA)[1]


def test_extra_keys_change_the_key():
    tokens = list(range(8))
    plain = prefix_keys(tokens, LLAMA)
    assert prefix_keys(tokens, LLAMA, extra=[b"", b""]) == plain
    with_extra = prefix_keys(tokens, LLAMA, extra=[b"", b"mm:1234@0"])
    assert with_extra[0] == plain[0] and with_extra[1] != plain[1]
    first = prefix_keys(tokens, LLAMA, extra=[b"adapter-x", b""])
    assert first[0] != plain[0] and first[1] != plain[1]   # chained onward
    assert prefix_keys(tokens, LLAMA, extra=[b"a", b""]) != prefix_keys(tokens, LLAMA, extra=[b"b", b""])


def test_bad_input_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        prefix_keys([-1, 2, 3, 4], LLAMA)
    with pytest.raises(InvalidArgument):
        prefix_keys([2**32, 2, 3, 4], LLAMA)
    with pytest.raises(InvalidArgument):
        prefix_keys([[1, 2], [3, 4]], LLAMA)
    with pytest.raises(InvalidArgument):
        prefix_keys(list(range(8)), LLAMA, extra=[b""])   # fewer extras than blocks
    with pytest.raises(InvalidArgument):
        prefix_keys([1, 2, 3, 4], dataclasses.replace(LLAMA, block_tokens=0))


@pytest.mark.parametrize("key", ["", "a\x00b", "tab\tkey", "x" * 513, b"bytes", 7, None, "\ud800",
                                 "del\x7f", "nel\x85"])
def test_validate_key_rejects(key):
    with pytest.raises(InvalidArgument):
        validate_key(key)


def test_validate_key_accepts():
    assert validate_key("a/b:c-1") == "a/b:c-1"
    assert validate_key("ü" * 256) == "ü" * 256   # 512 UTF-8 bytes
    assert validate_key("\xa0é€") == "\xa0é€"


def test_key_list_wants_a_sequence_of_keys():
    assert key_list(("a", "b")) == ["a", "b"]
    with pytest.raises(InvalidArgument, match="sequence"):
        key_list("ab")                 # not keys "a" and "b"
    with pytest.raises(InvalidArgument):
        key_list(["a", 7])
    assert key_list(["a", 7], validate=False) == ["a", 7]    # each fails alone later


_CHILD = """
import json
from kvstore.keys import Namespace, prefix_keys, key_slot
ns = Namespace(model="meta-llama/Llama-3-8B", revision="r1", kv_dtype="bfloat16",
               num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=4)
print(json.dumps({"id": ns.id().hex(), "keys": prefix_keys(list(range(10)), ns),
                  "slot": key_slot("hello"), "hash_of_str": hash("hello")}))
"""


def test_keys_equal_across_interpreters_with_different_hash_seeds():
    outs = []
    for seed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                              text=True, timeout=60, check=True)
        outs.append(json.loads(proc.stdout))
    # The seeds really differ (Python's own hash() moved) ...
    assert outs[0]["hash_of_str"] != outs[1]["hash_of_str"]
    # ... and our keys did not.
    for out in outs:
        assert out["id"] == GOLDEN_LLAMA_ID
        assert out["keys"] == GOLDEN_LLAMA_KEYS
        assert out["slot"] == GOLDEN_SLOT_HELLO
