"""Sends RESP inputs to the Redis protocol front, one fresh connection each.

Each input: connect, AUTH with the input's role (if any), send the bytes,
shut the sending side, read every reply until the front closes. The front
must close within ``timeout_s`` (it sees the end of the stream); a longer
wait counts as no answer. Replies are counted by their first type byte
(``+``, ``-``, ``:``, ``$``, ``*``, ``%``, ``_``...); an error reply saying
``internal error`` (a verb raised) counts as unexpected, with the input noted.
"""

from __future__ import annotations

import socket

from kvstore.tools.faults.fuzz.report import SurfaceStats
from kvstore.tools.faults.fuzz.resp_inputs import TOKEN_MARK, RespInput, frame

_MAX_READ_BYTES = 64 << 20         # a reply stream longer than this is cut (never expected)


class RespDriver:
    """The ``resp`` surface.

    Args:
        address: the front's host:port.
        tokens: role -> token of the run (placeholders in the inputs).
        stats: where the surface's counts go.
    """

    def __init__(self, address: str, tokens: dict[str, str], stats: SurfaceStats,
                 timeout_s: float = 10.0):
        host, _, port = address.rpartition(":")
        self.where = (host, int(port))
        self.tokens = tokens
        self.subst = {TOKEN_MARK % role.encode(): tok.encode() for role, tok in tokens.items()}
        self.stats = stats
        self.timeout_s = timeout_s

    def send(self, item: RespInput) -> None:
        self.stats.inputs += 1
        self.stats.kinds[item.kind.split(":")[0]] += 1
        data = item.data
        for mark, token in self.subst.items():
            data = data.replace(mark, token)
        if item.auth and item.auth in self.tokens:
            data = frame([b"AUTH", self.tokens[item.auth].encode()]) + data
        try:
            sock = socket.create_connection(self.where, timeout=5.0)
        except OSError:
            self.stats.refused += 1
            return
        try:
            sock.settimeout(self.timeout_s)
            try:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
            except OSError:                  # closed on a protocol error before all was sent
                pass
            replies = self._read(sock)
        except socket.timeout:
            self.stats.no_answer += 1
            self.stats.note(f"{item.kind}: the front did not close within {self.timeout_s} s: "
                            f"{item.data[:120]!r}")
            return
        finally:
            sock.close()
        if not replies:
            self.stats.closed += 1
            return
        kinds = {chr(replies[0])}
        for line in replies.split(b"\r\n"):
            if line[:1] in (b"+", b"-"):
                kinds.add(line[:1].decode())
        for k in kinds:
            self.stats.answers[k] += 1
        if b"internal error" in replies:
            self.stats.unexpected += 1
            self.stats.note(f"{item.kind}: an internal error for {item.data[:160]!r}")

    def _read(self, sock: socket.socket) -> bytes:
        chunks, total = [], 0
        while total < _MAX_READ_BYTES:
            try:
                data = sock.recv(65536)
            except ConnectionResetError:       # closed with unread input (a protocol error)
                break
            if not data:
                break
            chunks.append(data)
            total += len(data)
        return b"".join(chunks)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
