"""Several requests in one vLLM run, for the async-load tests (vllm_run.py runs one).

    python vllm_batch_run.py MODEL_DIR OUT_JSON PROMPTS_JSON [KV_TRANSFER_CONFIG_JSON]

PROMPTS_JSON is a list of token-id lists, all submitted at once (one
``generate``). OUT_JSON gets, per request in order, the output token ids, the
finish reason and vLLM's num_cached_tokens, plus the summed "KV Transfer
metrics" as vllm_run.py writes them. $MAX_TOKENS, $READY_FILE and $GO_FILE
as in vllm_run.py; with $SECOND_PROMPTS_JSON, a second ``generate`` of those
prompts follows in the same engine (its outputs in ``second``).
"""

import json
import os
import sys
from pathlib import Path

from vllm_run import start_engine


def main() -> None:
    model_dir, out, prompts = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    kv = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None
    llm, params, metrics = start_engine(model_dir, kv)
    from vllm.inputs import TokensPrompt

    def generate(batch):
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                           use_tqdm=False)
        return [{"token_ids": list(r.outputs[0].token_ids),
                 "finish_reason": r.outputs[0].finish_reason,
                 "num_cached_tokens": r.num_cached_tokens} for r in res]

    result = {"outputs": generate(prompts)}
    second = os.environ.get("SECOND_PROMPTS_JSON")
    if second:
        result["second"] = generate(json.loads(second))
    if kv:
        llm.llm_engine.do_log_stats()
    result["kv_transfer_metrics"] = metrics.sums
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
