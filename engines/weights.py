"""Weights of a Llama-family decoder: seeded random, or read from a HF folder.

Both sources produce a state dict under Hugging Face parameter names and
shapes (``[out_features, in_features]`` for projections)::

    model.embed_tokens.weight                     [vocab, hidden]
    model.layers.{i}.input_layernorm.weight       [hidden]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.norm.weight                             [hidden]
    lm_head.weight                                [vocab, hidden] (absent when tied)

which :meth:`LlamaWeights.from_state_dict` turns into the execution layout:
float32, projections transposed to ``[in, out]`` and contiguous, Q/K/V fused
into one matrix and gate/up into another. The transposed layout matters for
decode: ``torch.bmm`` of one row against a contiguous ``[in, out]`` matrix
gives that row exactly the result of a one-row matmul, whatever the batch.

Random weights are a pure function of ``(cfg, cfg.seed, parameter name)``:
each tensor has its own ``torch.Generator`` seeded from a BLAKE2b digest of
the seed and the name, so every process (and every load order) gets the same
bytes for the same torch version.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import math
import os
from dataclasses import dataclass
from typing import Mapping

import torch

from kvstore.client.models import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer, execution layout (float32, ``[in, out]``)."""

    input_norm: torch.Tensor  # [hidden]
    qkv_t: torch.Tensor  # [hidden, (num_heads + 2 * num_kv_heads) * head_dim]; Q | K | V columns
    o_t: torch.Tensor  # [num_heads * head_dim, hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up_t: torch.Tensor  # [hidden, 2 * intermediate]; gate | up columns
    down_t: torch.Tensor  # [intermediate, hidden]


@dataclass(frozen=True, slots=True)
class LlamaWeights:
    """All weights of the decoder, execution layout."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: tuple[LayerWeights, ...]
    norm: torch.Tensor  # [hidden]
    lm_head_t: torch.Tensor  # [hidden, vocab]

    @classmethod
    def from_state_dict(cls, cfg: ModelConfig,
                        sd: Mapping[str, torch.Tensor]) -> "LlamaWeights":
        """Convert a HF-named state dict (any float dtype) to execution layout.

        Raises:
            ValueError: a parameter is missing or has the wrong shape.
        """
        hd, nh, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size

        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            if name not in sd:
                raise ValueError(f"weights lack {name}")
            t = sd[name]
            if tuple(t.shape) != shape:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, config says {shape}")
            return t.to(torch.float32)

        def t_(x: torch.Tensor) -> torch.Tensor:
            return x.t().contiguous()

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            q = get(p + "self_attn.q_proj.weight", (nh * hd, h))
            k = get(p + "self_attn.k_proj.weight", (kvh * hd, h))
            v = get(p + "self_attn.v_proj.weight", (kvh * hd, h))
            gate = get(p + "mlp.gate_proj.weight", (inter, h))
            up = get(p + "mlp.up_proj.weight", (inter, h))
            layers.append(LayerWeights(
                input_norm=get(p + "input_layernorm.weight", (h,)).contiguous(),
                qkv_t=t_(torch.cat([q, k, v], dim=0)),
                o_t=t_(get(p + "self_attn.o_proj.weight", (h, nh * hd))),
                post_norm=get(p + "post_attention_layernorm.weight", (h,)).contiguous(),
                gate_up_t=t_(torch.cat([gate, up], dim=0)),
                down_t=t_(get(p + "mlp.down_proj.weight", (h, inter))),
            ))
        embed = get("model.embed_tokens.weight", (vocab, h)).contiguous()
        if cfg.tie_word_embeddings:
            lm_head = embed
        elif "lm_head.weight" in sd:
            lm_head = get("lm_head.weight", (vocab, h))
        else:
            logger.warning("weights lack lm_head.weight: tying it to the embedding")
            lm_head = embed
        return cls(embed=embed, layers=tuple(layers),
                   norm=get("model.norm.weight", (h,)).contiguous(), lm_head_t=t_(lm_head))

    def fingerprint(self) -> str:
        """SHA-256 (hex) over every tensor's shape and bytes, in a fixed order.

        Suitable as the weights revision of a store namespace: equal iff the
        execution-layout weights are bit-identical.
        """
        h = hashlib.sha256()
        tensors = [self.embed, self.norm, self.lm_head_t]
        for lw in self.layers:
            tensors += [lw.input_norm, lw.qkv_t, lw.o_t, lw.post_norm, lw.gate_up_t, lw.down_t]
        for t in tensors:
            h.update(repr(tuple(t.shape)).encode())
            h.update(t.contiguous().numpy().tobytes())
        return h.hexdigest()


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def random_state_dict(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Seeded random weights under HF names (float32).

    Projections are ``N(0, 1 / in_features)`` and the embedding ``N(0, 1)``,
    so activations stay O(1) and greedy output depends on the whole context
    (a 0.02 init gives near-flat logits); norm weights are ``1 + N(0, 0.1)``.
    """
    hd, nh, kvh = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size

    def normal(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        t = torch.randn(shape, generator=_generator(cfg.seed, name), dtype=torch.float32)
        sd[name] = t * std + mean if mean else t * std

    sd: dict[str, torch.Tensor] = {}
    normal("model.embed_tokens.weight", (vocab, h), 1.0)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        normal(p + "input_layernorm.weight", (h,), 0.1, 1.0)
        normal(p + "self_attn.q_proj.weight", (nh * hd, h), 1 / math.sqrt(h))
        normal(p + "self_attn.k_proj.weight", (kvh * hd, h), 1 / math.sqrt(h))
        normal(p + "self_attn.v_proj.weight", (kvh * hd, h), 1 / math.sqrt(h))
        normal(p + "self_attn.o_proj.weight", (h, nh * hd), 1 / math.sqrt(nh * hd))
        normal(p + "post_attention_layernorm.weight", (h,), 0.1, 1.0)
        normal(p + "mlp.gate_proj.weight", (inter, h), 1 / math.sqrt(h))
        normal(p + "mlp.up_proj.weight", (inter, h), 1 / math.sqrt(h))
        normal(p + "mlp.down_proj.weight", (h, inter), 1 / math.sqrt(inter))
    normal("model.norm.weight", (h,), 0.1, 1.0)
    if not cfg.tie_word_embeddings:
        normal("lm_head.weight", (vocab, h), 1 / math.sqrt(h))
    return sd


def load_safetensors(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read every ``*.safetensors`` file in ``folder`` into one state dict.

    Raises:
        FileNotFoundError: the folder holds no safetensors file.
        ValueError: two files hold the same parameter.
    """
    from safetensors.torch import load_file

    paths = sorted(glob.glob(os.path.join(os.fspath(folder), "*.safetensors")))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    sd: dict[str, torch.Tensor] = {}
    for path in paths:
        part = load_file(path, device="cpu")
        dup = sd.keys() & part.keys()
        if dup:
            raise ValueError(f"{path} repeats {sorted(dup)[:3]}")
        sd.update(part)
    logger.info("loaded %d tensors from %d safetensors file(s) in %s", len(sd), len(paths), folder)
    return sd
