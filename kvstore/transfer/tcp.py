"""TCP transport: the client end of :mod:`kvstore.transfer.protocol`.

Batch operations write every request frame first, then read every
response: one round trip for the whole batch, with the node answering in
order. Values are sent from the caller's memoryviews and received with
``recv_into`` straight into the caller's buffers.

Deferred frames: a read reference (SHM_ACQUIRE) is dropped with an
SHM_RELEASE that nobody waits for. It is not sent on its own: it rides in
front of the connection's next request (one ``send`` and one node wake-up
instead of two per get), and a per-process flusher thread sends it after
:data:`DEFER_FLUSH_S` if the connection stays idle, so an idle client never
keeps memory referenced for longer than that.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from typing import Callable

from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import proof
from kvstore.errors import (ChecksumMismatch, InvalidArgument, KVStoreError, ProtocolError,
                            Unavailable, code_name, error_for_code)
from kvstore.transfer import codec
from kvstore.transfer.base import ReadItem, Transport, WriteItem
from kvstore.transfer.protocol import (MAX_UNANSWERED, REQUEST, RESPONSE, FrameReader, Op,
                                       hello_nonce_bytes, send_parts, tune_socket)
from kvstore.types import TransportKind

_READ_AHEAD_BYTES = 8 * 1024
#: A GET value at least this large is hashed while it arrives when it is verified.
HASH_WHILE_RECEIVING_BYTES = 256 * 1024
#: Longest time a deferred frame (SHM_RELEASE) waits for the next request, in seconds.
DEFER_FLUSH_S = 0.005

class NodeConnection:
    """A framed connection to one store node.

    Args:
        host, port: the node's data address (TCP).
        timeout_s: socket timeout for connect and each operation.
        unix_address: connect to this Unix socket instead (a node on this
            host, see :func:`kvstore.transfer.protocol.local_address`).
        token: authenticate with it (the handshake of
            :mod:`kvstore.transfer.protocol`); None: anonymous.
        tls: wrap the TCP connection in TLS with this client context
            (:func:`kvstore.tls.client_context`); never for a Unix socket.

    Raises:
        Unavailable: the node cannot be reached.
        Unauthenticated: the node refused the token.
    """

    def __init__(self, host: str, port: int, timeout_s: float = 10.0,
                 unix_address: str | None = None, token: str | None = None,
                 tls: ssl.SSLContext | None = None):
        try:
            if unix_address:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    self.sock.settimeout(timeout_s)
                    self.sock.connect(unix_address)
                except OSError:
                    self.sock.close()
                    raise
            else:
                self.sock = socket.create_connection((host, port), timeout=timeout_s)
                if tls is not None:
                    try:
                        self.sock = tls.wrap_socket(self.sock, server_hostname=host)
                    except OSError:
                        self.sock.close()
                        raise
        except (OSError, UnicodeError, ValueError, OverflowError) as exc:
            # UnicodeError: a host no resolver takes (an IDNA label over 63 chars);
            # OverflowError: a port outside 0-65535. Both are the address's fault.
            where = f"{host[:80]}:{port}" if not unix_address else repr(unix_address)
            raise Unavailable(f"cannot connect to store node {where}: {exc}") from exc
        tune_socket(self.sock)
        self.reader = FrameReader(self.sock, _READ_AHEAD_BYTES)
        self.broken = False
        # Sends come from the owning thread and the flusher; the lock keeps
        # frames whole and the reply count right.
        self._lock = threading.Lock()
        self._deferred = bytearray()   # encoded frames waiting for the next send
        self._deferred_n = 0
        self._flush_queued = False     # with the flusher, which will call flush_deferred
        # Replies still owed for requests sent without waiting (deferred frames);
        # they are read (and must be OK) before the next reply the caller waits for.
        self._owed = 0
        if token:
            self._authenticate(token)

    def _authenticate(self, token: str) -> None:
        """The data-port handshake: AUTH_HELLO, then the proof of the nonce (if asked)."""
        try:
            self.send(Op.AUTH_HELLO, "")
            code, _oid, size, _ck, _off, msg = self.recv_header()
            if not hello_nonce_bytes(code, size, msg):
                return                   # the node needs no authentication
            nonce = bytearray(size)
            self.recv_value_into(size, memoryview(nonce))
            answer = proof(token, bytes(nonce))
            self.send(Op.AUTH_PROVE, "", size=len(answer), payload=memoryview(answer))
            code, *_rest, msg = self.recv_header()
            if code != pb.OK:
                raise error_for_code(code, msg)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _frame(op: Op, key: str, object_id: int = 0, size: int = 0, checksum: int = 0,
               parent: str = "", flags: int = 0) -> bytes:
        kb = key.encode()
        pb_ = parent.encode()
        return REQUEST.pack(op, min(flags, 255), len(kb), len(pb_), object_id, size,
                            checksum) + kb + pb_

    def _send_locked(self, frames: bytes, payload: memoryview | None = None) -> None:
        if self._deferred:
            frames = bytes(self._deferred) + frames
            self._owed += self._deferred_n
            self._deferred.clear()
            self._deferred_n = 0
        try:
            send_parts(self.sock, frames, payload)
        except OSError as exc:
            self.broken = True
            raise Unavailable(f"send to store node failed: {exc}") from exc

    def send(self, op: Op, key: str, object_id: int = 0, size: int = 0, checksum: int = 0,
             payload: memoryview | None = None, parent: str = "", flags: int = 0) -> None:
        """Send one request frame (after any deferred ones); ``flags``: see the protocol."""
        frame = self._frame(op, key, object_id, size, checksum, parent, flags)
        with self._lock:
            self._send_locked(frame, payload)

    def send_frames(self, frames: list[tuple[Op, str, int]]) -> None:
        """Send many value-less requests ``(op, key, object_id)`` in one call."""
        buf = b"".join(self._frame(op, key, object_id) for op, key, object_id in frames)
        with self._lock:
            self._send_locked(buf)

    def defer(self, op: Op, key: str, object_id: int = 0) -> None:
        """Queue a value-less request whose reply nobody waits for (SHM_RELEASE).

        It goes out with the next request, or from the flusher within
        :data:`DEFER_FLUSH_S`; its reply must be OK and is checked before the
        next reply the caller reads, or here once :data:`MAX_UNANSWERED` are
        owed (a refusal or a broken connection then closes it: the owner's
        next call sees that). Call it from the connection's owner only.
        """
        frame = self._frame(op, key, object_id)
        with self._lock:
            self._deferred += frame
            self._deferred_n += 1
            queue = not self._flush_queued
            self._flush_queued = True
            drain = self._owed >= MAX_UNANSWERED and not self.broken
        if queue:
            _flusher().add(self)
        if drain:
            try:
                self.flush_owed()
            except (Unavailable, ProtocolError):
                pass   # closed (broken): the owner sees it at its next call

    def flush_deferred(self) -> None:
        """Send the deferred frames now (no-op when there are none or the connection broke)."""
        with self._lock:
            self._flush_queued = False
            if self._deferred and not self.broken:
                try:
                    self._send_locked(b"")
                except Unavailable:
                    pass   # the owner sees the broken connection at its next call

    def recv_header(self) -> tuple[int, int, int, int, int, str]:
        """Read one response header: (code, object_id, size, checksum, offset, message)."""
        code, object_id, size, checksum, offset, _serial, msg = self.recv_reply()
        return code, object_id, size, checksum, offset, msg

    def recv_reply(self) -> tuple[int, int, int, int, int, int, str]:
        """Read one response header with its allocation serial:
        (code, object_id, size, checksum, offset, serial, message)."""
        self.flush_owed()
        return self._read_header()

    def _read_header(self) -> tuple[int, int, int, int, int, int, str]:
        try:
            code, _f, msg_len, _r, object_id, size, checksum, offset, serial = RESPONSE.unpack(
                self.reader.read(RESPONSE.size))
            msg = bytes(self.reader.read(msg_len)).decode(errors="replace") if msg_len else ""
        except Unavailable:
            self.broken = True
            raise
        return code, object_id, size, checksum, offset, serial, msg

    def recv_value_into(self, size: int, dest: memoryview, hashed: list | None = None
                        ) -> KVStoreError | None:
        """Read a value that follows an OK GET header into ``dest``.

        Args:
            hashed: when given, a value of :data:`HASH_WHILE_RECEIVING_BYTES` or
                more is hashed as it arrives (natively, GIL released) and its
                XXH3-64 appended here; a smaller one appends None (it is taken
                with the frames after it in one system call, then hashed by the
                caller from the cache).
        """
        try:
            if size > len(dest):
                self.reader.discard(size)
                return InvalidArgument(f"destination holds {len(dest)} B, value is {size} B")
            if hashed is not None and size >= HASH_WHILE_RECEIVING_BYTES:
                hashed.append(self.reader.read_into_hashed(dest[:size]))
                return None
            if hashed is not None:
                hashed.append(None)
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
        """Read the replies still owed for deferred frames that were sent.

        Raises:
            ProtocolError: the node refused one (it holds no read reference the
                client thinks it holds): the connection is closed.
            Unavailable: the connection broke.
        """
        while True:
            with self._lock:
                n = min(self._owed, MAX_UNANSWERED)
                if not n:
                    return
            # The common case in one step: every owed reply already buffered, each an
            # OK header without a message.
            run = self.reader.peek(n * RESPONSE.size) if n > 1 else None
            if run is not None and _all_ok(run, n):
                self.reader.read(n * RESPONSE.size)
                with self._lock:
                    self._owed -= n
                continue
            with self._lock:
                self._owed -= 1
            code, *_rest, msg = self._read_header()
            if code != pb.OK:
                self.close()
                raise ProtocolError(f"store node refused a deferred request: "
                                    f"{code_name(code)}: {msg}")

    def close(self) -> None:
        """Close the socket; the connection counts as broken from now on."""
        self.broken = True
        try:
            self.sock.close()
        except OSError:
            pass


def _all_ok(run: memoryview, n: int) -> bool:
    """Whether ``run`` (``n`` response headers) holds OK replies without messages only."""
    size = RESPONSE.size      # code u8 at 0, msg_len u16 at 2 (kvstore.transfer.protocol)
    zeros = bytes(n)
    return (pb.OK == 0 and run[0::size].tobytes() == zeros and run[2::size].tobytes() == zeros
            and run[3::size].tobytes() == zeros)


class _Flusher:
    """Sends the deferred frames of connections left idle (one daemon thread per process)."""

    def __init__(self):
        self.pid = os.getpid()
        self._cond = threading.Condition()
        self._pending: list[NodeConnection] = []
        threading.Thread(target=self._run, name="kvstore-defer-flush", daemon=True).start()

    def add(self, conn: NodeConnection) -> None:
        with self._cond:
            self._pending.append(conn)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
            time.sleep(DEFER_FLUSH_S)
            with self._cond:
                conns, self._pending = self._pending, []
            for conn in conns:
                conn.flush_deferred()


_FLUSHER: _Flusher | None = None
_FLUSHER_LOCK = threading.Lock()


def _flusher() -> _Flusher:
    """This process's flusher (a forked child starts its own)."""
    global _FLUSHER
    with _FLUSHER_LOCK:
        if _FLUSHER is None or _FLUSHER.pid != os.getpid():
            _FLUSHER = _Flusher()
        return _FLUSHER


