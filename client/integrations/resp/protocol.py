"""RESP2 / RESP3 on the wire: a bounded command reader and a reply encoder.

Requests (what clients send) come in two forms::

    *<n>\\r\\n  then n times  $<len>\\r\\n<len bytes>\\r\\n      a multibulk command
    PING\\r\\n  SET k "a b"\\r\\n                                an inline command

Every size read from the wire is checked against :class:`Limits` before it
is used: a line longer than ``max_inline_bytes``, an array over
``max_args`` or a bulk length over ``max_bulk_bytes`` is a
:class:`ProtocolError`, after which the connection is closed (as Redis does:
the stream can no longer be framed). Bulk strings longer than
``direct_bytes`` are read straight into their own buffer with
``recv_into`` (an anonymous mmap over 1 MiB, so the memory of a declared
but never sent length is not touched); shorter ones are sliced out of the
connection's 64 KiB receive buffer.

Replies are encoded from plain Python values (:func:`encode`)::

    Status("OK")     +OK                     RespError(...)  -ERR ...
    int / bool       :1                      None            $-1 (RESP2)  _ (RESP3)
    bytes-like       $<len> ... (no copy)    str             bulk string, UTF-8
    list / tuple     *<n> ...                dict            RESP2: flat array, RESP3: %<n>
    float            RESP2: bulk string, RESP3: ,<double>

Thread safety: a reader and its buffers belong to one connection's thread.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Callable

CRLF = b"\r\n"


#: What ``--max-bulk`` may be: from room for any key (512 B) and a token, to Redis'
#: proto-max-bulk-len default, which is also its largest string value. The store
#: has no bound of its own (a node keeps what fits under a tier's high watermark).
MIN_BULK_BYTES = 1024
MAX_BULK_BYTES = 512 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on what one request may declare."""

    max_inline_bytes: int = 64 * 1024          # an inline command, or a *<n> / $<len> line
    max_args: int = 1024 * 1024                # arguments of one multibulk command
    max_bulk_bytes: int = MAX_BULK_BYTES       # one argument (a value)
    direct_bytes: int = 64 * 1024              # longer bulks are read into their own buffer


class ProtocolError(Exception):
    """The input cannot be framed as RESP; the reply is sent and the connection closed."""


class Status(str):
    """A simple-string reply (``+OK``)."""


class RespError(Exception):
    """An error reply: ``-PREFIX message`` (PREFIX is ERR, NOAUTH, WRONGPASS, ...)."""

    def __init__(self, message: str, prefix: str = "ERR"):
        super().__init__(message)
        self.prefix = prefix
        self.message = message

    def line(self) -> bytes:
        text = f"{self.prefix} {self.message}".replace("\r", " ").replace("\n", " ")
        return b"-" + text.encode("utf-8", "replace") + CRLF


OK = Status("OK")

#: recv_into-style source: fills the view, returns the bytes written (0 = EOF).
RecvInto = Callable[[memoryview], int]


