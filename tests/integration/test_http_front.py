"""The OpenAI-compatible HTTP front, driven by the official ``openai`` client.

A local cluster (master, 2 store nodes, prefill, decode, conductor with its
HTTP front on a free loopback port) must give, through ``/v1/completions``,
exactly the tokens of a plain single-process greedy run of the same model,
streamed or not, for token-id and text prompts; and exactly what the
conductor's gRPC ``Generate`` gives. Errors come back in OpenAI's shape with
the right status: 404 unknown model or path, 400 bad input (wrong types, a
prompt too long for the context), 413 body too large, 429 early rejection
(SLO), 503 no live engine; a busy HTTP port ends the conductor with one line.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

openai = pytest.importorskip("openai")

from kvstore.conductor.http import ByteTokenizer
from kvstore.engines.generate import greedy_generate
from kvstore.engines.model import LlamaModel
from kvstore.client.models import model_config
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.conductor.openai_schema import MAX_BODY_BYTES
from kvstore.tools.cluster.launcher import ClusterSpec, LocalCluster
from kvstore.tools.cluster.processes import ProcessGroup, service_args
from waits import wait_until

BLOCK_TOKENS = 16
TOK = ByteTokenizer(model_config("tiny").vocab_size)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = ClusterSpec(node_dram="64MiB", kv_pages=256, block_tokens=BLOCK_TOKENS, http_port=0,
                       log_dir=str(tmp_path_factory.mktemp("http-front-logs")),
                       conductor_args=("--probe-interval-s", "0.2"))
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    # max_retries=0: a 429 or 503 must reach the test, not be retried away.
    c = openai.OpenAI(base_url=f"http://{cluster.http}/v1", api_key="dummy", max_retries=0,
                      timeout=30.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model():
    return LlamaModel.random(model_config("tiny"))


def _reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    return greedy_generate(model, prompt, max_tokens, page_tokens=BLOCK_TOKENS)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(TOK.vocab_size) for _ in range(n)]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _post(url: str, body: bytes, method: str = "POST") -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of a raw request."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _is_openai_error(body: dict) -> bool:
    err = body.get("error")
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err) and \
        isinstance(err["message"], str) and err["message"]


def _stream(client, **kwargs) -> tuple[list[int], str, list]:
    """(token ids, text, chunks) of a streamed completion."""
    chunks = list(client.completions.create(stream=True, **kwargs))
    ids: list[int] = []
    text = ""
    for ch in chunks:
        for c in ch.choices:
            ids += c.model_extra["token_ids"]
            text += c.text
    return ids, text, chunks


@pytest.mark.parametrize("n_prompt", [5, 37])
def test_token_prompt_equals_greedy(client, model, n_prompt):
    prompt = _ids(n_prompt, seed=n_prompt)
    ref = _reference(model, prompt, 6)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6)
    (c,) = r.choices
    assert c.model_extra["token_ids"] == ref
    assert c.text == TOK.decode(ref)
    assert c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 6)
    assert r.object == "text_completion" and r.model == "tiny"

    ids, text, chunks = _stream(client, model="tiny", prompt=prompt, max_tokens=6,
                                stream_options={"include_usage": True})
    assert ids == ref and text == c.text
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    assert [c.finish_reason for ch in chunks for c in ch.choices][-1] == "length"


def test_text_prompt_equals_greedy(client, model):
    text = "KV caches are for reuse, café ☕"
    prompt = TOK.encode(text)
    assert TOK.decode(prompt) == text
    ref = _reference(model, prompt, 5)
    r = client.completions.create(model="tiny", prompt=text, max_tokens=5)
    assert r.choices[0].model_extra["token_ids"] == ref
    assert r.usage.prompt_tokens == len(prompt)
    ids, streamed_text, _ = _stream(client, model="tiny", prompt=text, max_tokens=5)
    assert ids == ref and streamed_text == r.choices[0].text


def test_equals_conductor_grpc(cluster, client):
    prompt = _ids(40, seed=7)

    async def grpc_tokens() -> list[int]:
        async with grpc.aio.insecure_channel(cluster.conductor) as ch:
            out = []
            async for chunk in spb_grpc.ConductorStub(ch).Generate(spb.GenerateRequest(
                    request_id="grpc-ref", prompt_tokens=prompt, max_tokens=7), timeout=30):
                assert not chunk.error
                out += chunk.tokens
            return out

    via_grpc = asyncio.run(grpc_tokens())
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=7)
    assert r.choices[0].model_extra["token_ids"] == via_grpc and len(via_grpc) == 7


def test_batch_of_prompts(client, model):
    prompts = [_ids(3, seed=1), _ids(20, seed=2)]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=3)
    got = {c.index: c.model_extra["token_ids"] for c in r.choices}
    assert got == {i: _reference(model, p, 3) for i, p in enumerate(prompts)}
    ids_by_index: dict[int, list[int]] = {0: [], 1: []}
    for ch in client.completions.create(model="tiny", prompt=prompts, max_tokens=3, stream=True):
        for c in ch.choices:
            ids_by_index[c.index] += c.model_extra["token_ids"]
    assert ids_by_index == got


def test_models_and_health(cluster, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    status, body = _get(f"http://{cluster.http}/health")
    assert status == 200 and body["status"] == "ok"
    assert {w["role"] for w in body["workers"]} == {"prefill", "decode"}


def test_bad_requests(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="tiny", prompt=[1, TOK.vocab_size], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="'n'"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, n=2)
    # The demo model has the byte tokenizer: no chat format to render messages with.
    with pytest.raises(openai.BadRequestError, match="no chat template") as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "no_chat_template"


def test_prompt_longer_than_the_context_is_400(client):
    limit = model_config("tiny").max_position_embeddings
    for prompt in ([1] * (limit + 1), "a" * (limit + 904)):       # token ids, text (bytes)
        with pytest.raises(openai.BadRequestError, match=f"too long.*context is {limit} tokens") as e:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError, match=f"context is {limit} tokens") as e:
        _stream(client, model="tiny", prompt=[1] * (limit - 4), max_tokens=8)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"


@pytest.mark.parametrize("field, value", [
    ("temperature", "hot"), ("temperature", 2.5), ("temperature", -0.1), ("temperature", True),
    ("top_p", 1.5), ("presence_penalty", -3), ("seed", "7"), ("user", 5),
    ("max_tokens", "4"), ("max_tokens", -1), ("stop", 5), ("stop", {"a": "b"}),
    ("stop", [1]), ("stream", "yes"),
])
def test_wrong_types_are_400_naming_the_field(cluster, field, value):
    for route, base in (("completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1}),
                        ("chat/completions", {"model": "tiny", "messages": [
                            {"role": "user", "content": "hi"}], "max_tokens": 1})):
        status, body, _ = _post(f"http://{cluster.http}/v1/{route}",
                                json.dumps({**base, field: value}).encode())
        assert status == 400 and _is_openai_error(body), (route, field, value, body)
        assert body["error"]["param"] == field and f"'{field}'" in body["error"]["message"]
        assert body["error"]["type"] == "invalid_request_error"


def test_aiohttp_errors_are_openai_json(cluster):
    url = f"http://{cluster.http}"
    status, body, _ = _post(f"{url}/v1/completions", b'{"model": "tiny", "prompt": "'
                            + b"a" * (MAX_BODY_BYTES + 1024) + b'"}')
    assert status == 413 and _is_openai_error(body), body
    assert str(MAX_BODY_BYTES) in body["error"]["message"]
    status, body, _ = _post(f"{url}/v1/nothing-here", b"{}")
    assert status == 404 and _is_openai_error(body), body
    status, body, headers = _post(f"{url}/v1/completions", None, method="GET")
    assert status == 405 and _is_openai_error(body) and headers["Allow"] == "POST", body
    r = urllib.request.urlopen(f"{url}/health", timeout=10)      # the front still serves
    assert r.status == 200


def test_early_rejection_is_429(cluster, tmp_path):
    """A conductor whose TTFT SLO no request can meet refuses at arrival: 429 with
    Retry-After, the reason in the message (the only 429 the front answers)."""
    routes = [a for pair in ((f"--{r}", f"{r}0={cluster.process(f'{r}0').address}")
                             for r in ("prefill", "decode")) for a in pair]
    with ProcessGroup(log_dir=str(tmp_path)) as group:
        slo = group.start("slo-conductor", service_args(
            "conductor", "--master", cluster.master, "--block-tokens", str(BLOCK_TOKENS),
            *routes, "--http-port", "0", "--ttft-slo-ms", "0.001"), timeout_s=120)
        status, body, headers = _post(f"http://{slo.info['http_address']}/v1/completions",
                                      json.dumps({"model": "tiny", "prompt": [1, 2, 3],
                                                  "max_tokens": 2}).encode())
    assert status == 429 and _is_openai_error(body), body
    assert "TTFT" in body["error"]["message"] and headers.get("Retry-After") == "1"


def test_a_busy_http_port_is_one_line_and_status_2(cluster):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for service, args in (
                ("conductor", ["--master", cluster.master, "--prefill", "127.0.0.1:9",
                               "--decode", "127.0.0.1:9", "--http-port", str(port)]),
                ("http", ["--conductor", cluster.conductor, "--port", str(port)])):
            r = subprocess.run([sys.executable, *service_args(service, *args)],
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 2, (service, r.returncode, r.stderr)
            assert r.stderr.strip().splitlines() == [
                f"kvstore {service}: error: HTTP front: cannot listen on 127.0.0.1:{port}: "
                f"address already in use"], r.stderr


def test_no_live_prefill_is_503(cluster, client):
    """Last in the module: it kills the only prefill engine."""
    os.kill(cluster.process("prefill0").proc.pid, signal.SIGKILL)
    wait_until(lambda: _get(f"http://{cluster.http}/health")[0] == 503, interval_s=0.1,
               what="/health to drop the dead prefill engine (503)")
    for call in (client.completions.create, lambda **kw: _stream(client, **kw)):
        with pytest.raises(openai.InternalServerError, match="no live prefill instance") as e:
            call(model="tiny", prompt="hi", max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "unavailable"
        assert e.value.type == "service_unavailable"
