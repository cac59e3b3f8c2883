"""Models and their KV namespaces: :class:`ModelConfig`, :func:`namespace_for_model`.

One frozen record says everything the engines need to build a Llama-family
decoder and to size its paged KV cache, and everything the conductor and the
engines need to name its KV blocks in the store. It is read from a Hugging
Face ``config.json`` (``LlamaConfig`` fields) or built in code
(:meth:`ModelConfig.tiny`, the demo model sized for a 2-core CPU). It lives
in the SDK, below the engines and the conductor, because both compute the
same prefix keys from it.

Only the plain Llama architecture is supported: no attention or MLP biases,
SiLU activation, the default RoPE (no scaling). A config that asks for anything
else is refused with ``ValueError`` rather than run with the wrong math.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore.keys import Namespace

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    Attributes:
        vocab_size: number of token ids.
        hidden_size: width of the residual stream.
        intermediate_size: width of the SwiGLU MLP.
        num_layers: decoder layers.
        num_heads: query heads per layer.
        num_kv_heads: key/value heads per layer (grouped-query attention;
            ``num_heads`` is a multiple of it).
        head_dim: width of one attention head.
        rope_theta: RoPE base frequency.
        rms_norm_eps: epsilon of every RMSNorm.
        max_position_embeddings: longest sequence, in tokens (sizes the RoPE table).
        tie_word_embeddings: the LM head reuses the token embedding matrix.
        seed: seed of :meth:`kvstore.engines.model.LlamaModel.random` (unused for
            loaded weights).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of KV one token occupies across all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def tiny(cls, seed: int = 0) -> "ModelConfig":
        """The demo model: about 3.5 M parameters, fast on a 2-core CPU.

        A KV page of 16 tokens is ``[4, 2, 16, 2, 32]`` float32 = 32 KiB.
        """
        return cls(vocab_size=2048, hidden_size=256, intermediate_size=704, num_layers=4,
                   num_heads=8, num_kv_heads=2, head_dim=32, rope_theta=10000.0,
                   rms_norm_eps=1e-6, max_position_embeddings=4096,
                   tie_word_embeddings=False, seed=seed)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        """Build from the fields of a Hugging Face ``LlamaConfig`` (``config.json``).

        Reads both the transformers 4.x layout (``rope_theta``, ``rope_scaling``)
        and the 5.x one (``rope_parameters: {rope_type, rope_theta}``).

        Raises:
            ValueError: the config asks for something this decoder does not do
                (biases, another activation, RoPE scaling) or misses a field.
        """
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            logger.warning("config model_type=%s: reading it as a plain Llama", model_type)
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias are not supported")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported (silu only)")
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type={rope_type!r} is not supported (default only)")
        rope_theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        try:
            num_heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden // num_heads),
                rope_theta=float(rope_theta),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            )
        except KeyError as e:
            raise ValueError(f"config.json lacks field {e.args[0]!r}") from None

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike[str]) -> "ModelConfig":
        """Read ``folder/config.json`` (see :meth:`from_hf_dict`)."""
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            return cls.from_hf_dict(json.load(f))


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
