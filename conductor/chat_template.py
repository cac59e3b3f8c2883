"""Chat templates: a model folder's Jinja template that turns chat messages into prompt text.

A Hugging Face model folder carries its chat template as data (the
``chat_template`` field of ``tokenizer_config.json``, or ``chat_template.jinja``
/ ``chat_template.json`` beside it). It is compiled here in Jinja's
:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment`: a template may read
the values it is given and call ``raise_exception``, but reaches no Python
attribute or method outside the sandbox's safe set and mutates nothing.

The template sees the variables Hugging Face's ``apply_chat_template`` gives
it for a text-only conversation: ``messages`` (a list of ``{"role",
"content"}`` dicts, ``content`` a string), ``add_generation_prompt``,
``bos_token``, ``eos_token`` (and ``unk_token`` / ``pad_token`` where the
folder names them), ``tools`` and ``documents`` (always None here), the
functions ``raise_exception(message)`` and ``strftime_now(format)``, and a
``tojson`` filter that writes non-ASCII as is (Jinja's own escapes HTML).
Blocks are trimmed (``trim_blocks``, ``lstrip_blocks``) and ``{% break %}`` /
``{% continue %}`` work, as in transformers.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Mapping, Sequence

#: The longest prompt text a template may render, in characters; a longer one is
#: refused (a request body is at most 1 MiB, so this only stops a runaway template).
MAX_RENDERED_CHARS = 4 << 20


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or a conversation it refuses to render
    (its ``raise_exception``, a wrong message shape, too long an output)."""


class NoChatTemplate(ChatTemplateError):
    """The model folder has no chat template, so chat requests cannot be served."""


class _TemplateRaised(Exception):
    """What ``raise_exception(message)`` raises inside a template."""


def _raise_exception(message: Any = "") -> None:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return time.strftime(str(fmt))


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False,
            separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii,
                      separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja source.
        special_tokens: the text of the folder's special tokens by variable name
            (``bos_token``, ``eos_token``, ...); a missing one renders as "".

    Raises:
        ChatTemplateError: the source does not compile, or jinja2 is not installed.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:       # pragma: no cover - jinja2 comes with torch
            raise ChatTemplateError("chat templates need jinja2 (pip install jinja2)") from None
        if not isinstance(source, str) or not source:
            raise ChatTemplateError("the chat template must be a non-empty string")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        self._errors = (TemplateError, _TemplateRaised)
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               max_chars: int = MAX_RENDERED_CHARS) -> str:
        """The prompt text of ``messages``.

        Args:
            messages: ``{"role": str, "content": str, ...}`` dicts, oldest first.
            add_generation_prompt: end with the template's opening of an assistant turn.
            max_chars: refuse an output longer than this many characters.

        Raises:
            ChatTemplateError: the template raised (``raise_exception``, an
                undefined operation, a sandbox violation) or its output is too long.
        """
        context = {"bos_token": "", "eos_token": "", **self.special_tokens,
                   "messages": [dict(m) for m in messages],
                   "add_generation_prompt": bool(add_generation_prompt),
                   "tools": None, "documents": None}
        out: list[str] = []
        size = 0
        try:
            for piece in self._template.generate(**context):
                size += len(piece)
                if size > max_chars:
                    break
                out.append(piece)
        except _TemplateRaised as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from None
        except self._errors as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError,
                ZeroDivisionError, OverflowError, RecursionError) as exc:
            raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
        if size > max_chars:
            raise ChatTemplateError(f"the chat template rendered over {max_chars} characters")
        return "".join(out)


def find_chat_template(folder: str | os.PathLike[str],
                       tokenizer_config: Mapping[str, Any]) -> str | None:
    """The chat template source of a model folder, or None when it has none.

    Looked up in order: ``tokenizer_config.json``'s ``chat_template`` (a string,
    or a list of ``{"name", "template"}`` of which the one named ``default``),
    ``chat_template.jinja``, ``chat_template.json``'s ``chat_template``.

    Raises:
        ChatTemplateError: a template field of the wrong type.
    """
    source = tokenizer_config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
        if source is None:
            raise ChatTemplateError(f"tokenizer_config.json names chat templates "
                                    f"{sorted(map(str, named))} but none is 'default'")
    if source is None:
        jinja_file = os.path.join(folder, "chat_template.jinja")
        json_file = os.path.join(folder, "chat_template.json")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                source = f.read()
        elif os.path.isfile(json_file):
            with open(json_file, encoding="utf-8") as f:
                source = json.load(f).get("chat_template")
    if source is not None and not isinstance(source, str):
        raise ChatTemplateError(f"the chat template of {folder} is a {type(source).__name__}, "
                                f"not a string")
    return source
