"""A Hugging Face model folder's own tokenizer: ``tokenizer.json`` read by the ``tokenizers`` library.

:class:`HfTokenizer` has the interface of
:class:`kvstore.conductor.tokenizer.ByteTokenizer` (``encode``, ``decode``,
``stream_decoder``, ``vocab_size``) plus what a real model folder adds: its
stop tokens and its chat template. It reads, from the folder:

* ``tokenizer.json`` (required): the tokenizer itself (normalizer,
  pre-tokenizer, model, post-processor, decoder, added tokens);
* ``tokenizer_config.json`` (optional): ``bos_token`` / ``eos_token`` (and
  ``unk_token`` / ``pad_token``, for the template), ``add_bos_token`` /
  ``add_eos_token``, ``chat_template``;
* ``chat_template.jinja`` / ``chat_template.json`` (optional, see
  :func:`kvstore.conductor.chat_template.find_chat_template`);
* ``generation_config.json`` (optional): ``eos_token_id`` (an id or a list).

Encoding a text prompt: when ``tokenizer_config.json`` sets ``add_bos_token``
(or ``add_eos_token``), the text is encoded without the post-processor's
special tokens and BOS (EOS) is added as those flags say; otherwise
``tokenizer.json``'s post-processor decides. A chat prompt is the rendered
template encoded without added special tokens (the template writes them),
as transformers' ``apply_chat_template`` does. Decoding skips special tokens.

Nothing here reaches the network: only files in the folder are read.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any, Mapping, Sequence

from kvstore.conductor.chat_template import ChatTemplate, NoChatTemplate, find_chat_template

log = logging.getLogger(__name__)

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
#: A byte token of SentencePiece-style byte fallback ("<0xE2>").
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded: no ``tokenizer.json``, an unreadable
    file, a folder config of the wrong shape, or the ``tokenizers`` library missing."""


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an
    AddedToken dict ``{"content": ...}``; None when unset."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HfTokenizer:
    """A model folder's tokenizer (see the module docstring for what is read).

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)``: the model's vocabulary
            when given, else the tokenizer's (added tokens included).
        bos_token, eos_token: their text, or None.
        stop_token_ids: generation ends after any of these (EOS and
            ``generation_config.json``'s ``eos_token_id``), in that order.
        chat_template: the folder's :class:`ChatTemplate`, or None.
    """

    def __init__(self, tokenizer, config: Mapping[str, Any] | None = None,
                 chat_template: str | None = None, generation_eos: Sequence[int] = (),
                 vocab_size: int | None = None, name: str = "tokenizer"):
        config = dict(config or {})
        self._tok = tokenizer
        self.name = name
        own = tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab_size is not None and own > vocab_size:
            log.warning("%s has %d tokens, the model %d: ids >= %d are refused",
                        name, own, vocab_size, vocab_size)
        self.vocab_size = vocab_size if vocab_size is not None else own
        # Byte-fallback decoders decode a run of byte tokens together: one more
        # byte can turn a run's character into U+FFFDs (see HfStreamDecoder).
        self.byte_token_ids = frozenset(
            i for t, i in tokenizer.get_vocab(with_added_tokens=False).items()
            if _BYTE_TOKEN.fullmatch(t))
        special = {k: _token_text(config.get(k)) for k in _SPECIAL_NAMES}
        self.bos_token = special["bos_token"]
        self.eos_token = special["eos_token"]
        self.bos_token_id = self._id_of(self.bos_token, "bos_token")
        self.eos_token_id = self._id_of(self.eos_token, "eos_token")
        self._add_bos = config.get("add_bos_token")
        self._add_eos = config.get("add_eos_token")
        if self._add_bos and self.bos_token_id is None:
            raise TokenizerError(f"{name}: add_bos_token is set but there is no bos_token")
        if self._add_eos and self.eos_token_id is None:
            raise TokenizerError(f"{name}: add_eos_token is set but there is no eos_token")
        stops = [self.eos_token_id] if self.eos_token_id is not None else []
        for t in generation_eos:
            if t not in stops:
                stops.append(t)
        self.stop_token_ids: tuple[int, ...] = tuple(stops)
        self.chat_template = None if chat_template is None else ChatTemplate(
            chat_template, {k: v for k, v in special.items() if v is not None})

    def _id_of(self, text: str | None, what: str) -> int | None:
        if text is None:
            return None
        tid = self._tok.token_to_id(text)
        if tid is None:
            raise TokenizerError(f"{self.name}: {what} {text!r} is not in the vocabulary")
        return tid

    @classmethod
    def from_folder(cls, folder: str | os.PathLike[str],
                    vocab_size: int | None = None) -> "HfTokenizer":
        """Load ``folder``'s tokenizer (files only, never the network).

        Args:
            folder: a Hugging Face model (or tokenizer) folder.
            vocab_size: the model's vocabulary; None: the tokenizer's.

        Raises:
            TokenizerError: no ``tokenizer.json`` in ``folder``, a file that does not
                parse, a special token missing from the vocabulary, or the
                ``tokenizers`` library not installed.
            ChatTemplateError: the chat template does not compile.
        """
        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(
                f"{folder} has no tokenizer.json: point --tokenizer at a folder with one, or "
                f"pass --tokenizer byte for the byte tokenizer")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError("a model folder's tokenizer needs the tokenizers library "
                                 "(pip install tokenizers)") from None
        try:
            tok = Tokenizer.from_file(path)
        except Exception as exc:    # the library raises a bare Exception for a bad file
            raise TokenizerError(f"cannot load {path}: {exc}") from None
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        gen = _read_json(os.path.join(folder, "generation_config.json")).get("eos_token_id")
        gen_ids = gen if isinstance(gen, list) else [] if gen is None else [gen]
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in gen_ids):
            raise TokenizerError(f"generation_config.json in {folder}: eos_token_id must be a "
                                 f"token id or a list of them, got {gen!r}")
        return cls(tok, config, find_chat_template(folder, config), gen_ids, vocab_size,
                   name=path)

    def encode(self, text: str) -> list[int]:
        """Token ids of a text prompt (BOS as the folder says; see the module docstring).

        Raises:
            UnicodeEncodeError: ``text`` is not valid Unicode (a lone surrogate).
        """
        text.encode("utf-8")     # the library reports a lone surrogate as a TypeError
        if self._add_bos is None and self._add_eos is None:
            return self._tok.encode(text, add_special_tokens=True).ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if self._add_bos:
            ids = [self.bos_token_id, *ids]
        if self._add_eos:
            ids.append(self.eos_token_id)
        return ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens skipped; an id the tokenizer
        does not know is skipped too."""
        return self._tok.decode(list(token_ids), skip_special_tokens=True)

    def stream_decoder(self) -> "HfStreamDecoder":
        """A decoder for tokens arriving in pieces (see :class:`HfStreamDecoder`)."""
        return HfStreamDecoder(self)

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation through the folder's chat template.

        Raises:
            NoChatTemplate: the folder has no chat template.
            ChatTemplateError: the template refused or failed on ``messages``.
            UnicodeEncodeError: a message is not valid Unicode.
        """
        if self.chat_template is None:
            raise NoChatTemplate(f"{self.name} has no chat template (tokenizer_config.json "
                                 f"chat_template): use /v1/completions with a prompt")
        text = self.chat_template.render(messages, add_generation_prompt)
        text.encode("utf-8")
        return self._tok.encode(text, add_special_tokens=False).ids


