"""The store namespace of a model: what, besides tokens, decides its KV bytes."""

from __future__ import annotations

import hashlib
import pathlib

from engines.config import ModelConfig
from kvstore.keys import Namespace

TINY = "tiny"


def model_config(model: str) -> ModelConfig:
    """``"tiny"`` (seeded random demo model) or a Hugging Face style folder."""
    return ModelConfig.tiny() if model == TINY else ModelConfig.from_pretrained(model)


def weights_revision(model: str) -> str:
    """A revision id of the weights: the seed for ``tiny``, else sha256 of the safetensors files."""
    if model == TINY:
        return f"random-seed-{ModelConfig.tiny().seed}"
    h = hashlib.sha256()
    for path in sorted(pathlib.Path(model).glob("*.safetensors")):
        h.update(path.name.encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:32]


def namespace_for_model(model: str, block_tokens: int, *, tenant: str = "", salt: str = "") -> Namespace:
    """The namespace every engine and the conductor use for ``model``.

    The KV is float32 ``[num_layers, 2, block_tokens, num_kv_heads, head_dim]`` per block.
    """
    cfg = model_config(model)
    name = TINY if model == TINY else pathlib.Path(model).resolve().name
    return Namespace(model=name, revision=weights_revision(model), kv_dtype="float32",
                     num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, block_tokens=block_tokens, tenant=tenant, salt=salt)


def transfer_key(request_id: str, nonce: str, block: int | str) -> str:
    """A request-scoped key for KV handed from prefill to decode (not a cache entry)."""
    return f"xfer/{request_id}/{nonce}/{block}"


def is_transfer_key(key: str) -> bool:
    return key.startswith("xfer/")
