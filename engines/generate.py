"""The reference run: greedy generation in one process, no store.

The disaggregated pipeline (prefill engine -> store -> decode engine) must
produce exactly the tokens of :func:`greedy_generate` for the same model and
``page_tokens``; the model's bit-identity contract (see :mod:`kvstore.engines.model`)
is what makes that hold.
"""

from __future__ import annotations

import logging
from typing import Sequence as Seq

import torch

from kvstore.engines.kv_cache import DEFAULT_PAGE_TOKENS, PagedKVCache, Sequence
from kvstore.engines.model import LlamaModel

logger = logging.getLogger(__name__)


def greedy_token(logits: torch.Tensor) -> int:
    """The argmax token of ``[vocab]`` logits (lowest id on ties)."""
    return int(torch.argmax(logits))


def greedy_generate(model: LlamaModel, prompt_tokens: Seq[int], max_tokens: int,
                    page_tokens: int = DEFAULT_PAGE_TOKENS,
                    eos_token_id: int | None = None) -> list[int]:
    """Prefill the prompt, then decode greedily, one sequence alone.

    Args:
        model: the decoder.
        prompt_tokens: at least one token id.
        max_tokens: tokens to generate, the first (from prefill) included.
        page_tokens: KV page size; must equal the pipeline's ``block_tokens``
            for the outputs to be comparable bit for bit.
        eos_token_id: stop after generating this token (it is returned).

    Returns:
        The generated token ids (without the prompt), at most ``max_tokens``.
    """
    if not prompt_tokens:
        raise ValueError("empty prompt")
    if max_tokens <= 0:
        return []
    total = len(prompt_tokens) + max_tokens - 1  # the last token's KV is never needed
    cache = PagedKVCache.for_model(model.cfg, -(-total // page_tokens), page_tokens)
    seq = Sequence("greedy")
    cache.reserve(seq, total)
    out = [greedy_token(model.prefill(seq, cache, prompt_tokens))]
    while len(out) < max_tokens and out[-1] != eos_token_id:
        out.append(greedy_token(model.decode([seq], cache, [out[-1]])[0]))
    return out
