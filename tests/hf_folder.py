"""Helpers shared by the tokenizer tests: a Hugging Face style model folder built offline.

Importable from every test module as ``hf_folder`` (``tests/`` is on ``sys.path``).
:func:`write_tokenizer` trains a small byte-level BPE with the ``tokenizers``
library on a few sentences and saves ``tokenizer.json`` and
``tokenizer_config.json`` (BOS/EOS, ``add_bos_token``, a chat template);
:func:`write_model` adds ``config.json`` and seeded random weights
(``model.safetensors``) of a small Llama whose vocabulary is the tokenizer's.
No hub access anywhere.
"""

from __future__ import annotations

import json
import pathlib

SPECIAL = ["<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "KV caches are for reuse: a prefix computed once is read many times.",
    "Mooncake keeps the attention state of prompts in a distributed store.",
    "Prefill computes the prompt, decode writes one token at a time.",
    "café, naïve, 日本語, emoji ☕ and 🚀 are text too.",
    "Hello! How are you today? I am fine, thank you.",
]

#: A chat template in the style of Zephyr/TinyLlama: role tags, EOS after each turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tokenizer(folder: pathlib.Path, chat_template: str | None = CHAT_TEMPLATE,
                    vocab_size: int = 400, **config) -> "object":
    """Train and save a tokenizer in ``folder``; returns the ``tokenizers.Tokenizer``.

    ``config`` entries are added to tokenizer_config.json (None removes one).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # As Llama folders do: the post-processor adds BOS, and add_bos_token says so too.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
           "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
           "add_eos_token": False, "model_max_length": 512}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    cfg.update(config)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return tok


def write_model(folder: pathlib.Path, vocab_size: int, seed: int = 0):
    """Save ``config.json`` and ``model.safetensors`` of a small random Llama; returns
    its :class:`kvstore.client.models.ModelConfig`."""
    from safetensors.torch import save_file

    from kvstore.client.models import ModelConfig
    from kvstore.engines.weights import random_state_dict

    folder.mkdir(parents=True, exist_ok=True)
    hf = {"model_type": "llama", "architectures": ["LlamaForCausalLM"],
          "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 512,
          "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
          "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(hf, indent=1))
    cfg = ModelConfig.from_hf_dict(hf)
    cfg = ModelConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "seed": seed})
    save_file({k: v.contiguous() for k, v in random_state_dict(cfg).items()},
              str(folder / "model.safetensors"))
    return cfg
