"""Engines: a Llama-family decoder in plain torch over a paged KV cache.

Modules: :mod:`kvstore.engines.weights` (random or HF safetensors weights),
:mod:`kvstore.engines.ops` (numeric building blocks), :mod:`kvstore.engines.kv_cache`
(pages, allocator, block tables), :mod:`kvstore.engines.model` (prefill / decode),
:mod:`kvstore.engines.generate` (the single-process reference), the two servers
(:mod:`kvstore.engines.prefill_server`, :mod:`kvstore.engines.decode_server`) and
their KV saving (:mod:`kvstore.engines.kv_saver`). The model's shape,
:class:`~kvstore.client.models.ModelConfig`, comes from the SDK, which the
conductor shares.
"""

from kvstore.client.models import ModelConfig
from kvstore.engines.generate import greedy_generate
from kvstore.engines.kv_cache import OutOfPages, PagedKVCache, PageAllocator, Sequence
from kvstore.engines.model import LlamaModel, max_cached_blocks

__all__ = ["LlamaModel", "ModelConfig", "OutOfPages", "PageAllocator", "PagedKVCache",
           "Sequence", "greedy_generate", "max_cached_blocks"]
