"""A Llama-family decoder over a paged KV cache: :class:`LlamaModel`.

Three ways to run it, all plain synchronous functions (one worker thread):

* :meth:`LlamaModel.prefill` -- compute a prompt's KV into its pages and
  return the logits of its last token.
* :meth:`LlamaModel.decode` -- one step for a batch of sequences.
* :meth:`LlamaModel.forward` -- dense, cache-free logits of every position
  (a reference for tests).

Bit-identity contract (what lets a disaggregated, cached run equal a plain
one):

* Prefill always computes in **block-aligned chunks**: chunk ``b`` is the
  tokens ``[b * P, min((b + 1) * P, n))`` with ``P = cache.page_tokens``, and
  it reads earlier tokens' KV from the pages. So block ``b``'s KV comes from
  exactly the same tensor shapes and inputs whether blocks ``0 .. b-1`` were
  computed in this call, in an earlier call, or loaded from the store. This
  needs ``seq.num_computed`` to be a multiple of ``P`` when prefill starts.
* Decode is **batch-invariant**: projections run row by row
  (:func:`kvstore.engines.ops.linear_rows`), norms and activations per row, and
  attention per sequence over its own context, so a sequence's logits are
  the same bits alone or in any batch.
* Prefill projections run row by row too. Besides making a row's result
  independent of the chunk's length, this makes prefill and decode
  independent of torch's intra-op thread count (a plain ``mm`` with 5 to 11
  rows changes bits between 1 and 2 threads here), as long as each chunk's
  elementwise work stays below torch's parallel grain (32768 elements; true
  for :meth:`ModelConfig.tiny`). For bigger models, run every process that
  must agree with the same ``torch.get_num_threads()``. Bits are promised
  for one torch build on one CPU type, not across machines.

A prompt whose blocks are all cached still needs one computed token for its
logits: the engine loads at most :func:`max_cached_blocks` blocks and
prefill recomputes the rest (same bits as the stored copy).

Thread safety: none; one worker thread calls the model with its own cache.
Weights are read-only, so several threads could share one model object with
separate caches.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Sequence as Seq

import torch

from kvstore.engines import ops
from kvstore.client.models import ModelConfig
from kvstore.engines.kv_cache import PagedKVCache, Sequence
from kvstore.engines.weights import LlamaWeights, load_safetensors, random_state_dict

logger = logging.getLogger(__name__)

#: Called by prefill when a block's KV is complete in every layer:
#: ``on_block(block_index, page_id)``. The prefill engine saves it to the store.
BlockDone = Callable[[int, int], None]
#: Called by prefill as one layer of a full block's KV is written:
#: ``on_layer(block_index, layer, page_id)``; ``page[layer]`` is final then.
LayerDone = Callable[[int, int, int], None]


def max_cached_blocks(num_prompt_tokens: int, page_tokens: int) -> int:
    """Most prompt blocks that may come from a cache: at least one token must be computed."""
    return max(num_prompt_tokens - 1, 0) // page_tokens


class LlamaModel:
    """Llama decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU), float32 on CPU.

    Args:
        cfg: the model's shape.
        weights: execution-layout weights for ``cfg``.
    """

    def __init__(self, cfg: ModelConfig, weights: LlamaWeights):
        self.cfg = cfg
        self.weights = weights
        self.cos, self.sin = ops.rope_tables(cfg.head_dim, cfg.max_position_embeddings,
                                             cfg.rope_theta)  # [max_pos, head_dim] each
        self.scale = cfg.head_dim ** -0.5
        self._q_cols = cfg.num_heads * cfg.head_dim
        self._kv_cols = cfg.num_kv_heads * cfg.head_dim

    @classmethod
    def random(cls, cfg: ModelConfig) -> "LlamaModel":
        """Seeded random weights: the same bits in every process for ``cfg.seed``."""
        return cls(cfg, LlamaWeights.from_state_dict(cfg, random_state_dict(cfg)))

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str]) -> "LlamaModel":
        """Load a HF folder: ``config.json`` and ``*.safetensors`` (HF parameter names)."""
        cfg = ModelConfig.from_pretrained(folder)
        return cls(cfg, LlamaWeights.from_state_dict(cfg, load_safetensors(folder)))

    def fingerprint(self) -> str:
        """SHA-256 hex of the weights (a store namespace's weights revision)."""
        return self.weights.fingerprint()

    # -- execution -----------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: Seq[int]) -> torch.Tensor:
        """Dense causal forward over a whole sequence, no cache (a test reference).

        Not part of the bit-identity contract: its shapes differ from prefill's.

        Args:
            tokens: token ids at positions ``0 .. T-1``.

        Returns:
            ``[T, vocab]`` float32 logits of every position.
        """
        x = self._run_layers(self._embed(tokens), 0, None, None)
        return ops.rms_norm(x, self.weights.norm, self.cfg.rms_norm_eps) @ self.weights.lm_head_t

    @torch.inference_mode()
    def prefill(self, seq: Sequence, cache: PagedKVCache, tokens: Seq[int],
                on_block: BlockDone | None = None,
                on_layer: LayerDone | None = None) -> torch.Tensor:
        """Compute the KV of ``tokens[seq.num_computed:]`` in block-aligned chunks.

        Args:
            seq: the request; its pages must hold ``len(tokens)`` tokens
                (reserve them first) and ``seq.num_computed`` must be a
                multiple of ``cache.page_tokens`` below ``len(tokens)``.
                Advanced to ``len(tokens)``.
            cache: the pages.
            tokens: the whole prompt, positions ``0 .. n-1``.
            on_block: called as each full block's KV completes in every layer.
            on_layer: called as each layer of a full block's KV is written
                (before that layer's attention runs): layer-wise saves.

        Returns:
            ``[vocab]`` float32 logits of the last token.

        Raises:
            ValueError: the preconditions above do not hold (a caller bug).
        """
        n, start, p = len(tokens), seq.num_computed, cache.page_tokens
        self._check_cache(cache)
        if start % p or not 0 <= start < n:
            raise ValueError(f"{seq.seq_id}: prefill from token {start} of {n} "
                             f"(must be a multiple of page_tokens={p}, below {n})")
        if cache.capacity(seq) < n:
            raise ValueError(f"{seq.seq_id}: {n} tokens but pages hold {cache.capacity(seq)}")
        if n > self.cfg.max_position_embeddings:
            raise ValueError(f"{seq.seq_id}: {n} tokens > max_position_embeddings="
                             f"{self.cfg.max_position_embeddings}")
        x = None
        for c0 in range(start, n, p):
            c1 = min(c0 + p, n)
            after_write = None
            if on_layer is not None and c1 % p == 0:
                block, page_id = c0 // p, seq.page_ids[c0 // p]
                after_write = lambda li: on_layer(block, li, page_id)  # noqa: E731
            x = self._run_layers(self._embed(tokens[c0:c1]), c0, seq, cache, after_write)
            seq.num_computed = c1
            if on_block is not None and c1 % p == 0:
                on_block(c0 // p, seq.page_ids[c0 // p])
        last = ops.rms_norm(x[-1:], self.weights.norm, self.cfg.rms_norm_eps)
        return (last @ self.weights.lm_head_t)[0]

    @torch.inference_mode()
    def decode(self, seqs: Seq[Sequence], cache: PagedKVCache,
               last_tokens: Seq[int]) -> torch.Tensor:
        """One decode step for a batch: each sequence appends one token.

        Args:
            seqs: distinct sequences; each one's pages must hold
                ``num_computed + 1`` tokens. Each is advanced by one token.
            cache: the pages.
            last_tokens: the token each sequence appends (at position
                ``seq.num_computed``), in the order of ``seqs``.

        Returns:
            ``[B, vocab]`` float32 logits for the next token; row ``b`` is
            bit-identical whatever else is in the batch.

        Raises:
            ValueError: a precondition does not hold (a caller bug).
        """
        cfg, w = self.cfg, self.weights
        b = len(seqs)
        self._check_cache(cache)
        if b == 0 or len(last_tokens) != b or len({id(s) for s in seqs}) != b:
            raise ValueError(f"decode needs distinct sequences and one token each "
                             f"({b} sequences, {len(last_tokens)} tokens)")
        positions = [s.num_computed for s in seqs]
        for s, pos in zip(seqs, positions):
            if cache.capacity(s) <= pos or pos >= cfg.max_position_embeddings:
                raise ValueError(f"{s.seq_id}: no room for token {pos} "
                                 f"(pages hold {cache.capacity(s)})")
        eps = cfg.rms_norm_eps
        x = self._embed(last_tokens)  # [B, hidden]
        for li, lw in enumerate(w.layers):
            h = ops.per_row(lambda r: ops.rms_norm(r, lw.input_norm, eps), x)
            qkv = ops.linear_rows(h, lw.qkv_t)  # [B, (nh + 2 kvh) * hd]
            outs = []
            for i, (s, pos) in enumerate(zip(seqs, positions)):
                q, k, v = self._split_qkv(qkv[i:i + 1], pos)
                cache.write_kv(s, li, pos, k, v)
                kc, vc = cache.gather_kv(s, li, pos + 1)
                outs.append(ops.attention(q, kc, vc, pos, self.scale))
            x = x + ops.linear_rows(torch.cat(outs), lw.o_t)
            h = ops.per_row(lambda r: ops.rms_norm(r, lw.post_norm, eps), x)
            act = ops.per_row(ops.swiglu, ops.linear_rows(h, lw.gate_up_t))
            x = x + ops.linear_rows(act, lw.down_t)
        h = ops.per_row(lambda r: ops.rms_norm(r, w.norm, eps), x)
        logits = ops.linear_rows(h, w.lm_head_t)
        for s in seqs:
            s.num_computed += 1
        return logits

    # -- internals -----------------------------------------------------------

    def _embed(self, tokens: Seq[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(tokens), dtype=torch.long)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"token id out of range [0, {self.cfg.vocab_size})")
        return self.weights.embed[ids]  # [T, hidden]

    def _split_qkv(self, qkv: torch.Tensor,
                   start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, qkv_cols]`` -> roped q ``[T, nh, hd]``, roped k and v ``[T, kvh, hd]``."""
        cfg, t = self.cfg, qkv.shape[0]
        qc, kc = self._q_cols, self._kv_cols
        cos, sin = self.cos[start:start + t], self.sin[start:start + t]
        q = ops.apply_rope(qkv[:, :qc].reshape(t, cfg.num_heads, cfg.head_dim), cos, sin)
        k = ops.apply_rope(qkv[:, qc:qc + kc].reshape(t, cfg.num_kv_heads, cfg.head_dim),
                           cos, sin)
        v = qkv[:, qc + kc:].reshape(t, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def _run_layers(self, x: torch.Tensor, start: int, seq: Sequence | None,
                    cache: PagedKVCache | None,
                    after_write: Callable[[int], None] | None = None) -> torch.Tensor:
        """All layers over a run of tokens at positions ``start ..``.

        With a cache, the run's K/V are written to ``seq``'s pages and
        attention reads positions ``0 .. start + T - 1`` back from them;
        without one, the run attends to itself only (``start`` must be 0).

        Args:
            x: ``[T, hidden]`` float32 embeddings.

        Returns:
            ``[T, hidden]`` float32 hidden states after the last layer (before
            the final norm).
        """
        eps, t = self.cfg.rms_norm_eps, x.shape[0]
        for li, lw in enumerate(self.weights.layers):
            h = ops.rms_norm(x, lw.input_norm, eps)
            q, k, v = self._split_qkv(ops.linear_rows(h, lw.qkv_t), start)
            if cache is not None:
                cache.write_kv(seq, li, start, k, v)
                if after_write is not None:
                    after_write(li)
                k, v = cache.gather_kv(seq, li, start + t)
            x = x + ops.linear_rows(ops.attention(q, k, v, start, self.scale), lw.o_t)
            h = ops.rms_norm(x, lw.post_norm, eps)
            x = x + ops.linear_rows(ops.swiglu(ops.linear_rows(h, lw.gate_up_t)), lw.down_t)
        return x

    def _check_cache(self, cache: PagedKVCache) -> None:
        cfg = self.cfg
        want = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        have = (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.data.dtype)
        if have != want:
            raise ValueError(f"cache layout {have} does not fit the model {want}")
