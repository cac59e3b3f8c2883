"""Tests for kvstore.tools.demo.trace: trace loading and deterministic token synthesis."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.tools.demo.trace import (
    BUNDLED_TRACES,
    ScaleConfig,
    TraceRecord,
    block_tokens_for,
    default_trace_path,
    load_trace,
    scale_request,
    scale_trace,
)

_M64 = (1 << 64) - 1


def _splitmix64_ref(x: int) -> int:
    """Scalar reference in plain Python integers, independent of numpy."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


# Golden vectors: changing block_tokens_for changes every replayed prompt and
# therefore every prefix key; these must never change silently.
GOLDEN = [
    ((0, 8, 2048), [1857, 2028, 973, 1769, 1689, 1441, 1894, 1014]),
    ((182789, 8, 2048), [164, 1082, 1596, 698, 571, 1051, 266, 147]),
    ((2**32 - 1, 4, 50000), [48096, 30497, 41791, 5307]),
]


@pytest.mark.parametrize(("args", "expected"), GOLDEN)
def test_block_tokens_for_golden(args, expected):
    tokens = block_tokens_for(*args)
    assert tokens.dtype == np.uint32
    assert tokens.tolist() == expected


@pytest.mark.parametrize("hash_id", [0, 1, 7, 12345, 2**31, 2**32 - 1])
def test_block_tokens_for_matches_scalar_reference(hash_id):
    vocab = 32000
    ref = [1 + _splitmix64_ref((hash_id << 32) | j) % (vocab - 1) for j in range(64)]
    assert block_tokens_for(hash_id, 64, vocab).tolist() == ref


def test_block_tokens_for_range_and_prefix_property():
    tokens = block_tokens_for(42, 4096, 5)
    assert tokens.min() >= 1 and tokens.max() < 5
    # A shorter block is the start of a longer one: partial blocks are prefixes.
    assert block_tokens_for(42, 10, 2048).tolist() == block_tokens_for(42, 100, 2048)[:10].tolist()
    assert block_tokens_for(1, 16, 2048).tolist() != block_tokens_for(2, 16, 2048).tolist()


def test_block_tokens_for_rejects_bad_args():
    with pytest.raises(ValueError):
        block_tokens_for(-1, 16, 2048)
    with pytest.raises(ValueError):
        block_tokens_for(2**32, 16, 2048)
    with pytest.raises(ValueError):
        block_tokens_for(0, 16, 1)


def _rec(hash_ids, input_length, output_length=100, timestamp_ms=0, index=0):
    return TraceRecord(
        index=index,
        timestamp_ms=timestamp_ms,
        input_length=input_length,
        output_length=output_length,
        hash_ids=tuple(hash_ids),
    )


def test_shared_prefix_gives_identical_tokens():
    cfg = ScaleConfig()
    a = scale_request(_rec([0, 1, 2, 3], 2048), cfg)
    b = scale_request(_rec([0, 1, 9, 10, 11], 2300), cfg)
    bt = cfg.block_tokens
    assert a.prompt_tokens[: 2 * bt].tolist() == b.prompt_tokens[: 2 * bt].tolist()
    assert a.prompt_tokens[2 * bt : 3 * bt].tolist() != b.prompt_tokens[2 * bt : 3 * bt].tolist()
    for j, h in enumerate([0, 1, 9, 10]):
        assert b.prompt_tokens[j * bt : (j + 1) * bt].tolist() == block_tokens_for(h, bt, cfg.vocab_size).tolist()


def test_partial_last_block_is_prefix_of_its_block():
    cfg = ScaleConfig(block_tokens=16)
    # 1100 tokens -> ceil(1100 * 16 / 512) = 35 -> 2 full blocks + 3 tokens.
    req = scale_request(_rec([5, 6, 7], 1100), cfg)
    assert req.num_prompt_tokens == 35
    assert req.num_blocks == 3
    assert req.prompt_tokens[32:].tolist() == block_tokens_for(7, 16, cfg.vocab_size)[:3].tolist()
    assert req.prompt_tokens.dtype == np.uint32
    assert not req.prompt_tokens.flags.writeable


@pytest.mark.parametrize(
    ("num_blocks", "input_length", "expected"),
    [
        (3, 1536, 48),  # exact
        (3, 1025, 33),  # ceil(32.03)
        (3, 10, 33),  # clamped up: the last block keeps at least one token
        (2, 9999, 32),  # clamped down: never more than num_blocks blocks
        (1, 1, 1),
    ],
)
def test_prompt_length_and_clamps(num_blocks, input_length, expected):
    req = scale_request(_rec(range(num_blocks), input_length), ScaleConfig())
    assert req.num_prompt_tokens == expected


