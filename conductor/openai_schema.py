"""The OpenAI completions schema of the HTTP front: request parsing, errors, response shapes.

:func:`parse_completion` validates a ``/v1/completions`` body into a
:class:`CompletionRequest`; the field checks it shares with
``/v1/chat/completions`` (:mod:`kvstore.conductor.chat`) are the helpers
below. :class:`TextShape` writes ``text_completion`` choices; the chat
module's ``ChatShape`` writes chat ones, and :mod:`kvstore.conductor.http`
runs either. Every error is an :class:`HttpError` in OpenAI's shape.

Bounds: a body is at most :data:`MAX_BODY_BYTES` (else 413), a batch holds at
most :data:`MAX_BATCH_PROMPTS` prompts, ``max_tokens`` fits the wire's uint32,
every token id is inside the model's vocabulary and every prompt plus its
``max_tokens`` fits the model's context (:func:`check_context`, else 400
``context_length_exceeded``). The sampling fields the front accepts and
ignores must still have OpenAI's types and ranges (:data:`SAMPLING_RANGES`).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from kvstore._proto import serving_pb2 as spb
from kvstore.conductor.tokenizer import Tokenizer

DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions
MAX_TOKENS_LIMIT = 2**32 - 1    # what GenerateRequest.max_tokens (uint32) can carry
MAX_BATCH_PROMPTS = 64
MAX_BODY_BYTES = 1 << 20    # a request body; a longer one is 413 (aiohttp's default limit)

#: gRPC status name of a failed or refused request -> HTTP status: a refusal
#: under load (SLO, KV room) is RESOURCE_EXHAUSTED, one for want of a live
#: engine UNAVAILABLE. A name not listed is 429 for a request with ``rejected``
#: set, else 500.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rejected",
               503: "service_unavailable", 504: "timeout"}


class HttpError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": _ERROR_TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return web.json_response(self.body(), status=self.status, headers=headers)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A parsed ``/v1/completions`` or ``/v1/chat/completions`` body."""

    model: str
    prompts: tuple[tuple[int, ...], ...]   # token ids of each prompt (a batch: several)
    max_tokens: int                        # per prompt, the first token included
    stream: bool
    include_usage: bool                    # stream_options.include_usage
    chat: bool = False                     # a chat completion (one prompt: the conversation)


#: Sampling fields accepted and ignored (greedy decoding), with OpenAI's range of
#: each: a value of another type or outside it is 400 naming the field, not ignored.
SAMPLING_RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0),
                   "frequency_penalty": (-2.0, 2.0), "presence_penalty": (-2.0, 2.0)}

#: Every field of a /v1/completions body the front honours or checks; any other is 400.
#: temperature, top_p, seed and the penalties are accepted and change nothing
#: (greedy decoding); user is the caller's label.
KNOWN_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "stream", "stream_options", "n", "best_of", "echo",
    "logprobs", "suffix", "stop", "temperature", "top_p", "seed", "frequency_penalty",
    "presence_penalty", "logit_bias", "user"})


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _shown(value) -> str:
    return repr(value)[:40]


def check_fields(body, known: frozenset[str]) -> dict:
    """The body as a dict whose every field is in ``known`` and of its type.

    Raises:
        HttpError: 400 naming the first unknown field, or a field of the wrong
            type or out of range (:func:`check_sampling`).
    """
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - known)
    if unknown:
        # Never ignored: a field the front cannot honour (an image, a tool call,
        # a sampling option it has no code for) would change what the caller
        # gets, or which cached KV a different input reuses.
        raise HttpError(400, f"'{unknown[0]}' is not supported here (known fields: "
                             f"{', '.join(sorted(known))})", unknown[0])
    check_sampling(body)
    if body.get("logit_bias") not in (None, {}):
        raise HttpError(400, "'logit_bias' is not supported (greedy decoding)", "logit_bias")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise HttpError(400, f"'stop' must be a string, a list of strings or null, got "
                             f"{_shown(stop)}", "stop")
    if stop not in (None, [], ""):
        raise HttpError(400, "'stop' is not supported", "stop")
    return body


