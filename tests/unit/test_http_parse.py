"""Tests for kvstore.conductor.http request parsing, errors and the byte tokenizer (no network)."""

from __future__ import annotations

import pytest

from kvstore.conductor.http import ByteTokenizer, HttpError, failure_of, parse_completion
from kvstore._proto import serving_pb2 as spb

TOK = ByteTokenizer(2048)


@pytest.mark.parametrize("text", ["", "plain ascii", "café ☕ 日本語", "\x00\x7f"])
def test_byte_tokenizer_round_trip(text):
    assert TOK.decode(TOK.encode(text)) == text


def test_stream_decoder_joins_split_characters_and_marks_other_ids():
    ids = TOK.encode("é☕") + [300] + TOK.encode("x")
    d = TOK.stream_decoder()
    pieces = [d.feed([t]) for t in ids] + [d.flush()]
    assert "".join(pieces) == TOK.decode(ids) == "é☕<|300|>x"
    assert pieces[0] == ""          # half of "é" is not text yet


def test_parse_prompt_forms():
    def prompts(p):
        return parse_completion({"model": "tiny", "prompt": p}, "tiny", TOK).prompts
    assert prompts("ab") == ((97, 98),)
    assert prompts([1, 2]) == ((1, 2),)
    assert prompts(["a", "b"]) == ((97,), (98,))
    assert prompts([[1], [2, 3]]) == ((1,), (2, 3))
    r = parse_completion({"model": "tiny", "prompt": "a", "stream": True,
                          "stream_options": {"include_usage": True}}, "tiny", TOK)
    assert (r.max_tokens, r.stream, r.include_usage) == (16, True, True)


@pytest.mark.parametrize("body, status, match", [
    ({"prompt": "a"}, 400, "'model'"),
    ({"model": "other", "prompt": "a"}, 404, "not served"),
    ({"model": "tiny", "prompt": ""}, 400, "at least one token"),
    ({"model": "tiny", "prompt": []}, 400, "'prompt'"),
    ({"model": "tiny", "prompt": [2048]}, 400, "outside the vocabulary"),
    ({"model": "tiny", "prompt": [True]}, 400, "only strings"),
    ({"model": "tiny", "prompt": ["a", [1.5]]}, 400, "only strings"),
    ({"model": "tiny", "prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "a", "n": 3}, 400, "'n'"),
    ({"model": "tiny", "prompt": "a", "stop": ["\n"]}, 400, "'stop'"),
])
def test_parse_rejects(body, status, match):
    with pytest.raises(HttpError, match=match) as e:
        parse_completion(body, "tiny", TOK)
    assert e.value.status == status
    assert e.value.body()["error"]["message"] == str(e.value)


@pytest.mark.parametrize("field, value", [
    ("temperature", "hot"), ("temperature", 2.01), ("temperature", -1), ("temperature", True),
    ("temperature", float("nan")), ("temperature", [1]), ("top_p", 1.5), ("top_p", "x"),
    ("frequency_penalty", 2.5), ("presence_penalty", -2.5), ("seed", 1.5), ("seed", "7"),
    ("user", 5), ("max_tokens", "4"), ("max_tokens", -3), ("max_tokens", 2.0),
    ("stop", 5), ("stop", {"a": 1}), ("stop", [None]), ("stream", 1), ("stream", 0),
    ("stream_options", 0), ("stream_options", {"include_usage": "yes"}),
])
def test_wrong_types_name_the_field(field, value):
    with pytest.raises(HttpError) as e:
        parse_completion({"model": "tiny", "prompt": "a", field: value}, "tiny", TOK)
    assert (e.value.status, e.value.param) == (400, field)
    assert f"'{field}" in str(e.value)
    assert e.value.body()["error"]["type"] == "invalid_request_error"


def test_sampling_fields_in_range_are_accepted():
    body = {"model": "tiny", "prompt": "a", "temperature": 0, "top_p": 1, "seed": -5,
            "frequency_penalty": -2, "presence_penalty": 2.0, "user": "u", "stop": None}
    assert parse_completion(body, "tiny", TOK).prompts == ((97,),)
    assert parse_completion({**body, "temperature": 2, "stop": ""}, "tiny", TOK)
    assert parse_completion({**body, "temperature": None, "stop": []}, "tiny", TOK)


def test_the_prompt_must_fit_the_context():
    def parse(prompt, **kw):
        return parse_completion({"model": "tiny", "prompt": prompt, **kw}, "tiny", TOK,
                                max_model_len=10)
    assert parse([1] * 9, max_tokens=1).max_tokens == 1
    assert parse([1] * 4).max_tokens == 6            # the default 16, cut to what is left
    assert parse([[1] * 3, [1] * 8]).max_tokens == 2  # the longest prompt of a batch
    for prompt in ([1] * 10, "a" * 11, [[1], [1] * 12]):
        with pytest.raises(HttpError, match="too long: 1[0-2] tokens; the model's context is "
                                            "10 tokens") as e:
            parse(prompt, max_tokens=1)
        assert (e.value.status, e.value.param, e.value.code) == \
            (400, "prompt", "context_length_exceeded")
    with pytest.raises(HttpError, match="at most 2") as e:
        parse([1] * 8, max_tokens=3)
    assert (e.value.status, e.value.param, e.value.code) == \
        (400, "max_tokens", "context_length_exceeded")
    assert parse_completion({"model": "tiny", "prompt": [1] * 50}, "tiny", TOK).max_tokens == 16


@pytest.mark.parametrize("chunk, status", [
    (spb.GenerateChunk(done=True, rejected=True, error="SLO", error_code="RESOURCE_EXHAUSTED"), 429),
    (spb.GenerateChunk(done=True, rejected=True, error="queue full"), 429),
    (spb.GenerateChunk(done=True, rejected=True, error="no live prefill instance",
                       error_code="UNAVAILABLE"), 503),
    (spb.GenerateChunk(done=True, rejected=True, error="empty", error_code="INVALID_ARGUMENT"), 400),
    (spb.GenerateChunk(done=True, error="x", error_code="UNAVAILABLE"), 503),
    (spb.GenerateChunk(done=True, error="x", error_code="DEADLINE_EXCEEDED"), 504),
    (spb.GenerateChunk(done=True, error="x", error_code="INTERNAL"), 500),
])
def test_failure_status(chunk, status):
    err = failure_of(chunk)
    assert err.status == status and str(err) == chunk.error
