"""Request-scoped transfer keys: KV handed from prefill to decode outside the prefix cache."""

from __future__ import annotations


def transfer_key(request_id: str, nonce: str, block: int | str) -> str:
    """A request-scoped key for KV handed from prefill to decode (not a cache entry)."""
    return f"xfer/{request_id}/{nonce}/{block}"


def is_transfer_key(key: str) -> bool:
    return key.startswith("xfer/")
