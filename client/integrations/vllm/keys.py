"""Key namespacing for the vLLM connector, free of any vLLM import.

A block's key is :func:`kvstore.keys.prefix_keys` of the request's tokens in
a :class:`Namespace` that holds everything else that decides the block's
bytes: the model and its revision, the KV dtype and the connector's object
layout, vLLM's block size, the tensor-parallel rank and size, the request's
LoRA adapter and its ``cache_salt``. Two requests that differ in any of them
share no key. Pure functions: no ``hash()``, no process state.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Sequence

from kvstore.keys import Namespace, prefix_keys

# The object layout the connector writes: for each attention layer in vLLM's
# layer order, that layer's slice of one block (``kv_cache[block_id]`` or
# ``kv_cache[:, block_id]``), raw bytes, concatenated. Part of the KV dtype
# field so a change of layout never reads old objects.
OBJECT_LAYOUT = "vllm-v1-layer-major"


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """What one vLLM worker contributes to the namespace (the same for all its requests)."""

    model: str
    revision: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    tenant: str = ""

    def namespace(self, lora_name: str = "", cache_salt: str = "") -> Namespace:
        """The namespace of one request: the engine's identity plus its adapter and salt."""
        return Namespace(model=self.model, revision=self.revision,
                         kv_dtype=f"{self.kv_dtype};{OBJECT_LAYOUT}",
                         num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, block_tokens=self.block_size,
                         tp_rank=self.tp_rank, tp_size=self.tp_size,
                         adapter=lora_name or "", tenant=self.tenant, salt=cache_salt or "")


def request_keys(identity: EngineIdentity, tokens: Sequence[int], lora_name: str = "",
                 cache_salt: str = "") -> list[str]:
    """Store keys of each full block of ``tokens`` for one request."""
    return list(prefix_keys(list(tokens), identity.namespace(lora_name, cache_salt)))


def matched_blocks(exists: Sequence[bool]) -> int:
    """Length of the leading run of present blocks (a prefix is usable only up to its first hole)."""
    n = 0
    for e in exists:
        if not e:
            break
        n += 1
    return n


def kv_transfer_config(master: str, role: str = "kv_both", **extra) -> dict:
    """The ``kv_transfer_config`` that loads :class:`KVStoreConnector` by module path."""
    if role not in ("kv_both", "kv_producer", "kv_consumer"):
        raise ValueError(f"role must be kv_both, kv_producer or kv_consumer, got {role!r}")
    return {"kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.client.integrations.vllm.connector",
            "kv_role": role,
            # a block kvstore cannot deliver is recomputed (vLLM's default fails the request)
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master": master, **extra}}


def kv_transfer_config_json(master: str, role: str = "kv_both") -> str:
    """:func:`kv_transfer_config` as one JSON line (for ``--kv-transfer-config``)."""
    return json.dumps(kv_transfer_config(master, role), separators=(",", ":"))
