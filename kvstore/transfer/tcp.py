"""TCP transport: the client end of :mod:`kvstore.transfer.protocol`.

Batch operations write every request frame first, then read every
response: one round trip for the whole batch, with the node answering in
order. Values are sent from the caller's memoryviews and received with
``recv_into`` straight into the caller's buffers.
"""

from __future__ import annotations

import socket

from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import (ChecksumMismatch, InvalidArgument, KVStoreError, Unavailable,
                            error_for_code)
from kvstore.keys import value_checksum
from kvstore.transfer.base import ReadItem, Transport, WriteItem
from kvstore.transfer.protocol import REQUEST, RESPONSE, FrameReader, Op, send_parts, tune_socket

_READ_AHEAD_BYTES = 64 * 1024


class NodeConnection:
    """A framed connection to one store node.

    Args:
        host, port: the node's data address.
        timeout_s: socket timeout for connect and each operation.

    Raises:
        Unavailable: the node cannot be reached.
    """

    def __init__(self, host: str, port: int, timeout_s: float = 10.0):
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise Unavailable(f"cannot connect to store node {host}:{port}: {exc}") from exc
        tune_socket(self.sock)
        self.reader = FrameReader(self.sock, _READ_AHEAD_BYTES)
        self.broken = False
        # Replies still owed for requests sent with expect_reply=False; they are
        # read (and must be OK) before the next reply the caller waits for.
        self._owed = 0

    def send(self, op: Op, key: str, object_id: int = 0, size: int = 0, checksum: int = 0,
             payload: memoryview | None = None, parent: str = "", expect_reply: bool = True) -> None:
        """Send one request frame.

        With ``expect_reply=False`` the caller does not wait for the answer
        (used for SHM_RELEASE, saving a round trip); it is checked later.
        """
        if not expect_reply:
            self._owed += 1
        kb = key.encode()
        pb_ = parent.encode()
        try:
            send_parts(self.sock, REQUEST.pack(op, 0, len(kb), len(pb_), object_id, size, checksum)
                       + kb + pb_, payload)
        except OSError as exc:
            self.broken = True
            raise Unavailable(f"send to store node failed: {exc}") from exc

    def send_frames(self, frames: list[tuple[Op, str, int]]) -> None:
        """Send many value-less requests ``(op, key, object_id)`` in one call."""
        buf = bytearray()
        for op, key, object_id in frames:
            kb = key.encode()
            buf += REQUEST.pack(op, 0, len(kb), 0, object_id, 0, 0)
            buf += kb
        try:
            self.sock.sendall(buf)
        except OSError as exc:
            self.broken = True
            raise Unavailable(f"send to store node failed: {exc}") from exc

    def recv_header(self) -> tuple[int, int, int, int, int, str]:
        """Read one response header: (code, object_id, size, checksum, offset, message)."""
        self.flush_owed()
        return self._read_header()

    def _read_header(self) -> tuple[int, int, int, int, int, str]:
        try:
            code, _f, msg_len, _r, object_id, size, checksum, offset = RESPONSE.unpack(
                self.reader.read(RESPONSE.size))
            msg = bytes(self.reader.read(msg_len)).decode(errors="replace") if msg_len else ""
        except Unavailable:
            self.broken = True
            raise
        return code, object_id, size, checksum, offset, msg

    def recv_value_into(self, size: int, dest: memoryview) -> KVStoreError | None:
        """Read a value that follows an OK GET header into ``dest``."""
        try:
            if size > len(dest):
                self.reader.discard(size)
                return InvalidArgument(f"destination holds {len(dest)} B, value is {size} B")
            if size:
                self.reader.read_into(dest[:size])
        except Unavailable:
            self.broken = True
            raise
        return None

    def call(self, op: Op, key: str, object_id: int = 0, size: int = 0, checksum: int = 0,
             payload: memoryview | None = None) -> tuple[int, int, int, int]:
        """One request and its (value-less) response; raises the node's error.

        Returns:
            (object_id, size, checksum, offset) from the response.
        """
        self.send(op, key, object_id, size, checksum, payload)
        code, oid, size, checksum, offset, msg = self.recv_header()
        if code != pb.OK:
            raise error_for_code(code, msg, key=key)
        return oid, size, checksum, offset

    def flush_owed(self) -> None:
        """Read the replies still owed (see :meth:`send`)."""
        while self._owed:
            self._owed -= 1
            code, *_rest, msg = self._read_header()
            if code != pb.OK:
                raise AssertionError(f"store node refused a fire-and-forget request: {msg}")

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def check_read(item: ReadItem, size: int, verify: bool) -> KVStoreError | None:
    """Post-read checks shared by transports: size and, optionally, checksum."""
    if size != item.size_bytes:
        return ChecksumMismatch(f"node returned {size} B, expected {item.size_bytes} B",
                                key=item.key)
    if verify and value_checksum(item.dest[:size]) != item.checksum:
        return ChecksumMismatch("value read does not match its checksum", key=item.key)
    return None


class TcpTransport(Transport):
    """Values inline in TCP frames."""

    name = "tcp"

    def __init__(self, conn: NodeConnection):
        self.conn = conn

    def write_many(self, items: list[WriteItem]) -> list[KVStoreError | None]:
        for it in items:
            self.conn.send(Op.PUT, it.key, it.object_id, len(it.data), it.checksum, it.data,
                           it.parent)
        out: list[KVStoreError | None] = []
        for it in items:
            code, _oid, _size, _ck, _off, msg = self.conn.recv_header()
            out.append(None if code == pb.OK else error_for_code(code, msg, key=it.key))
        return out

    def read_many(self, items: list[ReadItem], verify: bool = True) -> list[KVStoreError | None]:
        self.conn.send_frames([(Op.GET, it.key, it.object_id) for it in items])
        out: list[KVStoreError | None] = []
        for it in items:
            code, _oid, size, _ck, _off, msg = self.conn.recv_header()
            if code != pb.OK:
                out.append(error_for_code(code, msg, key=it.key))
                continue
            err = self.conn.recv_value_into(size, it.dest)
            out.append(err or check_read(it, size, verify))
        return out

    def close(self) -> None:
        self.conn.close()