def check_read(item: ReadItem, size: int, verify: bool, actual: int | None = None
               ) -> KVStoreError | None:
    """Post-read checks shared by transports: size and, optionally, checksum.

    Args:
        actual: the XXH3-64 of ``item.dest[:size]`` when the copy or receive
            computed it on the way (:mod:`kvstore.transfer.codec`); None: hashed here.
    """
    if size != item.size_bytes:
        return ChecksumMismatch(f"node returned {size} B, expected {item.size_bytes} B",
                                key=item.key)
    if verify:
        if actual is None:
            actual = codec.value_hash(item.dest[:size])
        if actual != item.checksum:
            return ChecksumMismatch("value read does not match its checksum", key=item.key)
    return None


#: A remembered location of an object in a node's memory: (offset, size_bytes, serial).
Location = tuple[int, int, int]


def read_by_reference(conn: NodeConnection, items: list[ReadItem], verify: bool,
                      move: Callable[[list[tuple[int, Location]]], dict[int, KVStoreError]],
                      guess: Callable[[], dict[int, Location]] | None = None,
                      hashed: dict[int, int] | None = None) -> list[KVStoreError | None]:
    """Reads through the node's memory (shared memory, RDMA): the reference protocol.

    SHM_ACQUIRE every item (one round trip; the node takes a read reference
    and answers offset, size and the allocation's serial), ``move`` the
    bytes, then drop the references with deferred SHM_RELEASE frames. An
    object on a slower tier that DRAM had no room for (NO_SPACE) is read over
    TCP instead. A broken connection is closed rather than released: the
    node drops a closed connection's references itself, once nothing can
    still be moving.

    Args:
        move: takes ``(index, location)`` jobs, fills ``items[index].dest``
            and returns the errors of the jobs that failed (absent = moved).
        guess: optional; runs while the acquires are in flight and may
            already copy values from locations remembered from earlier reads;
            returns ``{index: location}`` of what it copied. A reply that
            names the same allocation (offset, size and serial) confirms the
            copy, and that item is not moved again. Sound because a serial
            names one lifetime of a range: the allocation was live when it was
            remembered and still is at the acquire, so it was live, with the
            same immutable bytes, throughout the copy in between.
        hashed: optional; ``{index: xxh3-64}`` that ``move`` and ``guess`` fill
            with the checksum of what they copied last into ``items[index].dest``
            when they hashed it on the way (a fused copy): not hashed again.

    Returns:
        Per item: None or the error, in input order.
    """
    out: list[KVStoreError | None] = [None] * len(items)
    conn.send_frames([(Op.SHM_ACQUIRE, it.key, it.object_id) for it in items])
    guessed = guess() if guess is not None else {}
    replies = [conn.recv_reply() for _ in items]
    held: list[tuple[str, int]] = []
    jobs: list[tuple[int, Location]] = []
    try:
        for idx, (it, (code, oid, size, _ck, offset, serial, msg)) in enumerate(
                zip(items, replies)):
            if code != pb.OK:
                out[idx] = error_for_code(code, msg, key=it.key)
                continue
            held.append((it.key, oid))
            if size > len(it.dest):
                out[idx] = InvalidArgument(f"destination holds {len(it.dest)} B, "
                                           f"value is {size} B", key=it.key)
                continue
            if guessed.get(idx) != (offset, size, serial):
                jobs.append((idx, (offset, size, serial)))
        failed = move(jobs)
        for idx, (code, _oid, size, *_rest) in enumerate(replies):
            if code == pb.OK and out[idx] is None:
                out[idx] = failed.get(idx) or check_read(
                    items[idx], size, verify, hashed.get(idx) if hashed else None)
    finally:
        if conn.broken:
            conn.close()
        else:
            for key, oid in held:
                conn.defer(Op.SHM_RELEASE, key, oid)
    fallback = [idx for idx, reply in enumerate(replies) if reply[0] == pb.NO_SPACE]
    if fallback and not conn.broken:
        for idx, err in zip(fallback, TcpTransport(conn).read_many(
                [items[i] for i in fallback], verify)):
            out[idx] = err
    return out


class TcpTransport(Transport):
    """Values inline in TCP frames."""

    kind = TransportKind.TCP

    def __init__(self, conn: NodeConnection):
        self.conn = conn

    def write_many(self, items: list[WriteItem]) -> list[KVStoreError | None]:
        # Each value is hashed just before it is sent (its header carries the
        # checksum), not all of them first: the node takes in one value while
        # the next is hashed (a batch of 32 x 1 MiB spent 1.7 ms hashing before
        # its first byte left).
        for it in items:
            if it.checksum is None:
                it.checksum = codec.value_hash(it.data)
            self.conn.send(Op.PUT, it.key, it.object_id, len(it.data), it.checksum, it.data,
                           it.parent, it.replica_num)
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
            hashed: list | None = [] if verify else None
            err = self.conn.recv_value_into(size, it.dest, hashed)
            out.append(err or check_read(it, size, verify, hashed[0] if hashed else None))
        return out

    def close(self) -> None:
        self.conn.close()