def check_sampling(body: dict) -> None:
    """The fields accepted and ignored have OpenAI's types: :data:`SAMPLING_RANGES`
    numbers in range, an integer ``seed``, a string ``user`` (each may be null).

    Raises:
        HttpError: 400 naming the first field that does not.
    """
    for name, (lo, hi) in SAMPLING_RANGES.items():
        value = body.get(name)
        if value is not None and not (_is_number(value) and lo <= value <= hi):
            raise HttpError(400, f"'{name}' must be a number in [{lo:g}, {hi:g}], got "
                                 f"{_shown(value)}", name)
    if body.get("seed") is not None and not _is_int(body["seed"]):
        raise HttpError(400, f"'seed' must be an integer, got {_shown(body['seed'])}", "seed")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise HttpError(400, f"'user' must be a string, got {_shown(body['user'])}", "user")


def check_model(body: dict, model_name: str) -> str:
    """``model``: 400 when absent, 404 when it is not the served one."""
    model = body.get("model")
    if not isinstance(model, str):
        raise HttpError(400, "'model' is required", "model")
    if model != model_name:
        raise HttpError(404, f"model {model!r} is not served here; this server serves {model_name!r}",
                        "model", "model_not_found")
    return model


def check_max_tokens(value, name: str = "max_tokens", default: int = DEFAULT_MAX_TOKENS) -> int:
    """``max_tokens`` (``default`` when absent): an integer in [1, MAX_TOKENS_LIMIT]."""
    if value is None:
        return default
    if not _is_int(value) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise HttpError(400, f"'{name}' must be an integer in [1, {MAX_TOKENS_LIMIT}], "
                             f"got {str(value)[:40]}", name)
    return value


def check_context(prompts: tuple[tuple[int, ...], ...], max_tokens: int, given: bool,
                  max_model_len: int | None, param: str, name: str = "max_tokens") -> int:
    """``max_tokens`` such that every prompt plus what it may generate fits the model's
    context (OpenAI's rule: prompt + max_tokens <= context).

    Args:
        prompts: the request's prompts (token ids).
        max_tokens: what the body asked for, or the route's default.
        given: the body set ``max_tokens``: one that does not fit is refused;
            a default one is cut to what the longest prompt leaves.
        max_model_len: the model's context in tokens; None: unknown (no check).
        param, name: the prompt's and max_tokens' field names (for the error).

    Raises:
        HttpError: 400 ``context_length_exceeded`` for a prompt that leaves no
            room for one token, or a given ``max_tokens`` that does not fit.
    """
    if max_model_len is None:
        return max_tokens
    longest = max(len(p) for p in prompts)
    if longest >= max_model_len:
        raise HttpError(400, f"the prompt is too long: {longest} tokens; the model's context "
                             f"is {max_model_len} tokens, so a prompt may hold at most "
                             f"{max_model_len - 1}", param, "context_length_exceeded")
    if longest + max_tokens <= max_model_len:
        return max_tokens
    if not given:
        return max_model_len - longest
    raise HttpError(400, f"the model's context is {max_model_len} tokens: the prompt's {longest} "
                         f"plus '{name}' {max_tokens} do not fit (at most "
                         f"{max_model_len - longest})", name, "context_length_exceeded")


def check_defaults(body: dict, defaults: tuple[tuple[str, object], ...]) -> None:
    """Fields accepted only at their default (greedy decoding, one choice)."""
    for name, default in defaults:
        value = body.get(name)
        if value is not None and value != default:
            raise HttpError(400, f"'{name}'={str(value)[:40]!r} is not supported (greedy "
                                 f"decoding, one choice)", name)


def check_stream(body: dict) -> tuple[bool, bool]:
    """(``stream``, ``stream_options.include_usage``)."""
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise HttpError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise HttpError(400, "'stream_options' must be an object", "stream_options")
    if set(options) - {"include_usage"}:
        raise HttpError(400, f"'stream_options.{sorted(set(options) - {'include_usage'})[0]}' "
                             f"is not supported", "stream_options")
    if options.get("include_usage") not in (None, True, False):
        raise HttpError(400, "'stream_options.include_usage' must be a boolean", "stream_options")
    return stream, bool(stream and options.get("include_usage"))


