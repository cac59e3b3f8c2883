"""Mooncake FAST'25 traces: loading and deterministic token synthesis.

The traces (``tools/data``, see its README) carry no text: each request is an
arrival time, an input and an output length, and one ``hash_id`` per 512-token
block, where equal ids at the same position mean an equal prefix. To replay a
trace against real engines we turn every request into concrete token ids:

    trace block  hash_ids[j]  ──block_tokens_for()──▶  block_tokens token ids

so two requests that share leading ``hash_ids`` share identical leading tokens
and therefore identical prefix keys in the store. ``ScaleConfig`` shrinks the
paper-scale workload (512 tokens per block, outputs of hundreds of tokens) to
something a small model serves in seconds.

Token synthesis is a pure function of ``(hash_id, position, vocab_size)``:
splitmix64 in numpy over ``(hash_id << 32) | j``. It never uses Python's
``hash()`` or a global RNG, so it is the same in every process, run and
machine; golden values in ``tests/unit/test_trace.py`` pin it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

logger = logging.getLogger(__name__)

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_id`` block in the Mooncake traces."""

BUNDLED_TRACES: dict[str, str] = {
    "conversation": "conversation_trace.jsonl",
    "synthetic": "synthetic_trace.jsonl",
}
"""Short name -> file name of the traces bundled in ``tools/data``."""

_MAX_HASH_ID = (1 << 32) - 1


def _data_dir() -> Path:
    """The folder holding the bundled traces (``tools/data``, package data)."""
    return Path(__file__).resolve().parent.parent / "data"


