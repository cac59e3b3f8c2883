"""/v1/chat/completions bodies (kvstore.conductor.chat): parsing, the template's prompt, 400s."""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from hf_folder import write_tokenizer
from kvstore.conductor.chat import DEFAULT_MAX_TOKENS, MAX_MESSAGES, ChatShape, parse_chat
from kvstore.conductor.hf_tokenizer import HfTokenizer
from kvstore.conductor.http import ByteTokenizer, HttpError

USER = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat-tok")
    write_tokenizer(d)
    return HfTokenizer.from_folder(d)


def _body(**kw):
    return {"model": "toy", "messages": USER, **kw}


def test_parse_chat(tok):
    r = parse_chat(_body(max_tokens=5, stream=True, stream_options={"include_usage": True},
                         temperature=0.7, seed=3, user="u"), "toy", tok, max_model_len=512)
    assert r.chat and r.prompts == (tuple(tok.chat_prompt(USER)),)
    assert (r.max_tokens, r.stream, r.include_usage) == (5, True, True)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                          {"type": "text", "text": "lo!"}]}]
    assert parse_chat(_body(messages=parts), "toy", tok).prompts == \
        (tuple(tok.chat_prompt([{"role": "user", "content": "Hel\nlo!"}])),)
    assert parse_chat(_body(max_completion_tokens=3), "toy", tok).max_tokens == 3


def test_default_max_tokens_fits_the_context(tok):
    n = len(tok.chat_prompt(USER))
    assert parse_chat(_body(), "toy", tok, max_model_len=4096).max_tokens == DEFAULT_MAX_TOKENS
    assert parse_chat(_body(), "toy", tok, max_model_len=n + 3).max_tokens == 3
    with pytest.raises(HttpError, match=f"too long: {n} tokens; the model's context is {n} "
                                        "tokens") as e:
        parse_chat(_body(), "toy", tok, max_model_len=n)
    assert (e.value.status, e.value.param, e.value.code) == \
        (400, "messages", "context_length_exceeded")
    for name in ("max_tokens", "max_completion_tokens"):      # given: refused, not cut
        with pytest.raises(HttpError, match="at most 3") as e:
            parse_chat(_body(**{name: 4}), "toy", tok, max_model_len=n + 3)
        assert (e.value.status, e.value.param, e.value.code) == \
            (400, name, "context_length_exceeded")


@pytest.mark.parametrize("body, status, match", [
    ({"messages": USER}, 400, "'model'"),
    (_body(model="other"), 404, "not served"),
    (_body(messages=[]), 400, "non-empty list"),
    (_body(messages="hi"), 400, "non-empty list"),
    (_body(messages=["hi"]), 400, r"messages\[0\] must be an object"),
    (_body(messages=[{"role": "wizard", "content": "x"}]), 400, "role must be one of"),
    (_body(messages=[{"role": "user", "content": 5}]), 400, "content must be a string"),
    (_body(messages=[{"role": "user", "content": None}]), 400, "content must be a string"),
    (_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, "only text parts"),
    (_body(messages=[{"role": "user", "content": "x", "tool_calls": []}]), 400, "tool_calls"),
    (_body(messages=[{"role": "user", "content": "x", "name": 3}]), 400, "name must be"),
    (_body(messages=USER * (MAX_MESSAGES + 1)), 400, "at most"),
    (_body(messages=[{"role": "tool", "content": "x"}]), 400, "refused the conversation"),
    (_body(tools=[{"type": "function"}]), 400, "'tools' is not supported"),
    (_body(n=2), 400, "'n'"),
    (_body(logprobs=True), 400, "'logprobs'"),
    (_body(stop="\n"), 400, "'stop'"),
    (_body(response_format={"type": "json_object"}), 400, "response_format"),
    (_body(max_tokens=0), 400, "max_tokens"),
    (_body(max_completion_tokens=1.5), 400, "max_completion_tokens"),
    (_body(max_tokens=2, max_completion_tokens=2), 400, "not both"),
    (_body(stream="yes"), 400, "'stream'"),
    (_body(temperature="hot"), 400, "'temperature' must be a number in"),
    (_body(top_p=-0.5), 400, "'top_p'"),
    (_body(seed="1"), 400, "'seed'"),
    (_body(stop=7), 400, "'stop' must be a string"),
    (_body(messages=[{"role": "user", "content": "\ud800"}]), 400, "valid Unicode"),
    ([1, 2], 400, "JSON object"),
])
def test_parse_chat_rejects(tok, body, status, match):
    with pytest.raises(HttpError, match=match) as e:
        parse_chat(body, "toy", tok)
    assert e.value.status == status


def test_no_chat_template_is_400(tmp_path):
    write_tokenizer(tmp_path, chat_template=None)
    for tokenizer in (HfTokenizer.from_folder(tmp_path), ByteTokenizer(2048)):
        with pytest.raises(HttpError, match="no chat template") as e:
            parse_chat(_body(), "toy", tokenizer)
        assert (e.value.status, e.value.code) == (400, "no_chat_template")


def test_chat_shapes():
    s = ChatShape()
    assert s.choice(0, "hi", [1], "stop", None) == {
        "index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
        "finish_reason": "stop", "token_ids": [1]}
    assert s.chunk_choice(0, "", [], "length", None)["delta"] == {}
    assert s.first_chunk(1)["delta"] == {"role": "assistant", "content": ""}
