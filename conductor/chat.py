"""``/v1/chat/completions``: a conversation through the model folder's chat template.

:func:`parse_chat` validates an OpenAI chat body and turns its messages into
one prompt of token ids with the tokenizer's chat template
(:meth:`kvstore.conductor.hf_tokenizer.HfTokenizer.chat_prompt`, with
``add_generation_prompt``); :class:`ChatShape` writes the ``chat.completion``
answer, or ``chat.completion.chunk`` events when streamed (a first chunk with
``delta.role``, then ``delta.content`` pieces, then one with
``finish_reason``; ``usage`` last with ``stream_options.include_usage``).

Text only: a message is ``{"role", "content", "name"?}`` with ``content`` a
string or a list of ``{"type": "text", "text"}`` parts (joined with "\\n");
images, audio, tools and function calls are refused with 400, as are
``n`` > 1, ``logprobs``, ``stop`` and a ``response_format`` other than text.
Decoding is greedy: temperature, top_p, seed and the penalties change nothing
(but must have OpenAI's types and ranges, else 400).
"""

from __future__ import annotations

from kvstore._proto import serving_pb2 as spb
from kvstore.conductor.chat_template import ChatTemplateError, NoChatTemplate
from kvstore.conductor.openai_schema import (
    CompletionRequest, HttpError, check_context, check_defaults, check_fields, check_ids,
    check_max_tokens, check_model, check_stream, metrics_of)
from kvstore.conductor.tokenizer import Tokenizer

#: ``max_tokens`` when a chat body gives none (OpenAI's is the whole context): the
#: bundled engines reserve KV for every token a request may produce up front.
DEFAULT_MAX_TOKENS = 512
#: At most this many messages in one conversation.
MAX_MESSAGES = 1024
#: At most this many content parts in one message.
MAX_PARTS = 256
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MESSAGE_FIELDS = frozenset({"role", "content", "name"})

#: Every field of a /v1/chat/completions body the front honours or checks; any other is 400.
KNOWN_FIELDS = frozenset({
    "model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options",
    "n", "logprobs", "top_logprobs", "stop", "temperature", "top_p", "seed",
    "frequency_penalty", "presence_penalty", "logit_bias", "user", "response_format"})


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or len(content) > MAX_PARTS:
        raise HttpError(400, f"{where}.content must be a string or a list of at most "
                             f"{MAX_PARTS} text parts", "messages")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or \
                not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise HttpError(400, f"{where}.content[{j}]: only text parts are supported, got "
                                 f"{str(kind)[:40]!r}", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def parse_messages(messages) -> list[dict]:
    """The conversation as the chat template sees it: ``{"role", "content"[, "name"]}``
    dicts with string content.

    Raises:
        HttpError: 400 for a message of the wrong shape or an unsupported part.
    """
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "'messages' must be a non-empty list", "messages")
    if len(messages) > MAX_MESSAGES:
        raise HttpError(400, f"at most {MAX_MESSAGES} messages per request, got "
                             f"{len(messages)}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise HttpError(400, f"{where} must be an object", "messages")
        extra = sorted(set(m) - MESSAGE_FIELDS)
        if extra:
            raise HttpError(400, f"{where}.{extra[0][:40]} is not supported (text messages "
                                 f"only: role, content, name)", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise HttpError(400, f"{where}.role must be one of {', '.join(sorted(ROLES))}, got "
                                 f"{str(role)[:40]!r}", "messages")
        msg = {"role": role, "content": _content(m.get("content"), where)}
        if "name" in m:
            if not isinstance(m["name"], str):
                raise HttpError(400, f"{where}.name must be a string", "messages")
            msg["name"] = m["name"]
        out.append(msg)
    return out


def parse_chat(body, model_name: str, tokenizer: Tokenizer,
               max_model_len: int | None = None) -> CompletionRequest:
    """Validate a ``/v1/chat/completions`` body and tokenize its conversation.

    Args:
        max_model_len: the model's context in tokens: a conversation that leaves
            no room in it, or a given ``max_tokens`` that does not fit, is refused
            (400 ``context_length_exceeded``); the default ``max_tokens``
            (:data:`DEFAULT_MAX_TOKENS`) is cut to what is left of it after the prompt.

    Raises:
        HttpError: 400 for invalid or unsupported fields, a model without a chat
            template, a conversation its template refuses or one too long for the
            context; 404 for another model.
    """
    body = check_fields(body, KNOWN_FIELDS)
    model = check_model(body, model_name)
    messages = parse_messages(body.get("messages"))
    check_defaults(body, (("n", 1), ("logprobs", False), ("top_logprobs", 0)))
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise HttpError(400, "'response_format' other than {\"type\": \"text\"} is not supported",
                        "response_format")
    stream, include_usage = check_stream(body)
    if body.get("max_completion_tokens") is not None and body.get("max_tokens") is not None:
        raise HttpError(400, "give 'max_completion_tokens' or 'max_tokens', not both",
                        "max_completion_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = check_max_tokens(body.get(name), name, default=0)    # 0: not given
    try:
        ids = tokenizer.chat_prompt(messages, add_generation_prompt=True)
    except NoChatTemplate as exc:
        raise HttpError(400, str(exc), "messages", "no_chat_template") from None
    except ChatTemplateError as exc:
        raise HttpError(400, str(exc), "messages") from None
    except UnicodeEncodeError:
        raise HttpError(400, "messages must be valid Unicode (one holds a lone surrogate)",
                        "messages") from None
    prompt = check_ids(ids, tokenizer, "messages")
    max_tokens = check_context((prompt,), max_tokens or DEFAULT_MAX_TOKENS, bool(max_tokens),
                               max_model_len, "messages", name)
    return CompletionRequest(model, (prompt,), max_tokens, stream, include_usage, chat=True)


class ChatShape:
    """``chat.completion`` objects (see the module docstring); every choice carries the
    extension ``token_ids``, a finished one ``metrics``."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(self, i: int, text: str, token_ids: list[int], finish: str | None,
               done: spb.GenerateChunk | None) -> dict:
        c = {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
             "finish_reason": finish, "token_ids": token_ids}
        if done is not None:
            c["metrics"] = metrics_of(done)
        return c

    def chunk_choice(self, i: int, text: str, token_ids: list[int], finish: str | None,
                     done: spb.GenerateChunk | None) -> dict:
        c = {"index": i, "delta": {"content": text} if text else {}, "logprobs": None,
             "finish_reason": finish, "token_ids": token_ids}
        if done is not None:
            c["metrics"] = metrics_of(done)
        return c

    def first_chunk(self, i: int) -> dict | None:
        return {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None, "token_ids": []}
