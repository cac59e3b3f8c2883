"""Which tokenizer the HTTP front uses, and the byte tokenizer of models without one.

The HTTP front (:mod:`kvstore.conductor.http`) turns text into token ids and
back with a :class:`Tokenizer`: the :class:`ByteTokenizer` for the seeded
``tiny`` demo model, or a model folder's own ``tokenizer.json``
(:class:`kvstore.conductor.hf_tokenizer.HfTokenizer`); :func:`load_tokenizer`
picks one from ``--model`` and ``--tokenizer``.
"""

from __future__ import annotations

import codecs
import os
from typing import Any, Mapping, Protocol, Sequence

from kvstore.client.models import TINY
from kvstore.conductor.chat_template import NoChatTemplate

#: ``--tokenizer`` value that asks for the byte tokenizer whatever the model.
BYTE = "byte"


class StreamDecoder(Protocol):
    def feed(self, token_ids: Sequence[int]) -> str:
        """Text of these tokens that can be released now."""

    def flush(self) -> str:
        """The rest of the text."""


class Tokenizer(Protocol):
    """What the HTTP front needs: ``vocab_size`` bounds the token ids it accepts;
    generation stops after any of ``stop_token_ids``."""

    vocab_size: int
    stop_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]:
        """Token ids of a text prompt (UnicodeEncodeError for a lone surrogate)."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of generated token ids."""

    def stream_decoder(self) -> StreamDecoder:
        """An incremental decoder: its pieces add up to :meth:`decode`."""

    def chat_prompt(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation (NoChatTemplate without a chat template)."""


def load_tokenizer(model: str, tokenizer: str, vocab_size: int) -> Tokenizer:
    """The front's tokenizer.

    Args:
        model: ``"tiny"`` or a Hugging Face model folder (``--model``).
        tokenizer: ``--tokenizer``: "" for the model's own (the byte tokenizer
            for ``tiny``, the folder's ``tokenizer.json`` for a folder),
            ``"byte"`` for the byte tokenizer, or a folder holding ``tokenizer.json``.
        vocab_size: the model's vocabulary (token ids at or above it are refused).

    Raises:
        TokenizerError: the folder has no ``tokenizer.json`` or it cannot be loaded.
        ChatTemplateError: the folder's chat template does not compile.
        ValueError: the byte tokenizer for a vocabulary under 256.
    """
    if tokenizer == BYTE or (not tokenizer and model == TINY):
        return ByteTokenizer(vocab_size)
    from kvstore.conductor.hf_tokenizer import HfTokenizer

    return HfTokenizer.from_folder(os.path.expanduser(tokenizer or model), vocab_size)


class ByteTokenizer:
    """A deterministic tokenizer for models without their own (the seeded ``tiny`` model).

    * encode: the text's UTF-8 bytes; token id = byte value (0..255).
    * decode: ids 0..255 are those bytes, read as UTF-8 (an invalid sequence
      becomes U+FFFD); any other id is written ``<|id|>``.

    ``decode(encode(text)) == text`` for every string.

    Args:
        vocab_size: the model's vocabulary; at least 256.
    """

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"the byte tokenizer needs vocab_size >= 256, the model has {vocab_size}")
        self.vocab_size = vocab_size
        self.stop_token_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        d = self.stream_decoder()
        return d.feed(token_ids) + d.flush()

    def stream_decoder(self) -> "ByteStreamDecoder":
        """A decoder for tokens arriving in pieces (a multi-byte character may span pieces)."""
        return ByteStreamDecoder()

    def chat_prompt(self, messages, add_generation_prompt: bool = True) -> list[int]:
        """Always raises :class:`NoChatTemplate`: bytes have no chat format."""
        raise NoChatTemplate("this model has no chat template (the byte tokenizer): use "
                             "/v1/completions, or serve a model folder with one")


class ByteStreamDecoder:
    """Incremental :meth:`ByteTokenizer.decode`: ``feed(a) + feed(b) + flush() == decode(a + b)``."""

    def __init__(self):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: list[int]) -> str:
        out = []
        for t in token_ids:
            if t < 256:
                out.append(self._utf8.decode(bytes((t,))))
            else:
                out.append(self._utf8.decode(b"", final=True))
                self._utf8.reset()
                out.append(f"<|{t}|>")
        return "".join(out)

    def flush(self) -> str:
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