class HfStreamDecoder:
    """Incremental :meth:`HfTokenizer.decode`: ``feed(a) + feed(b) + flush() == decode(a + b)``.

    Text is released only when it can no longer change: each call decodes the
    tokens since the last release point twice, with and without the new
    ones, and releases the difference unless it ends in an incomplete
    character (U+FFFD, e.g. a byte-level token holding the first bytes of an
    emoji), which stays held until more tokens complete it, or in a byte
    token of a byte-fallback vocabulary (``<0xE2>``: the decoder reads a run
    of them together, so the next one may still change the run's text), held
    until the run ends. Decoding from a
    release point rather than from the start keeps each call's work
    proportional to the held tokens, and gives decoders that treat a
    sequence's first token specially (a leading space stripped) the same
    start in both decodes. :meth:`flush` decodes everything once and
    returns what is still missing, so the whole always equals ``decode``.
    """

    def __init__(self, tokenizer: HfTokenizer):
        self._decode = tokenizer.decode
        self._bytes = tokenizer.byte_token_ids
        self._ids: list[int] = []
        self._prefix = 0        # tokens before this are settled and out of every window
        self._read = 0          # tokens before this have had their text released
        self._released: list[str] = []

    def feed(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids`` that can be released now (maybe "")."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        if self._ids[-1] in self._bytes:
            return ""
        before = self._decode(self._ids[self._prefix:self._read])
        now = self._decode(self._ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd") or not now.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        text = now[len(before):]
        self._released.append(text)
        return text

    def flush(self) -> str:
        """The rest of the text (held incomplete characters included); the decoder
        starts over afterwards."""
        released = "".join(self._released)
        full = self._decode(self._ids)
        if full.startswith(released):
            rest = full[len(released):]
        else:                   # a decoder whose output depends on distant tokens
            log.debug("stream decode diverged from the full decode; sending the window's rest")
            before = self._decode(self._ids[self._prefix:self._read])
            rest = self._decode(self._ids[self._prefix:])[len(before):]
        self._ids, self._prefix, self._read, self._released = [], 0, 0, []
        return rest
