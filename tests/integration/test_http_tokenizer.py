"""The HTTP front with a model folder's own tokenizer, driven by the official ``openai`` client.

The test builds a Hugging Face style folder offline (a byte-level BPE trained
with ``tokenizers``, a chat template in tokenizer_config.json, a small random
Llama in safetensors) and starts a local cluster on it. Through
``completions.create(prompt="text")`` and ``chat.completions.create(...)``
the text that comes back, streamed or not, must equal the tokenizer's decode
of a plain single-process greedy run of the same model on the same prompt
ids, and generation must end at the folder's EOS / generation_config ids.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys

import grpc
import pytest

openai = pytest.importorskip("openai")
tokenizers = pytest.importorskip("tokenizers")

from hf_folder import write_model, write_tokenizer
from kvstore.engines.generate import greedy_generate
from kvstore.engines.model import LlamaModel
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.tools.cluster.launcher import ClusterSpec, LocalCluster

BLOCK_TOKENS = 16
NAME = "toy"
TEXT = "KV caches are for reuse: the quick brown fox ☕"
STOP_TEXT = "Prefill computes the prompt, decode writes"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello! How are you today?"}]


class Folder:
    """The model folder and what the test knows of it independently of the front."""

    def __init__(self, path):
        self.path = path
        self.raw = write_tokenizer(path)                # tokenizers.Tokenizer
        self.cfg = write_model(path, self.raw.get_vocab_size(with_added_tokens=True))
        self.model = LlamaModel.from_pretrained(path)
        self.bos, self.eos = self.raw.token_to_id("<s>"), self.raw.token_to_id("</s>")
        # One more stop id, as generation_config.json files list: a token the
        # model produces 4th for STOP_TEXT (and not before), so a request ends early.
        full = self.greedy(self.encode(STOP_TEXT), 8, stops=())
        self.extra_stop = next(t for k, t in enumerate(full) if k >= 3 and t not in full[:k])
        self.stop_at = full.index(self.extra_stop) + 1
        (path / "generation_config.json").write_text(json.dumps(
            {"eos_token_id": [self.eos, self.extra_stop]}))
        self.stops = (self.eos, self.extra_stop)

    def encode(self, text: str) -> list[int]:
        return [self.bos] + self.raw.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.raw.decode(ids, skip_special_tokens=True)

    def greedy(self, prompt: list[int], max_tokens: int, stops=None) -> list[int]:
        """The reference: a plain greedy run, cut after the first stop token."""
        out = greedy_generate(self.model, prompt, max_tokens, page_tokens=BLOCK_TOKENS)
        for k, t in enumerate(out):
            if t in (self.stops if stops is None else stops):
                return out[:k + 1]
        return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return Folder(tmp_path_factory.mktemp("toy-model"))


@pytest.fixture(scope="module")
def cluster(folder, tmp_path_factory):
    spec = ClusterSpec(model=str(folder.path), node_dram="64MiB", kv_pages=256,
                       block_tokens=BLOCK_TOKENS, http_port=0,
                       log_dir=str(tmp_path_factory.mktemp("http-tokenizer-logs")),
                       conductor_args=("--served-model-name", NAME, "--probe-interval-s", "0.2"))
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    c = openai.OpenAI(base_url=f"http://{cluster.http}/v1", api_key="dummy", max_retries=0,
                      timeout=30.0)
    yield c
    c.close()


def test_text_completion_equals_decoded_greedy(client, folder):
    prompt = folder.encode(TEXT)
    ref = folder.greedy(prompt, 8)
    r = client.completions.create(model=NAME, prompt=TEXT, max_tokens=8)
    (c,) = r.choices
    assert c.model_extra["token_ids"] == ref
    assert c.text == folder.decode(ref) and c.text
    assert r.usage.prompt_tokens == len(prompt)
    assert c.finish_reason == ("stop" if ref[-1] in folder.stops else "length")

    chunks = list(client.completions.create(model=NAME, prompt=TEXT, max_tokens=8, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    assert sum((ch.choices[0].model_extra["token_ids"] for ch in chunks), []) == ref


def test_token_ids_and_text_prompts_agree(client, folder):
    prompt = folder.encode(TEXT)
    by_ids = client.completions.create(model=NAME, prompt=prompt, max_tokens=6)
    by_text = client.completions.create(model=NAME, prompt=TEXT, max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.choices[0].model_extra["token_ids"] == by_text.choices[0].model_extra["token_ids"]


def test_chat_completion_equals_decoded_greedy(client, folder):
    from kvstore.conductor.hf_tokenizer import HfTokenizer

    prompt = HfTokenizer.from_folder(folder.path).chat_prompt(MESSAGES)
    assert prompt[:2] == [folder.bos, folder.raw.token_to_id("<|system|>")]
    ref = folder.greedy(prompt, 10)
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=10)
    (c,) = r.choices
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert c.message.role == "assistant"
    assert c.message.content == folder.decode(ref) and c.message.content
    assert c.model_extra["token_ids"] == ref
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), len(ref))
    assert c.finish_reason == ("stop" if ref[-1] in folder.stops else "length")

    chunks = list(client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_completion_tokens=10, stream=True,
        stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == \
        c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref) and not chunks[-1].choices


def test_stop_token_ends_generation(client, folder):
    ref = folder.greedy(folder.encode(STOP_TEXT), 8)
    assert len(ref) == folder.stop_at < 8 and ref[-1] == folder.extra_stop
    r = client.completions.create(model=NAME, prompt=STOP_TEXT, max_tokens=8)
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == folder.decode(ref)
    assert r.choices[0].model_extra["metrics"]["output_tokens"] == len(ref)


def test_grpc_stop_token_ids(cluster, folder):
    """The conductor's Generate stops after a stop id from decode, and after the first
    token when that one is a stop id (no decode at all)."""
    prompt = folder.encode(TEXT)
    full = folder.greedy(prompt, 6, stops=())

    async def generate(stops) -> list[int]:
        async with grpc.aio.insecure_channel(cluster.conductor) as ch:
            out = []
            async for chunk in spb_grpc.ConductorStub(ch).Generate(spb.GenerateRequest(
                    request_id=f"stop-{stops}", prompt_tokens=prompt, max_tokens=6,
                    stop_token_ids=stops), timeout=30):
                assert not chunk.error
                out += chunk.tokens
            return out

    assert asyncio.run(generate([full[0]])) == full[:1]
    k = next((k for k in range(1, 6) if full[k] not in full[:k]), None)
    if k is not None:
        assert asyncio.run(generate([full[k]])) == full[:k + 1]


def test_chat_errors_are_400(client):
    with pytest.raises(openai.BadRequestError, match="only text parts"):
        client.chat.completions.create(model=NAME, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url",
                                          "image_url": {"url": "http://example.com/a.png"}}]}])
    with pytest.raises(openai.BadRequestError, match="'tools' is not supported"):
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2,
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(openai.BadRequestError, match="refused the conversation"):
        client.chat.completions.create(model=NAME, max_tokens=2,
                                       messages=[{"role": "developer", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=MESSAGES)


def test_folder_without_tokenizer_fails_at_startup(folder, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(folder.path / "config.json", bare / "config.json")
    for cmd in (["conductor", "--master", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
                 "--decode", "127.0.0.1:3", "--model", str(bare), "--http-port", "0"],
                ["http", "--conductor", "127.0.0.1:1", "--model", str(bare)]):
        p = subprocess.run([sys.executable, "-m", "kvstore.tools.cli.services", *cmd],
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        assert "has no tokenizer.json" in p.stderr and "Traceback" not in p.stderr