def check_ids(ids, tokenizer: Tokenizer, param: str) -> tuple[int, ...]:
    """A prompt's token ids: at least one, each in the vocabulary."""
    if not ids:
        raise HttpError(400, "a prompt must hold at least one token", param)
    bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise HttpError(400, f"token id {bad[0]} is outside the vocabulary "
                        f"[0, {tokenizer.vocab_size})", param)
    return tuple(ids)


def parse_completion(body, model_name: str, tokenizer: Tokenizer,
                     max_model_len: int | None = None) -> CompletionRequest:
    """Validate a ``/v1/completions`` JSON body.

    Args:
        max_model_len: the model's context in tokens (see :func:`check_context`);
            None: unknown.

    Raises:
        HttpError: 400 for invalid or unsupported fields or a prompt too long for
            the context, 404 for another model.
    """
    body = check_fields(body, KNOWN_FIELDS)
    model = check_model(body, model_name)
    prompts = _parse_prompts(body.get("prompt"), tokenizer)
    max_tokens = check_context(prompts, check_max_tokens(body.get("max_tokens")),
                               body.get("max_tokens") is not None, max_model_len, "prompt")
    check_defaults(body, (("n", 1), ("best_of", 1), ("echo", False), ("logprobs", None),
                          ("suffix", None)))
    stream, include_usage = check_stream(body)
    return CompletionRequest(model, prompts, max_tokens, stream, include_usage)


def _parse_prompts(prompt, tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """str | list[str] | list[int] | list[list[int]] -> token ids per prompt."""
    if isinstance(prompt, str):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt:
        batch = prompt
    else:
        raise HttpError(400, "'prompt' must be a non-empty string, list of strings, list of token "
                        "ids or list of token id lists", "prompt")
    if len(batch) > MAX_BATCH_PROMPTS:
        raise HttpError(400, f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(batch)}",
                        "prompt")
    out = []
    for p in batch:
        if isinstance(p, str):
            try:
                ids = tokenizer.encode(p)
            except UnicodeEncodeError:      # JSON may escape a lone surrogate ("\ud800")
                raise HttpError(400, "a text prompt must be valid Unicode (it holds a lone "
                                     "surrogate)", "prompt") from None
        elif isinstance(p, list) and all(_is_int(t) for t in p):
            ids = p
        else:
            raise HttpError(400, "a batch must hold only strings or only token id lists", "prompt")
        out.append(check_ids(ids, tokenizer, "prompt"))
    return tuple(out)


def failure_of(chunk: spb.GenerateChunk) -> HttpError:
    """The HTTP error of a failed request's last chunk (see :data:`HTTP_STATUS`): 429 for
    a refusal under load, 503 when no engine is live, 400 for input the conductor refused."""
    status = HTTP_STATUS.get(chunk.error_code, 429 if chunk.rejected else 500)
    return HttpError(status, chunk.error or "request failed", code=(chunk.error_code or None)
                     and chunk.error_code.lower())


def failed(chunk: spb.GenerateChunk) -> bool:
    """The chunk ends a request that was refused or failed."""
    return chunk.done and (chunk.rejected or bool(chunk.error))


def metrics_of(done: spb.GenerateChunk) -> dict:
    """A finished request's :class:`RequestMetrics` as JSON (the ``metrics`` extension)."""
    return MessageToDict(done.metrics, preserving_proto_field_name=True)


class TextShape:
    """``text_completion`` objects: a choice's ``text``, streamed in pieces of it.

    Every choice (and chunk) carries the extension ``token_ids``; a finished
    one ``finish_reason`` and ``metrics``.
    """

    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def choice(self, i: int, text: str, token_ids: list[int], finish: str | None,
               done: spb.GenerateChunk | None) -> dict:
        c = {"index": i, "text": text, "logprobs": None, "finish_reason": finish,
             "token_ids": token_ids}
        if done is not None:
            c["metrics"] = metrics_of(done)
        return c

    def chunk_choice(self, i: int, text: str, token_ids: list[int], finish: str | None,
                     done: spb.GenerateChunk | None) -> dict:
        return self.choice(i, text, token_ids, finish, done)

    def first_chunk(self, i: int) -> dict | None:
        """A chunk sent before choice ``i``'s first tokens (None: none)."""
        return None
