"""The numeric building blocks of the decoder, float32, in plain torch.

Conventions match Hugging Face ``modeling_llama`` (RMSNorm in float32, RoPE
with ``rotate_half`` over the two halves of a head, scores scaled by
``head_dim ** -0.5`` after the matmul, softmax in float32).

Determinism notes, because the engines promise bit-identical outputs:

* :func:`rope_tables` is computed once per model for every position; a
  position's cos/sin never depend on which call asked for it, nor on the
  thread count.
* :func:`linear_rows` multiplies each row on its own (``torch.bmm`` over a
  batch of one-row matrices against one expanded ``[in, out]`` matrix): on
  CPU each row gets the same bits whatever the batch size and thread count.
  A plain ``[M, in] @ [in, out]`` promises neither (measured with torch 2.13
  CPU: rows change bits from M = 4 on, and between 1 and 2 threads for
  M = 5..11). It costs about 1.3x on a prefill chunk. On
  AVX-512 hosts a one-matrix ``bmm`` differs from a batched one, so a lone
  row runs as the first of two equal rows.
* :func:`per_row` runs a row-wise function (norm, activation) on each row
  separately, so reductions and vectorized transcendental functions see the
  same shapes alone and in a batch.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension.

    Args:
        x: ``[..., hidden]`` float32.
        weight: ``[hidden]`` float32.
        eps: added to the mean square.
    """
    var = x.pow(2).mean(-1, keepdim=True)
    return weight * (x * torch.rsqrt(var + eps))


def rope_tables(head_dim: int, max_positions: int,
                theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, HF ``LlamaRotaryEmbedding`` convention.

    Returns:
        ``(cos, sin)``, each ``[max_positions, head_dim]`` float32; the two
        halves of the last dimension repeat the same frequencies.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                                / head_dim))
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # [max_positions, head_dim / 2], exact products
    emb = torch.cat([freqs, freqs], dim=-1).numpy().astype(np.float64)
    # numpy's single-threaded float64 cos/sin, rounded to float32: torch's
    # multi-threaded float32 kernels could give a position different bits
    # depending on where the thread chunks (and SIMD tails) fall.
    return (torch.from_numpy(np.cos(emb).astype(np.float32)),
            torch.from_numpy(np.sin(emb).astype(np.float32)))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate queries or keys by their positions.

    Args:
        x: ``[T, heads, head_dim]`` float32.
        cos, sin: ``[T, head_dim]``, rows of :func:`rope_tables` at the tokens'
            positions.

    Returns:
        ``[T, heads, head_dim]`` float32 (a new tensor).
    """
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int,
              scale: float) -> torch.Tensor:
    """Causal grouped-query attention of a run of queries over a prefix of keys.

    Query ``i`` sits at position ``q_start + i`` and sees keys ``0 ..
    q_start + i``. Query head ``h`` uses KV head ``h // (heads / kv_heads)``.

    Args:
        q: ``[T, heads, head_dim]`` float32.
        k, v: ``[S, kv_heads, head_dim]`` float32, positions ``0 .. S - 1``
            (``S >= q_start + T``).
        q_start: position of ``q[0]``.
        scale: score multiplier, ``head_dim ** -0.5``.

    Returns:
        ``[T, heads * head_dim]`` float32.
    """
    t, heads, hd = q.shape
    s, kvh, _ = k.shape
    g = heads // kvh
    qg = q.view(t, kvh, g, hd).permute(1, 2, 0, 3).reshape(kvh, g * t, hd)
    scores = torch.bmm(qg, k.permute(1, 2, 0)) * scale  # [kvh, g * t, s]
    scores = scores.view(kvh, g, t, s)
    if s > q_start + 1:  # some query has keys after it (never in a one-token decode)
        qpos = torch.arange(q_start, q_start + t).unsqueeze(1)
        hidden = torch.arange(s).unsqueeze(0) > qpos  # [t, s]: key after the query
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(kvh, g * t, s)
    out = torch.bmm(probs, v.permute(1, 0, 2))  # [kvh, g * t, hd]
    return out.view(kvh, g, t, hd).permute(2, 0, 1, 3).reshape(t, heads * hd)


def linear_rows(x: torch.Tensor, w_t: torch.Tensor) -> torch.Tensor:
    """``x @ w_t`` with every row computed as a one-row product (batch-invariant).

    Args:
        x: ``[B, in]`` float32.
        w_t: ``[in, out]`` float32, contiguous.

    Returns:
        ``[B, out]`` float32; row ``b`` is bit-identical to ``linear_rows(x[b:b+1], w_t)``.
    """
    b = x.shape[0]
    if b == 1:
        # A batch of one takes another kernel than a batch of two or more on
        # some CPUs (AVX-512 hosts: the bits differ); a lone row is computed
        # as the first of two equal rows, so it meets the same kernel.
        return linear_rows(x.expand(2, -1), w_t)[:1]
    return torch.bmm(x.unsqueeze(1), w_t.unsqueeze(0).expand(b, -1, -1)).squeeze(1)


def per_row(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Apply ``fn`` to each ``[1, ...]`` row of ``x`` on its own and stack the results."""
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a ``[T, 2 * intermediate]`` gate|up activation."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