def default_trace_path(name: str = "conversation") -> Path:
    """Returns the path of a bundled trace.

    Args:
        name: one of ``BUNDLED_TRACES`` ("conversation" or "synthetic").

    Returns:
        The path of the JSONL file.

    Raises:
        KeyError: ``name`` is not a bundled trace.
        FileNotFoundError: the package was installed without its data files.
    """
    if name not in BUNDLED_TRACES:
        raise KeyError(f"unknown trace {name!r}; bundled: {sorted(BUNDLED_TRACES)}")
    path = _data_dir() / BUNDLED_TRACES[name]
    if not path.is_file():
        raise FileNotFoundError(f"bundled trace {name!r} missing at {path}")
    return path


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of a Mooncake trace, as stored."""

    index: int  # 0-based position among the trace's records
    timestamp_ms: int  # arrival time from the start of the trace
    input_length: int  # prompt length in tokens (paper scale)
    output_length: int  # generated tokens (paper scale)
    hash_ids: tuple[int, ...]  # one id per 512-token prompt block


def _parse_record(line: str, index: int, line_no: int, path: Path) -> TraceRecord:
    where = f"{path}:{line_no}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON: {exc.msg}") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    fields = {}
    for name in ("timestamp", "input_length", "output_length"):
        value = obj.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: field {name!r} must be a non-negative integer, got {value!r}")
        fields[name] = value
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= _MAX_HASH_ID for h in hash_ids
    ):
        raise ValueError(f"{where}: field 'hash_ids' must be a list of integers in [0, 2**32)")
    return TraceRecord(
        index=index,
        timestamp_ms=fields["timestamp"],
        input_length=fields["input_length"],
        output_length=fields["output_length"],
        hash_ids=tuple(hash_ids),
    )


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """Reads a Mooncake trace (JSONL, one request per line).

    Blank lines are skipped.

    Args:
        path: the JSONL file.
        limit: read at most this many records; None reads all.

    Returns:
        The records in file order, ``index`` counting from 0.

    Raises:
        ValueError: a line is malformed (the message names the line number).
    """
    path = Path(path)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    records: list[TraceRecord] = []
    with path.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if limit is not None and len(records) >= limit:
                break
            if not line.strip():
                continue
            records.append(_parse_record(line, len(records), line_no, path))
    logger.debug("loaded %d trace records from %s", len(records), path)
    return records


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    """How a paper-scale trace shrinks to a replayable workload."""

    block_tokens: int = 16  # tokens that one 512-token trace block becomes
    time_scale: float = 1.0  # arrival time multiplier; 0 sends everything at t=0
    max_output_tokens: int = 16  # cap on generated tokens per request
    output_scale: float | None = None  # output length multiplier; None = block_tokens / 512
    vocab_size: int = 2048  # token ids are drawn from [1, vocab_size)

    def __post_init__(self) -> None:
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {self.time_scale}")
        if self.max_output_tokens < 1:
            raise ValueError(f"max_output_tokens must be >= 1, got {self.max_output_tokens}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if self.output_scale is None:
            object.__setattr__(self, "output_scale", self.block_tokens / TRACE_BLOCK_TOKENS)
        elif self.output_scale < 0:
            raise ValueError(f"output_scale must be >= 0, got {self.output_scale}")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _tokens_for_blocks(hash_ids: np.ndarray, block_tokens: int, vocab_size: int) -> np.ndarray:
    """Token ids of several trace blocks, shape ``[len(hash_ids), block_tokens]``, uint32."""
    ids = hash_ids.astype(np.uint64)[:, None] << np.uint64(32)
    positions = np.arange(block_tokens, dtype=np.uint64)[None, :]
    z = _splitmix64(ids | positions)
    # Token 0 is avoided: many tokenizers reserve it (padding / unknown).
    return (z % np.uint64(vocab_size - 1) + np.uint64(1)).astype(np.uint32)


def block_tokens_for(hash_id: int, block_tokens: int, vocab_size: int) -> np.ndarray:
    """Returns the deterministic token ids of one trace block.

    Token ``j`` is ``1 + splitmix64((hash_id << 32) | j) % (vocab_size - 1)``:
    a pure function, equal in every process, run and machine. Token 0 is never
    produced.

    Args:
        hash_id: the trace block id, in ``[0, 2**32)``.
        block_tokens: how many tokens the block has.
        vocab_size: ids fall in ``[1, vocab_size)``; must be >= 2.

    Returns:
        ``np.ndarray`` of shape ``[block_tokens]``, dtype uint32.

    Raises:
        ValueError: an argument is out of range.
    """
    if not 0 <= hash_id <= _MAX_HASH_ID:
        raise ValueError(f"hash_id must be in [0, 2**32), got {hash_id}")
    if block_tokens < 0:
        raise ValueError(f"block_tokens must be >= 0, got {block_tokens}")
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return _tokens_for_blocks(np.array([hash_id], dtype=np.uint64), block_tokens, vocab_size)[0]


@dataclass(frozen=True, slots=True, eq=False)
class ScaledRequest:
    """A trace request shrunk to replay scale, with concrete prompt tokens."""

    index: int  # the trace record's index
    arrival_ms: float  # scaled arrival time from the start of the replay
    prompt_tokens: np.ndarray  # [num_prompt_tokens] uint32, read-only
    max_tokens: int  # tokens to generate, in [1, max_output_tokens]
    num_blocks: int  # trace blocks (len(hash_ids)); the last may be partial

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return int(self.prompt_tokens.shape[0])


def scaled_prompt_tokens(num_trace_blocks: int, input_length: int, block_tokens: int) -> int:
    """Scaled prompt length: ``ceil(input_length * block_tokens / 512)``, clamped.

    The clamp ``[(num_trace_blocks - 1) * block_tokens + 1, num_trace_blocks * block_tokens]``
    keeps exactly ``num_trace_blocks`` blocks, the last one non-empty.

    Args:
        num_trace_blocks: ``len(hash_ids)``, >= 1.
        input_length: paper-scale prompt tokens.
        block_tokens: tokens per scaled block.

    Returns:
        The prompt length in tokens.
    """
    n = -(-input_length * block_tokens // TRACE_BLOCK_TOKENS)
    low = (num_trace_blocks - 1) * block_tokens + 1
    high = num_trace_blocks * block_tokens
    return min(max(n, low), high)


def scale_request(rec: TraceRecord, cfg: ScaleConfig) -> ScaledRequest:
    """Turns one trace record into a replayable request.

    Block ``j`` of the prompt is ``block_tokens_for(rec.hash_ids[j])``; the last
    block, when partial, is the first tokens of its block. So requests sharing
    leading ``hash_ids`` share identical leading tokens.

    Args:
        rec: the trace record; must have at least one hash id.
        cfg: the scaling.

    Returns:
        The scaled request.

    Raises:
        ValueError: the record has no ``hash_ids``.
    """
    num_blocks = len(rec.hash_ids)
    if num_blocks == 0:
        raise ValueError(f"trace record {rec.index} has no hash_ids (input_length={rec.input_length})")
    num_tokens = scaled_prompt_tokens(num_blocks, rec.input_length, cfg.block_tokens)
    blocks = _tokens_for_blocks(np.asarray(rec.hash_ids, dtype=np.uint64), cfg.block_tokens, cfg.vocab_size)
    prompt = np.ascontiguousarray(blocks.reshape(-1)[:num_tokens])
    prompt.setflags(write=False)
    assert cfg.output_scale is not None  # resolved in ScaleConfig.__post_init__
    max_tokens = min(max(round(rec.output_length * cfg.output_scale), 1), cfg.max_output_tokens)
    return ScaledRequest(
        index=rec.index,
        arrival_ms=rec.timestamp_ms * cfg.time_scale,
        prompt_tokens=prompt,
        max_tokens=max_tokens,
        num_blocks=num_blocks,
    )


def scale_trace(records: Iterable[TraceRecord], cfg: ScaleConfig) -> list[ScaledRequest]:
    """Scales every record (see ``scale_request``), keeping order."""
    return [scale_request(rec, cfg) for rec in records]


__all__ = [
    "BUNDLED_TRACES",
    "TRACE_BLOCK_TOKENS",
    "ScaleConfig",
    "ScaledRequest",
    "TraceRecord",
    "block_tokens_for",
    "default_trace_path",
    "load_trace",
    "scale_request",
    "scale_trace",
    "scaled_prompt_tokens",
]


def intern_chains(records: Iterable[TraceRecord]) -> list[tuple[int, ...]]:
    """Each request's block keys as small ints: block j's key interns the chain
    ``hash_ids[:j+1]`` (``intern((key of block j-1, hash_ids[j]))``), so equal keys
    mean equal prefixes through that block, as the store's chained prefix keys do."""
    intern: dict[tuple[int, int], int] = {}
    out = []
    for rec in records:
        parent = -1
        chain = []
        for h in rec.hash_ids:
            parent = intern.setdefault((parent, h), len(intern))
            chain.append(parent)
        out.append(tuple(chain))
    return out


def resolve_trace(trace: str | None) -> Path:
    """A bundled trace name ("conversation", "synthetic"), a path, or None for the conversation trace."""
    if trace is None:
        return default_trace_path("conversation")
    if trace in BUNDLED_TRACES:
        return default_trace_path(trace)
    path = Path(trace)
    if not path.is_file():
        raise FileNotFoundError(f"no trace at {path} (bundled: {sorted(BUNDLED_TRACES)})")
    return path
