"""A vLLM run that publishes KV events, for the connector's events test.

    python vllm_events_run.py MODEL_DIR PROMPT_IDS_JSON KV_TRANSFER_JSON KV_EVENTS_JSON DIR

Runs one greedy request of the prompt (the connector saves its full blocks),
writes DIR/ready, waits for DIR/go (the test evicts and removes blocks in the
store meanwhile), then keeps the engine stepping with short requests (no full
block: nothing more to save) so vLLM collects the connector's events each step,
until DIR/stop exists. Runs with the vLLM environment's interpreter.
"""

import json
import sys
import time
from pathlib import Path

from vllm_run import engine_args


def _wait(path: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            sys.exit(f"no {path} within {timeout_s} s")
        time.sleep(0.02)


def main() -> None:
    model_dir, prompt = Path(sys.argv[1]), json.loads(sys.argv[2])
    kv, events, run_dir = json.loads(sys.argv[3]), json.loads(sys.argv[4]), Path(sys.argv[5])
    args = engine_args(model_dir)
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(**args, kv_transfer_config=KVTransferConfig(**kv),
              kv_events_config=KVEventsConfig(**events))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    (run_dir / "ready").write_text("ready")
    _wait(run_dir / "go")
    deadline = time.monotonic() + 300
    i = 0
    while not (run_dir / "stop").exists() and time.monotonic() < deadline:
        i += 1
        llm.generate([TokensPrompt(prompt_token_ids=[3 + i % 400, 5, 7])],
                     SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
