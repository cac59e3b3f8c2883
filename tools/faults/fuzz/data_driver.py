"""Sends data-port inputs over TCP or the Unix socket and reads what the node answers.

Connections are kept: inputs that leave the stream on a frame boundary
(:class:`~.framing.End` OPEN) are pipelined, up to ``max_burst`` inputs or
``max_burst_bytes``, on one connection per session kind (authenticated with
the client token, or anonymous), and their replies read in one go. An input
after which the node closes ends its burst: only the bytes the node reads are
sent (so the close is clean, not a reset), its replies are read, then the
end of stream. An input that stops inside a frame ends its burst too: the
driver half-closes the connection (an abrupt close mid-value) and reads to
the end of stream. A new connection is opened for the next burst.

Nothing the driver holds grows with the run: at most two connections, one
burst of bytes, one read-ahead buffer.
"""

from __future__ import annotations

import socket
from typing import Callable

from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import NONCE_BYTES, proof
from kvstore.errors import Unavailable
from kvstore.transfer.protocol import REQUEST, RESPONSE, FrameReader, Op
from kvstore.tools.faults.fuzz.frames import DataInput
from kvstore.tools.faults.fuzz.framing import VALUE_OPS, End, plan
from kvstore.tools.faults.fuzz.report import SurfaceStats

_CODE_NAMES = {v: k for k, v in pb.Code.items()}


class _Desync(Exception):
    """The node answered otherwise than its rules say."""


