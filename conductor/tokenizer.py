"""The byte tokenizer: text to token ids for models without a tokenizer of their own.

Used by the HTTP front (:mod:`kvstore.conductor.http`) for the seeded ``tiny``
model; a model folder with its own tokenizer is issue 15's.
"""

from __future__ import annotations

import codecs


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

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        d = self.stream_decoder()
        return d.feed(token_ids) + d.flush()

    def stream_decoder(self) -> "ByteStreamDecoder":
        """A decoder for tokens arriving in pieces (a multi-byte character may span pieces)."""
        return ByteStreamDecoder()


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
