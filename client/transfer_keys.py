"""Request-scoped transfer keys: KV handed from prefill to decode outside the prefix cache.

The prefill engine writes them; whoever ends the request removes them: the
decode engine once it loaded them, or the conductor when no decode runs
(``max_tokens`` 1). In the SDK's layer so that both reach them.
"""

from __future__ import annotations


def transfer_key(request_id: str, nonce: str, block: int | str) -> str:
    """A request-scoped key for KV handed from prefill to decode (not a cache entry)."""
    return f"xfer/{request_id}/{nonce}/{block}"


def is_transfer_key(key: str) -> bool:
    """Whether ``key`` is a transfer key (not a prefix-cache block)."""
    return key.startswith("xfer/")