class CommandReader:
    """Reads one command at a time from a byte stream, within :class:`Limits`.

    Args:
        recv_into: the stream (``socket.recv_into``); blocks until some bytes arrive.
        limits: the bounds.
        buffer_bytes: size of the receive buffer (at least ``limits.max_inline_bytes``).
        before_recv: called before each receive (the server answers what is complete
            there, so no reply waits behind a command that is still arriving).
    """

    def __init__(self, recv_into: RecvInto, limits: Limits = Limits(),
                 buffer_bytes: int = 64 * 1024, before_recv: Callable[[], None] | None = None):
        self._recv_into = recv_into
        self._before_recv = before_recv
        self.limits = limits
        self._buf = bytearray(max(buffer_bytes, limits.max_inline_bytes + 2,
                                  limits.direct_bytes + 2))
        self._start = 0          # first unread byte
        self._end = 0            # one past the last received byte

    def buffered(self) -> bool:
        """Whether received bytes wait to be parsed (more pipelined commands)."""
        return self._end > self._start

    def complete_buffered(self) -> bool:
        """Whether a whole next command waits in the buffer (nothing is consumed; a
        malformed one counts as whole: reading it raises at once)."""
        buf, i, end = self._buf, self._start, self._end
        if i >= end:
            return False
        at = buf.find(b"\n", i, end)
        if buf[i] != 0x2A or at < 0:               # inline: one line; or no line yet
            return at >= 0
        n = _peek_number(buf[i + 1:at])
        if n is None or n > self.limits.max_args:
            return True
        i = at + 1
        for _ in range(n):
            at = buf.find(b"\n", i, end)
            if at < 0:
                return False
            size = _peek_number(buf[i + 1:at]) if buf[i] == 0x24 else None
            if size is None or size < 0:
                return True
            i = at + 1 + size + 2
            if i > end:
                return False
        return True

    def _fill(self) -> None:
        """Receive more bytes after what is buffered. Raises: EOFError at end of stream."""
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start            # compact: at most one line is kept
            self._buf[:n] = self._buf[self._start:self._end]
            self._start, self._end = 0, n
        if self._before_recv is not None:
            self._before_recv()
        got = self._recv_into(memoryview(self._buf)[self._end:])
        if not got:
            raise EOFError
        self._end += got

    def _line(self) -> bytes:
        """The next line without its CRLF (a bare LF ends an inline line too)."""
        scanned = 0                  # bytes after _start known to hold no LF
        while True:
            at = self._buf.find(b"\n", self._start + scanned, self._end)
            if at >= 0:
                line = bytes(memoryview(self._buf)[self._start:at])     # one copy
                self._start = at + 1
                return line[:-1] if line.endswith(b"\r") else line
            if self._end - self._start > self.limits.max_inline_bytes:
                raise ProtocolError("too big inline request")
            scanned = self._end - self._start
            self._fill()                 # may move the buffered bytes to the front

    def read_command(self) -> list | None:
        """The next command's arguments (bytes or buffers), or None at a clean end of stream.

        Raises:
            ProtocolError: input that breaks the framing or a limit.
            EOFError: the stream ended inside a command.
        """
        while True:
            if not self.buffered():
                try:
                    self._fill()
                except EOFError:
                    return None
            if self._buf[self._start] == 0x2A:                     # '*'
                return self._multibulk()
            args = split_inline(self._line())
            if any(len(a) > self.limits.max_bulk_bytes for a in args):
                raise ProtocolError("invalid bulk length")    # as a $<len> over the limit
            if args:                       # an empty line is skipped, as Redis does
                return args

    def _multibulk(self) -> list:
        n = _number(self._line()[1:], "multibulk length")
        if n > self.limits.max_args:
            raise ProtocolError("invalid multibulk length")
        if n <= 0:
            return []
        args = []
        for _ in range(n):
            head = self._line()
            if not head.startswith(b"$"):
                raise ProtocolError(f"expected '$', got '{head[:1].decode('latin-1')}'")
            size = _number(head[1:], "bulk length")
            if not 0 <= size <= self.limits.max_bulk_bytes:
                raise ProtocolError("invalid bulk length")
            args.append(self._bulk(size))
        return args

    def _bulk(self, size: int):
        """``size`` bytes and their CRLF: a slice of the buffer, or its own buffer."""
        if size <= self.limits.direct_bytes:
            while self._end - self._start < size + 2:
                self._fill()
            data = bytes(memoryview(self._buf)[self._start:self._start + size])   # one copy
            self._start += size
        else:
            data = _buffer(size)
            view = memoryview(data)
            have = min(size, self._end - self._start)
            view[:have] = self._buf[self._start:self._start + have]
            self._start += have
            while have < size:                 # straight into the value's buffer
                got = self._recv_into(view[have:])
                if not got:
                    raise EOFError
                have += got
            view.release()
        while self._end - self._start < 2:
            self._fill()
        if self._buf[self._start:self._start + 2] != CRLF:
            raise ProtocolError("bulk string not terminated by CRLF")
        self._start += 2
        return data


