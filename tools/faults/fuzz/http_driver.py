"""Sends HTTP inputs as raw bytes over kept-alive connections and parses the answers.

Raw sockets, not an HTTP client: a client library would refuse to send most
of these inputs. One connection is reused while the server keeps it
(HTTP/1.1 keep-alive); an answer with ``Connection: close``, an HTTP/1.0
request, a ``half_close`` input or a failure ends it. A kept connection the
server closed while idle is opened again and the input sent once more (the
usual keep-alive race, not counted). ``slow`` inputs stay open in the
background for ``hold_s`` (at most ``max_held`` at once, the oldest closed
first), so they load the server while the next inputs are answered.

Answers are counted by HTTP status; a 500 (a handler raised) counts as
unexpected too, with the request noted.
"""

from __future__ import annotations

import collections
import socket
import time

from kvstore.tools.faults.fuzz.http_inputs import TOKEN_MARK, HttpInput
from kvstore.tools.faults.fuzz.report import SurfaceStats

_MAX_HEAD_BYTES = 64 * 1024


class _Closed(Exception):
    """The server closed the connection before answering."""


class _Reader:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise _Closed()
        self.buf += chunk

    def until(self, mark: bytes, limit: int) -> bytes:
        while True:
            i = self.buf.find(mark)
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[:i + len(mark)]
                return out
            if len(self.buf) > limit:
                raise ValueError(f"no {mark!r} within {limit} B")
            self._more()

    def skip(self, n: int) -> None:
        while len(self.buf) < n:
            n -= len(self.buf)
            self.buf.clear()
            self._more()
        del self.buf[:n]

    def drain(self) -> None:
        try:
            while True:
                self.buf.clear()
                self._more()
        except _Closed:
            pass


class HttpDriver:
    """The HTTP surface.

    Args:
        address: the front's host:port.
        tokens: role -> token of the run (placeholders in the inputs).
        stats: where the surface's counts go.
        timeout_s: longest wait for an answer (a valid completion runs the model).
    """

    def __init__(self, address: str, tokens: dict[str, str], stats: SurfaceStats,
                 timeout_s: float = 30.0, hold_s: float = 2.0, max_held: int = 8):
        host, _, port = address.rpartition(":")
        self.where = (host, int(port))
        self.subst = {TOKEN_MARK % role.encode(): tok.encode() for role, tok in tokens.items()}
        self.stats = stats
        self.timeout_s = timeout_s
        self.hold_s = hold_s
        self.max_held = max_held
        self._conn: socket.socket | None = None
        self._reader: _Reader | None = None
        self._held: collections.deque[tuple[float, socket.socket]] = collections.deque()

    def _open(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(self.where, timeout=5.0)
        except OSError:
            self.stats.refused += 1
            return None
        sock.settimeout(self.timeout_s)
        return sock

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = self._reader = None

    def send(self, item: HttpInput) -> None:
        self.stats.inputs += 1
        self.stats.kinds[item.kind.split(":")[0]] += 1
        self._release_held(time.monotonic())
        data = item.request
        for mark, token in self.subst.items():
            data = data.replace(mark, token)
        if item.mode == "slow":
            self._hold(data)
            return
        for attempt in (0, 1):
            reused = self._conn is not None
            if self._conn is None:
                self._conn = self._open()
                if self._conn is None:
                    return
                self._reader = _Reader(self._conn)
            try:
                self._exchange(item, data)
                return
            except (_Closed, ConnectionError) as exc:
                self._drop()
                if reused and attempt == 0 and isinstance(exc, (_Closed, ConnectionResetError,
                                                                BrokenPipeError)):
                    continue                   # closed while idle: once more, fresh
                self.stats.closed += 1
                return
            except TimeoutError:
                self.stats.no_answer += 1
                self.stats.note(f"{item.kind}: no answer within {self.timeout_s} s: "
                                f"{item.request[:160]!r}")
                self._drop()
                return
            except (ValueError, OSError) as exc:
                self.stats.unexpected += 1
                self.stats.note(f"{item.kind}: unparsable answer ({exc}): {item.request[:160]!r}")
                self._drop()
                return

    def _exchange(self, item: HttpInput, data: bytes) -> None:
        sock, reader = self._conn, self._reader
        sock.sendall(data)
        if item.mode == "half_close":
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass                            # the server closed first: read what it said
            while True:                         # every answer, then the end of stream
                try:
                    self._response(item, reader, data)
                except _Closed:
                    break
            self._drop()
            self.stats.closed += 1
            return
        close = self._response(item, reader, data, early=item.mode == "early_close")
        if close or item.mode == "early_close":
            self._drop()

    def _response(self, item: HttpInput, reader: _Reader, data: bytes, early: bool = False) -> bool:
        """Read one answer; returns whether the server ends the connection after it."""
        head = reader.until(b"\r\n\r\n", _MAX_HEAD_BYTES).decode("latin-1")
        status_line, *lines = head.split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/"):
            raise ValueError(f"status line {status_line[:80]!r}")
        status = parts[1]
        self.stats.answers[status] += 1
        if status.startswith("5") and status != "503":
            self.stats.unexpected += 1
            self.stats.note(f"{item.kind}: {status_line[:100]} for {item.request[:200]!r}")
        headers = {}
        for line in lines:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip().lower()
        if early:
            return True
        close = headers.get("connection") == "close" or data.split(b"\r\n", 1)[0].endswith(
            b"HTTP/1.0")
        if data.startswith(b"HEAD ") or status in ("204", "304"):
            return close
        if headers.get("transfer-encoding") == "chunked":
            while True:
                size = int(reader.until(b"\r\n", 1024).split(b";")[0] or b"0", 16)
                reader.skip(size + 2) if size else reader.until(b"\r\n", 64 * 1024)
                if not size:
                    break
        elif "content-length" in headers:
            reader.skip(int(headers["content-length"]))
        else:
            reader.drain()
            return True
        return close

    # ---- slowloris ----
    def _hold(self, data: bytes) -> None:
        sock = self._open()
        if sock is None:
            return
        try:
            sock.sendall(data)
        except OSError:
            sock.close()
            self.stats.closed += 1
            return
        if len(self._held) >= self.max_held:
            self._held.popleft()[1].close()
        self._held.append((time.monotonic() + self.hold_s, sock))

    def _release_held(self, now: float) -> None:
        while self._held and self._held[0][0] <= now:
            self._held.popleft()[1].close()

    def flush(self) -> None:
        """Nothing is queued between inputs; held connections stay until their time."""

    def close(self) -> None:
        while self._held:
            self._held.popleft()[1].close()
        self._drop()