@pytest.mark.parametrize(
    ("output_length", "cfg", "expected"),
    [
        (0, ScaleConfig(), 1),  # at least one token
        (64, ScaleConfig(), 2),  # 64 * 16 / 512
        (100000, ScaleConfig(), 16),  # capped
        (10, ScaleConfig(output_scale=1.0, max_output_tokens=100), 10),
        (500, ScaleConfig(output_scale=1.0, max_output_tokens=100), 100),
    ],
)
def test_max_tokens_clamp(output_length, cfg, expected):
    assert scale_request(_rec([0], 512, output_length=output_length), cfg).max_tokens == expected


def test_time_scale():
    rec = _rec([0], 512, timestamp_ms=1500)
    assert scale_request(rec, ScaleConfig()).arrival_ms == 1500
    assert scale_request(rec, ScaleConfig(time_scale=0.5)).arrival_ms == 750
    assert scale_request(rec, ScaleConfig(time_scale=0)).arrival_ms == 0


def test_scale_config_defaults_and_validation():
    cfg = ScaleConfig(block_tokens=32)
    assert cfg.output_scale == 32 / 512
    with pytest.raises(ValueError):
        ScaleConfig(block_tokens=0)
    with pytest.raises(ValueError):
        ScaleConfig(time_scale=-1)
    with pytest.raises(ValueError):
        scale_request(_rec([], 0), ScaleConfig())


@pytest.mark.parametrize(("name", "num_lines"), [("conversation", 12031), ("synthetic", 3993)])
def test_bundled_traces_load(name, num_lines):
    assert name in BUNDLED_TRACES
    records = load_trace(default_trace_path(name))
    assert len(records) == num_lines
    assert [r.index for r in records[:3]] == [0, 1, 2]
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in records)
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(records, records[1:]))


def test_bundled_trace_scales():
    records = load_trace(default_trace_path("conversation"), limit=200)
    assert len(records) == 200
    reqs = scale_trace(records, ScaleConfig())
    assert all(r.num_blocks == len(rec.hash_ids) for r, rec in zip(reqs, records))
    # The conversation trace opens with requests sharing hash_ids[0] == 0.
    assert reqs[0].prompt_tokens[:16].tolist() == reqs[1].prompt_tokens[:16].tolist()


def test_default_trace_path_unknown():
    with pytest.raises(KeyError):
        default_trace_path("nope")


def test_load_trace_errors_name_the_line(tmp_path):
    good = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]})
    cases = [
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1}),
        json.dumps({"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [0]}),
        json.dumps({"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [0]}),
        json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}),
    ]
    for bad in cases:
        path = tmp_path / "t.jsonl"
        path.write_text(f"{good}\n\n{good}\n{bad}\n")
        with pytest.raises(ValueError, match=r"t\.jsonl:4"):
            load_trace(path)


def test_load_trace_skips_blank_lines_and_limit(tmp_path):
    line = json.dumps({"timestamp": 3, "input_length": 600, "output_length": 2, "hash_ids": [4, 5]})
    path = tmp_path / "t.jsonl"
    path.write_text(f"\n{line}\n\n{line}\n{line}\n")
    assert [r.index for r in load_trace(path)] == [0, 1, 2]
    recs = load_trace(path, limit=2)
    assert len(recs) == 2
    assert recs[1] == TraceRecord(index=1, timestamp_ms=3, input_length=600, output_length=2, hash_ids=(4, 5))


_DIGEST_SCRIPT = """
import xxhash
from kvstore.tools.demo.trace import ScaleConfig, default_trace_path, load_trace, scale_trace
h = xxhash.xxh64()
for r in scale_trace(load_trace(default_trace_path("synthetic"), limit=50), ScaleConfig()):
    h.update(r.prompt_tokens.astype("<u4").tobytes())
    h.update(str((r.index, r.arrival_ms, r.max_tokens, r.num_blocks)).encode())
print(h.hexdigest())
"""


def test_deterministic_across_interpreters():
    digests = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT], env=env, check=True, capture_output=True, text=True
        )
        digests.append(out.stdout.strip())
    assert digests[0] == digests[1]
    assert len(digests[0]) == 16