def _buffer(size: int):
    """A writable buffer of ``size`` bytes; anonymous mmap from 1 MiB, whose pages are
    only taken as the bytes arrive."""
    return mmap.mmap(-1, size) if size >= 1 << 20 else bytearray(size)


def _number(text: bytes, what: str) -> int:
    if not text or len(text) > 20 or not text.lstrip(b"-").isdigit():
        raise ProtocolError(f"invalid {what}")
    return int(text)


_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "b": "\b", "a": "\a", '"': '"', "\\": "\\"}


def _peek_number(text) -> int | None:
    """A length line's number (``text`` without its '*' or '$'), None if it is none."""
    try:
        return int(bytes(text).rstrip(b"\r"))
    except ValueError:
        return None


def split_inline(line: bytes) -> list[bytes]:
    """An inline command's arguments: words split on blanks, "double" quotes with
    \\n \\xHH escapes, 'single' quotes verbatim.

    Raises:
        ProtocolError: an unbalanced quote.
    """
    text = line.decode("latin-1")
    args: list[bytes] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i >= n:
            return args
        word: list[str] = []
        quote = ""
        while True:
            if i >= n:
                if quote:
                    raise ProtocolError("unbalanced quotes in request")
                break
            c = text[i]
            if quote == '"' and c == "\\" and i + 1 < n:
                nxt = text[i + 1]
                if nxt == "x" and i + 3 < n and _is_hex(text[i + 2:i + 4]):
                    word.append(chr(int(text[i + 2:i + 4], 16)))
                    i += 4
                    continue
                word.append(_ESCAPES.get(nxt, nxt))
                i += 2
                continue
            if quote == "'" and c == "\\" and i + 1 < n and text[i + 1] == "'":
                word.append("'")
                i += 2
                continue
            if quote and c == quote:
                i += 1
                if i < n and text[i] not in " \t\r\n":
                    raise ProtocolError("unbalanced quotes in request")
                break
            if not quote and c in "\"'" and not word:
                quote = c
                i += 1
                continue
            if not quote and c in " \t\r\n":
                break
            word.append(c)
            i += 1
        args.append("".join(word).encode("latin-1"))


def _is_hex(s: str) -> bool:
    return all(c in "0123456789abcdefABCDEF" for c in s)


def encode(value, proto: int, out: list) -> None:
    """Append the reply for ``value`` to ``out`` (a list of buffers), for RESP ``proto`` (2 or 3).

    Raises:
        TypeError: a value with no RESP form (a bug in a command).
    """
    if isinstance(value, (bytes, bytearray, memoryview, mmap.mmap)):
        size = value.nbytes if isinstance(value, memoryview) else len(value)
        out.append(b"$%d\r\n" % size)
        if size:
            out.append(value)
        out.append(CRLF)
    elif isinstance(value, Status):
        out.append(b"+" + value.encode() + CRLF)
    elif isinstance(value, str):
        encode(value.encode("utf-8", "surrogateescape"), proto, out)
    elif isinstance(value, RespError):
        out.append(value.line())
    elif isinstance(value, bool):
        out.append(b"#t\r\n" if value else b"#f\r\n") if proto >= 3 else \
            out.append(b":%d\r\n" % int(value))
    elif isinstance(value, int):
        out.append(b":%d\r\n" % value)
    elif value is None:
        out.append(b"_\r\n" if proto >= 3 else b"$-1\r\n")
    elif isinstance(value, float):
        if proto >= 3:
            out.append(b",%s\r\n" % repr(value).encode())
        else:
            encode(repr(value), proto, out)
    elif isinstance(value, (list, tuple)):
        out.append(b"*%d\r\n" % len(value))
        for item in value:
            encode(item, proto, out)
    elif isinstance(value, dict):
        out.append((b"%%%d\r\n" % len(value)) if proto >= 3 else (b"*%d\r\n" % (2 * len(value))))
        for k, v in value.items():
            encode(k, proto, out)
            encode(v, proto, out)
    else:
        raise TypeError(f"no RESP form for {type(value).__name__}")
