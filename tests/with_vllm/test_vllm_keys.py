"""Key namespacing of the vLLM connector (no vLLM needed): requests that differ
in cache_salt, LoRA name, revision, block size or TP rank share no block key;
equal ones get equal keys in every process."""

import dataclasses
import json
import subprocess
import sys

import pytest

from kvstore.client.integrations.vllm.keys import (EngineIdentity, kv_transfer_config,
                                                   matched_blocks, request_keys)

IDENT = EngineIdentity(model="tiny", revision="r1", kv_dtype="float32", num_layers=2,
                       num_kv_heads=2, head_dim=32, block_size=32)
TOKENS = list(range(7, 7 + 32 * 4))


def test_equal_inputs_equal_keys_and_full_blocks_only():
    a = request_keys(IDENT, TOKENS + [1, 2, 3])
    assert a == request_keys(IDENT, TOKENS)
    assert len(a) == 4 and len(set(a)) == 4


@pytest.mark.parametrize("other", [
    dict(cache_salt="user-b"), dict(lora_name="adapter-1"), dict(revision="r2"),
    dict(tp_rank=1, tp_size=2), dict(block_size=64), dict(kv_dtype="bfloat16"),
    dict(model="tiny-2"), dict(tenant="t1"),
])
def test_any_namespace_difference_shares_no_block(other):
    req = {k: other.pop(k) for k in ("cache_salt", "lora_name") if k in other}
    ident = dataclasses.replace(IDENT, **other) if other else IDENT
    base = set(request_keys(IDENT, TOKENS))
    assert not base & set(request_keys(ident, TOKENS, **req))


def test_keys_do_not_depend_on_python_hash_seed():
    code = ("from kvstore.client.integrations.vllm.keys import EngineIdentity, request_keys;"
            f"print(request_keys(EngineIdentity(**{dataclasses.asdict(IDENT)!r}), {TOKENS!r}, 'l', 's')[-1])")
    outs = {subprocess.run([sys.executable, "-c", code], env={"PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True).stdout
            for seed in ("1", "2")}
    assert outs == {request_keys(IDENT, TOKENS, "l", "s")[-1] + "\n"}


def test_matched_blocks_stops_at_first_hole():
    assert matched_blocks([True, True, False, True]) == 2
    assert matched_blocks([]) == 0


def test_vllm_config_command_prints_the_config():
    out = subprocess.run([sys.executable, "-m", "kvstore.tools.cli.cli", "vllm-config", "--master",
                          "127.0.0.1:7000", "--role", "kv_consumer"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == kv_transfer_config("127.0.0.1:7000", "kv_consumer")
    assert (json.loads(out)["kv_connector_module_path"]
            == "kvstore.client.integrations.vllm.connector")
    with pytest.raises(ValueError):
        kv_transfer_config("x:1", "both")


def test_importing_the_client_does_not_import_vllm():
    code = ("import sys, kvstore.client, kvstore.client.integrations.vllm.keys; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
