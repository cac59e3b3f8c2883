"""Engines: a Llama-family decoder in plain torch over a paged KV cache.

Modules: :mod:`engines.config` (model shape), :mod:`engines.weights` (random
or HF safetensors weights), :mod:`engines.ops` (numeric building blocks),
:mod:`engines.kv_cache` (pages, allocator, block tables), :mod:`engines.model`
(prefill / decode), :mod:`engines.generate` (the single-process reference).
"""

from engines.config import ModelConfig
from engines.generate import greedy_generate
from engines.kv_cache import OutOfPages, PagedKVCache, PageAllocator, Sequence
from engines.model import LlamaModel, max_cached_blocks

__all__ = ["LlamaModel", "ModelConfig", "OutOfPages", "PageAllocator", "PagedKVCache",
           "Sequence", "greedy_generate", "max_cached_blocks"]
