"""Adapters that let outside software use the store: one package per outside system.

    vllm/    vLLM's v1 KV connector (connector), its key namespacing (keys) and the
             copies between vLLM's KV tensors and host buffers (staging)
    sglang/  SGLang's HiCache storage backend (backend), its key namespacing (keys)
             and zero-copy views of SGLang's host pool pages (pool)
    resp/    the Redis protocol front (``kvstore resp``): redis-cli, redis-py, LMCache

An adapter is a client of the store: it may import the SDK (:mod:`kvstore.client`)
and the core, never the master's or the nodes' internals, and nothing in the SDK
imports an adapter (the import contract in pyproject.toml checks both), so an
outside system's imports (torch, vllm, sglang) stay out of the SDK's import graph. This
package imports nothing itself.
"""
