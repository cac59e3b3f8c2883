"""Cost model: predicted prefill, decode-step and KV transfer times.

The conductor's estimates (Mooncake FAST'25 §5, Algorithm 1:
``EstimatePrefillExecutionTime``, ``EstimateKVCacheTransferTime``; §7 for the
decode load) come from three small formulas fitted by profiling::

    prefill_ms(n new, c cached) = prefill_base_ms
                                + prefill_ms_per_token * n                 (linear layers)
                                + prefill_ms_per_mpair * (n*c + n*n/2)/1e6 (causal attention)
    decode_step_ms(b seqs, k context tokens in the batch)
                                = decode_base_ms                           (weights read once)
                                + decode_ms_per_seq * b                    (per-row compute)
                                + decode_ms_per_kctx * k / 1000            (KV read by attention)
    transfer_ms(bytes)          = transfer_base_ms + bytes / transfer_bytes_per_ms

A new token attends to the ``c`` cached tokens and to the new tokens before
it, hence ``n*c + n*n/2`` query-key pairs. The same record carries the sizes
that turn blocks into bytes and bound an instance (``kv_bytes_per_token``,
``block_tokens``, ``decode_kv_capacity_tokens``, ``prefill_cache_bytes``).

Models are JSON files; ``source`` says where every number comes from.
Bundled files live in ``conductor/data/cost_models`` and are named by their stem
(``load_cost_model("llama2-70b-a800")``). ``tools/cli/profile.py`` fits one from
the bundled torch engine with :func:`fit_prefill`, :func:`fit_decode` and
:func:`fit_transfer` (weighted non-negative least squares).

Thread safety: a ``CostModel`` is frozen; share it freely.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

#: Fields that are coefficients or sizes (everything but ``name``, ``hardware``, ``source``).
NUMERIC_FIELDS = (
    "block_tokens", "kv_bytes_per_token",
    "prefill_base_ms", "prefill_ms_per_token", "prefill_ms_per_mpair",
    "decode_base_ms", "decode_ms_per_seq", "decode_ms_per_kctx",
    "transfer_base_ms", "transfer_bytes_per_ms",
    "decode_kv_capacity_tokens", "prefill_cache_bytes",
)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Predicted execution times of one model on one kind of instance."""

    name: str  # short name, e.g. "llama2-70b-a800"
    block_tokens: int  # tokens per KV cache block
    kv_bytes_per_token: int  # KV bytes of one token, all layers, K and V
    prefill_base_ms: float  # fixed cost of one prefill call
    prefill_ms_per_token: float  # linear layers, per new token
    prefill_ms_per_mpair: float  # attention, per million (query, key) pairs
    decode_base_ms: float  # one decode step with an empty batch (weights read, launches)
    decode_ms_per_seq: float  # per sequence in the batch
    decode_ms_per_kctx: float  # per 1000 context tokens summed over the batch
    transfer_base_ms: float  # latency of one KV transfer between instances
    transfer_bytes_per_ms: float  # bandwidth of that transfer
    decode_kv_capacity_tokens: int  # KV tokens one decode instance holds
    prefill_cache_bytes: int  # local KVCache pool (DRAM) of one prefill instance
    hardware: str = ""  # what the numbers describe, in words
    source: dict[str, str] = field(default_factory=dict, compare=False)  # field -> provenance

    def __post_init__(self) -> None:
        for name in NUMERIC_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                    not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model {self.name!r}: {name} must be a finite number >= 0, "
                                 f"got {value!r}")
        if self.block_tokens < 1 or self.kv_bytes_per_token < 1 or self.transfer_bytes_per_ms <= 0:
            raise ValueError(f"cost model {self.name!r}: block_tokens, kv_bytes_per_token and "
                             f"transfer_bytes_per_ms must be positive")

    # ------------------------------------------------------------ predictions

    def prefill_ms(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """Time to prefill ``new_tokens`` after ``cached_tokens`` of reused KV.

        Args:
            new_tokens: prompt tokens to compute (>= 0; 0 costs nothing).
            cached_tokens: tokens before them whose KV is loaded, not computed.

        Returns:
            Milliseconds.
        """
        if new_tokens <= 0:
            return 0.0
        pairs = new_tokens * cached_tokens + new_tokens * new_tokens / 2
        return (self.prefill_base_ms + self.prefill_ms_per_token * new_tokens
                + self.prefill_ms_per_mpair * pairs / 1e6)

    def decode_step_ms(self, batch_size: int, context_tokens: int) -> float:
        """Time of one decode step (one token for every sequence of the batch).

        Args:
            batch_size: sequences in the batch (0: no step runs, 0 ms).
            context_tokens: tokens of KV the step attends to, summed over the batch.

        Returns:
            Milliseconds; also the time between tokens (TBT) of every sequence in it.
        """
        if batch_size <= 0:
            return 0.0
        return (self.decode_base_ms + self.decode_ms_per_seq * batch_size
                + self.decode_ms_per_kctx * context_tokens / 1000)

    def transfer_ms(self, num_bytes: int) -> float:
        """Time to move ``num_bytes`` of KV between two instances (0 bytes: 0 ms)."""
        if num_bytes <= 0:
            return 0.0
        return self.transfer_base_ms + num_bytes / self.transfer_bytes_per_ms

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV cache block."""
        return self.block_tokens * self.kv_bytes_per_token

    def blocks_transfer_ms(self, num_blocks: int) -> float:
        """Time to move ``num_blocks`` whole blocks between two instances."""
        return self.transfer_ms(num_blocks * self.block_bytes)

    @property
    def prefill_cache_blocks(self) -> int:
        """Blocks the local KVCache pool of one prefill instance holds."""
        return self.prefill_cache_bytes // self.block_bytes

    # ------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict, every field included."""
        return {f.name: (dict(getattr(self, f.name)) if f.name == "source" else getattr(self, f.name))
                for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostModel":
        """Builds a model from :meth:`to_dict` output (unknown keys are an error).

        Raises:
            ValueError: a field is missing, unknown or out of range.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown cost model fields {unknown}; known: {sorted(known)}")
        missing = sorted(known - set(d) - {"hardware", "source"})
        if missing:
            raise ValueError(f"cost model lacks fields {missing}")
        values = dict(d)
        for name in ("block_tokens", "kv_bytes_per_token", "decode_kv_capacity_tokens",
                     "prefill_cache_bytes"):
            if isinstance(values[name], float) and values[name].is_integer():
                values[name] = int(values[name])
        return cls(**values)

    def save(self, path: str | Path) -> None:
        """Writes the model as indented JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    def with_overrides(self, **changes: Any) -> "CostModel":
        """A copy with some fields replaced (validated like a new model)."""
        return replace(self, **changes)


def cost_models_dir() -> Path:
    """The folder of bundled cost models (``conductor/data/cost_models``, package data)."""
    return Path(__file__).resolve().parent / "data" / "cost_models"


def bundled_cost_models() -> list[str]:
    """Names (file stems) of the bundled cost models."""
    folder = cost_models_dir()
    return sorted(p.stem for p in folder.glob("*.json")) if folder.is_dir() else []


DEFAULT_COST_MODEL = "llama2-70b-a800"
"""The GPU-class model the simulator uses unless told otherwise."""


def load_cost_model(name_or_path: str | Path) -> CostModel:
    """Reads a cost model from a JSON file, or a bundled one by name.

    Args:
        name_or_path: a path to a JSON file, or the stem of a bundled one.

    Raises:
        FileNotFoundError: neither a file nor a bundled name (lists the names).
        ValueError: the file is not a valid model.
    """
    path = Path(name_or_path)
    if not path.is_file():
        bundled = cost_models_dir() / f"{name_or_path}.json"
        if not bundled.is_file():
            raise FileNotFoundError(f"no cost model file {name_or_path!r}; bundled: "
                                    f"{bundled_cost_models()}")
        path = bundled
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc.msg}") from None
    try:
        return CostModel.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


# ---------------------------------------------------------------- fitting


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active-set elimination (few columns).

    Solves ``min |a x - b|`` with ``x >= 0``: solve unconstrained, drop the
    most negative coefficient, repeat. Exact for the 2-3 columns used here
    whenever the constrained optimum has the dropped columns at zero, which
    holds for the monotone cost curves we fit.
    """
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
    return x


def _fit(columns: Sequence[np.ndarray], y: np.ndarray) -> np.ndarray:
    """Fits ``y ~ sum(coef_i * col_i)`` minimising the relative error, coefficients >= 0."""
    a = np.stack(columns, axis=1).astype(np.float64)
    y = np.asarray(y, dtype=np.float64)
    if len(y) < a.shape[1]:
        raise ValueError(f"need at least {a.shape[1]} samples to fit, got {len(y)}")
    if (y <= 0).any():
        raise ValueError("measured times must be positive")
    w = 1.0 / y  # relative error: short and long runs count alike
    return _nnls(a * w[:, None], y * w)


def fit_prefill(samples: Iterable[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Fits ``prefill_ms`` to measurements.

    Args:
        samples: ``(new_tokens, cached_tokens, measured_ms)``.

    Returns:
        ``(prefill_base_ms, prefill_ms_per_token, prefill_ms_per_mpair)``.
    """
    s = np.asarray(list(samples), dtype=np.float64)
    n, c, y = s[:, 0], s[:, 1], s[:, 2]
    coef = _fit([np.ones_like(n), n, (n * c + n * n / 2) / 1e6], y)
    return float(coef[0]), float(coef[1]), float(coef[2])


def fit_decode(samples: Iterable[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Fits ``decode_step_ms`` to measurements.

    Args:
        samples: ``(batch_size, context_tokens, measured_ms)``, context summed over the batch.

    Returns:
        ``(decode_base_ms, decode_ms_per_seq, decode_ms_per_kctx)``.
    """
    s = np.asarray(list(samples), dtype=np.float64)
    b, k, y = s[:, 0], s[:, 1], s[:, 2]
    coef = _fit([np.ones_like(b), b, k / 1000], y)
    return float(coef[0]), float(coef[1]), float(coef[2])


def fit_transfer(samples: Iterable[tuple[int, float]]) -> tuple[float, float]:
    """Fits ``transfer_ms`` to measurements.

    Args:
        samples: ``(num_bytes, measured_ms)``.

    Returns:
        ``(transfer_base_ms, transfer_bytes_per_ms)``.

    Raises:
        ValueError: the fitted time does not grow with size (bandwidth undefined).
    """
    s = np.asarray(list(samples), dtype=np.float64)
    x, y = s[:, 0], s[:, 1]
    coef = _fit([np.ones_like(x), x], y)
    if coef[1] <= 0:
        raise ValueError("transfer time does not grow with size; measure larger transfers")
    return float(coef[0]), float(1.0 / coef[1])


__all__ = [
    "DEFAULT_COST_MODEL",
    "CostModel",
    "bundled_cost_models",
    "cost_models_dir",
    "fit_decode",
    "fit_prefill",
    "fit_transfer",
    "load_cost_model",
]