class _Conn:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.reader = FrameReader(sock, 64 * 1024)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class DataDriver:
    """One data surface (TCP or Unix socket).

    Args:
        connect: opens a new connected socket (raises OSError when refused).
        token: the client token the authenticated sessions prove.
        stats: where the surface's counts go.
        timeout_s: longest wait for any one reply (a PUT's reply waits for the
            master's acknowledgement, up to the node's ack timeout).
    """

    def __init__(self, connect: Callable[[], socket.socket], token: str, stats: SurfaceStats,
                 timeout_s: float = 10.0, max_burst: int = 64, max_burst_bytes: int = 128 * 1024):
        self.connect = connect
        self.token = token
        self.stats = stats
        self.timeout_s = timeout_s
        self.max_burst = max_burst
        self.max_burst_bytes = max_burst_bytes
        self._conns: dict[bool, _Conn | None] = {True: None, False: None}
        self._bursts: dict[bool, list[tuple[DataInput, object]]] = {True: [], False: []}
        self._burst_bytes = {True: 0, False: 0}

    # ---- the public side ----
    def send(self, item: DataInput) -> None:
        """Queue one input; it is sent with its burst (see the module docstring)."""
        self.stats.inputs += 1
        self.stats.kinds[item.kind.split(":")[0]] += 1
        p = plan(item.data, item.authed)
        burst = self._bursts[item.authed]
        burst.append((item, p))
        self._burst_bytes[item.authed] += len(item.data)
        if (p.end is not End.OPEN or len(burst) >= self.max_burst
                or self._burst_bytes[item.authed] >= self.max_burst_bytes):
            self._flush(item.authed)

    def flush(self) -> None:
        """Send whatever is queued (end of a batch)."""
        for authed in (True, False):
            if self._bursts[authed]:
                self._flush(authed)

    def close(self) -> None:
        for authed, conn in self._conns.items():
            if conn is not None:
                conn.close()
            self._conns[authed] = None

    # ---- bursts ----
    def _flush(self, authed: bool) -> None:
        burst, self._bursts[authed] = self._bursts[authed], []
        self._burst_bytes[authed] = 0
        conn = self._conns[authed] or self._open(authed)
        if conn is None:
            return
        last = burst[-1][1]
        parts = [item.data for item, _p in burst[:-1]]
        parts.append(burst[-1][0].data[:last.consumed] if last.end is End.CLOSED
                     else burst[-1][0].data)
        replies = [op for _item, p in burst for op in p.replies]
        try:
            conn.sock.sendall(b"".join(parts))
            if last.end is End.PARTIAL:
                conn.sock.shutdown(socket.SHUT_WR)     # the rest of the frame never comes
                self._read_to_end(conn, replies)
            else:
                for op in replies:
                    self._read_reply(conn, op)
                if last.end is End.CLOSED:
                    self._expect_end(conn)
        except _Desync as exc:
            self.stats.unexpected += 1
            self._note(burst, f"desync: {exc}")
            self._drop(authed)
            return
        except (Unavailable, OSError) as exc:
            if isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError):
                self.stats.no_answer += 1
                self._note(burst, f"no answer within {self.timeout_s} s")
            else:
                self.stats.unexpected += 1      # closed or reset before the rules say
                self._note(burst, f"connection ended early: {exc}")
            self._drop(authed)
            return
        if last.end is not End.OPEN:
            self.stats.closed += 1
            self._drop(authed)

    def _note(self, burst: list, what: str) -> None:
        last = burst[-1][0]
        self.stats.note(f"{what}; burst of {len(burst)}, last {last.kind} "
                        f"(authed={last.authed}): {last.data[:96].hex()}")

    def _drop(self, authed: bool) -> None:
        conn = self._conns[authed]
        if conn is not None:
            conn.close()
        self._conns[authed] = None

    def _open(self, authed: bool) -> _Conn | None:
        try:
            sock = self.connect()
        except OSError:
            self.stats.refused += 1
            return None
        sock.settimeout(self.timeout_s)
        conn = _Conn(sock)
        if authed:
            try:
                self._handshake(conn)
            except (Unavailable, OSError, _Desync):
                self.stats.refused += 1
                conn.close()
                return None
        self._conns[authed] = conn
        return conn

    def _handshake(self, conn: _Conn) -> None:
        conn.sock.sendall(REQUEST.pack(Op.AUTH_HELLO, 0, 0, 0, 0, 0, 0))
        code, size, _msg = self._header(conn)
        if code != pb.OK or size != NONCE_BYTES:
            raise _Desync(f"AUTH_HELLO answered {_CODE_NAMES.get(code, code)}")
        nonce = bytes(conn.reader.read(size))
        answer = proof(self.token, nonce)
        conn.sock.sendall(REQUEST.pack(Op.AUTH_PROVE, 0, 0, 0, 0, len(answer), 0) + answer)
        code, _size, _msg = self._header(conn)
        if code != pb.OK:
            raise _Desync(f"AUTH_PROVE answered {_CODE_NAMES.get(code, code)}")

    # ---- replies ----
    @staticmethod
    def _header(conn: _Conn) -> tuple[int, int, bytes]:
        code, _f, msg_len, _r, _oid, size, _ck, _off, _serial = RESPONSE.unpack(
            conn.reader.read(RESPONSE.size))
        if msg_len > 1024:
            raise _Desync(f"a reply message of {msg_len} B")
        return code, size, bytes(conn.reader.read(msg_len))

    def _read_reply(self, conn: _Conn, op: int) -> None:
        code, size, _msg = self._header(conn)
        if code not in _CODE_NAMES:
            raise _Desync(f"reply code {code}")
        self.stats.answers[_CODE_NAMES[code]] += 1
        if code == pb.OK and op in VALUE_OPS:
            conn.reader.discard(size)

    def _expect_end(self, conn: _Conn) -> None:
        """After a closing reply the node sends nothing more."""
        try:
            conn.reader.read(1)
        except Unavailable as exc:
            if isinstance(exc.__cause__, TimeoutError):
                raise
            return                                  # end of stream (or reset): closed
        raise _Desync("bytes after the node's closing reply")

    def _read_to_end(self, conn: _Conn, replies: list[int]) -> None:
        """A burst that stops mid-frame: the node answers at most the frames before the
        cut (the replies it had queued may be dropped with the connection), nothing for
        the cut frame, then closes."""
        for op in replies:
            try:
                self._read_reply(conn, op)
            except Unavailable as exc:
                if isinstance(exc.__cause__, TimeoutError):
                    raise
                return                              # the rest of the replies were dropped
        self._expect_end(conn)


def tcp_connector(host: str, port: int) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        sock = socket.create_connection((host, port), timeout=5.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        return sock
    return connect


def unix_connector(address: str) -> Callable[[], socket.socket]:
    def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(5.0)
            sock.connect(address)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        except OSError:
            sock.close()
            raise
        return sock
    return connect
