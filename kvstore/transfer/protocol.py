"""The store node's binary data protocol (TCP).

Every request is a fixed 32-byte header, the key, then for PUT the value::

    request   | op u8 | flags u8 | key_len u16 | parent_len u32 | object_id u64 | size u64 | checksum u64 | key | parent | value
    response  | code u8 | flags u8 | msg_len u16 | reserved u32 | object_id u64 | size u64 | checksum u64 | offset u64 | serial u64 | msg | value

PIN, UNPIN and PREFETCH carry their argument (a TTL, a kind, a deadline in
milliseconds) in ``size`` and send no value; STATS sends an empty key and
gets JSON back as the value. ``offset`` and ``serial`` (SHM_ALLOC,
SHM_ACQUIRE) say where the object lives in the node's shared memory and
which allocation of that range holds it (unique per node lifetime).

``parent`` (PUT and SHM_ALLOC only, may be empty) is the key of the previous
block of the object's prefix chain: an eviction hint (a chain's tail goes
before its head). ``flags`` of a PUT or SHM_ALLOC is the number of replicas
the put asked for (0: not said; other requests send 0): the node keeps it
with the object, on SSD too, and announces it in its inventory, so a master
that rebuilds its index after a restart still repairs the key to that count. All integers are little-endian. ``code`` is a :class:`kvstore._proto.kvstore_pb2.Code`
(0 = OK). A response carries a value only for an OK GET or STATS. Requests on one
connection are answered in order, so a client may pipeline many frames and
read the answers afterwards (batch operations do one round trip).

Values are received with ``recv_into`` straight into their final memory (the
node's shared-memory segment on PUT, the caller's buffer on GET) and sent
from memoryviews: no per-byte Python work and no intermediate bytes objects.

Authentication (a node started with ``--auth``): before anything else a
client sends AUTH_HELLO, gets a fresh nonce, and answers AUTH_PROVE with an
HMAC of the nonce under its token (:mod:`kvstore.auth`); the token itself
never crosses the link. Any other first request gets UNAUTHENTICATED and the
connection is closed. Over TLS (:mod:`kvstore.tls`) the same frames travel
inside the TLS stream; the scatter/gather system calls are replaced by plain
sends and receives there, which TLS sockets require.
"""

from __future__ import annotations

import enum
import socket
import ssl
import struct
import time

from kvstore._proto import kvstore_pb2 as _pb
from kvstore.auth import NONCE_BYTES
from kvstore.errors import Unavailable, error_for_code
from kvstore.transfer import codec

REQUEST = struct.Struct("<BBHIQQQ")
RESPONSE = struct.Struct("<BBHIQQQQQ")
MAX_KEY_BYTES = 65535
#: Frames a client may leave unanswered on one connection when it never waits for
#: their answers (the deferred SHM_TOUCH of a same-host get that copied a known
#: location): past this many the sync SDK reads the answers it owes
#: (``NodeConnection.defer``) and the asyncio SDK gives its event loop a turn after
#: such a get (``AsyncShm``). Left unread, the answers filled the socket: the node's
#: sends stalled, then its reads, then the client's sends (a sync get of 10 s, the
#: socket timeout, every few hundred thousand gets, and the node dropped the
#: connection as a stalled reader; an asyncio get of 50 -> 370 ms, growing).
MAX_UNANSWERED = 128


def hello_nonce_bytes(code: int, size: int, message: str) -> int:
    """Read a node's answer to AUTH_HELLO (the handshake's first step, blocking and
    asyncio clients alike): the size of the nonce to prove, 0 when the node needs
    no authentication.

    Raises:
        KVStoreError: the node refused (its code and message).
        Unavailable: a nonce of more than NONCE_BYTES (not a node of ours).
    """
    if code != _pb.OK:
        raise error_for_code(code, message)
    if size > NONCE_BYTES:
        raise Unavailable(f"the node sent a nonce of {size} B")
    return size


class StreamEnded(Unavailable):
    """The peer closed the connection, or the socket failed (or timed out), while
    bytes of a frame were awaited: nothing more can be read from this stream, and
    what was buffered of the frame is not a frame."""


class Op(enum.IntEnum):
    PUT = 1          # write a value inline; size bytes follow the key
    GET = 2          # read a value inline
    SHM_ALLOC = 3    # reserve space in the shm segment; reply carries offset
    SHM_COMMIT = 4   # the client has written the reserved space; verify and publish
                     # (checksum != 0: the value's checksum, known only now)
    SHM_ACQUIRE = 5  # take a read reference; reply carries offset, size, checksum
    SHM_RELEASE = 6  # drop a read reference taken by SHM_ACQUIRE
    SHM_ABORT = 7    # give back a reservation from SHM_ALLOC
    PING = 8
    PIN = 9          # pin an object: size = ttl_ms; 0 = hard pin (until UNPIN), > 0 = soft pin
    UNPIN = 10       # size 0: drop one hard pin; size 1: drop the soft pin
    PREFETCH = 11    # queue lookahead: size = deadline_ms; promote to DRAM, protect until read
    STATS = 12       # node-side stats: the reply's value is JSON (size = its length)
    AUTH_HELLO = 13  # start of the handshake: the reply's value is the node's nonce
                     # (NONCE_BYTES), or empty when the node needs no authentication
    AUTH_PROVE = 14  # the value is HMAC-SHA256(token, nonce) (kvstore.auth.proof)
    DROP = 15        # drop this version (object_id required) of a key its master removed:
                     # the remover's SDK sends it before remove returns (reported EVICTED)
    SHM_TOUCH = 16   # a same-host reader copied this version without a reference
                     # (kvstore.transfer.shm_slots): count the read; always OK


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``.

    Raises:
        StreamEnded: the peer closed the connection or the socket failed.
    """
    got = 0
    n = len(view)
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got)
        except OSError as exc:
            raise StreamEnded(f"connection failed while receiving: {exc}") from exc
        if k == 0:
            raise StreamEnded("connection closed by peer")
        got += k


#: A value received over TLS and hashed is hashed in pieces of about this size (in L2).
_HASH_PIECE_BYTES = 256 << 10


class FrameReader:
    """Buffered reads from a socket: many small frames per ``recv`` call.

    Headers and keys are served from an internal buffer; a value is copied
    from what is already buffered and the rest received straight into its
    destination (``recv_into``), so large values are never staged.

    Every read raises :class:`StreamEnded` when the peer closes the connection
    or the socket fails before the bytes asked for arrived.

    Args:
        sock: a connected socket.
        buffer_bytes: size of the read-ahead buffer.
    """

    def __init__(self, sock: socket.socket, buffer_bytes: int = 256 * 1024):
        self.sock = sock
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._buf = bytearray(buffer_bytes)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def _make_room(self, need: int) -> None:
        if len(self._buf) - self._start < need:
            n = self._end - self._start
            self._buf[:n] = self._view[self._start:self._end]
            self._start, self._end = 0, n

    def _fill(self, need: int) -> None:
        self._make_room(need)
        while self._end - self._start < need:
            try:
                k = self.sock.recv_into(self._view[self._end:])
            except OSError as exc:
                raise StreamEnded(f"connection failed while receiving: {exc}") from exc
            if k == 0:
                raise StreamEnded("connection closed by peer")
            self._end += k

    def buffered(self) -> int:
        """Bytes received and not yet read (0: the next read may block)."""
        return self._end - self._start

    def peek(self, n: int) -> memoryview | None:
        """The next ``n`` bytes if they are buffered (not consumed), else None."""
        if self._end - self._start < n:
            return None
        return self._view[self._start:self._start + n]

    def lend(self, reader):
        """Let ``reader(buffer, start, end) -> (start, end, result)`` (a native reader of
        the same socket) take frames from the unread bytes ``buffer[start:end]`` and
        receive more into ``buffer``; what it leaves unread is read here next.
        Returns its ``result``."""
        self._start, self._end, result = reader(self._buf, self._start, self._end)
        return result

    def poll(self, need: int, seconds: float) -> None:
        """Try, without blocking, for up to ``seconds`` to have ``need`` bytes buffered.

        Busy-polls the socket (MSG_DONTWAIT; a TLS socket is made non-blocking
        for the while, as it takes no flags), so a request that follows soon
        is taken without the sleep and wake-up a blocking ``recv`` costs (tens
        of microseconds on a virtual machine), and a pipelined batch is seen
        whole. Returns early at end of stream.
        """
        self._make_room(need)
        if self._tls:
            timeout = self.sock.gettimeout()
            self.sock.setblocking(False)
            recv = self.sock.recv_into
        else:
            def recv(view: memoryview) -> int:
                return self.sock.recv_into(view, 0, socket.MSG_DONTWAIT)
        deadline = time.perf_counter() + seconds
        try:
            while self._end - self._start < need:
                try:
                    k = recv(self._view[self._end:])
                except (BlockingIOError, InterruptedError, ssl.SSLWantReadError,
                        ssl.SSLWantWriteError):
                    if time.perf_counter() >= deadline:
                        return
                    continue
                except OSError:
                    return             # the blocking read that follows reports it
                if k == 0:
                    return
                self._end += k
        finally:
            if self._tls:
                self.sock.settimeout(timeout)

    def read(self, n: int) -> memoryview:
        """The next ``n`` bytes (n <= buffer size); valid until the next call."""
        self._fill(n)
        view = self._view[self._start:self._start + n]
        self._start += n
        return view

    def _take_buffered(self, dest: memoryview) -> int:
        """Copy what is buffered of ``dest``'s bytes into it; how many that was."""
        got = min(self._end - self._start, len(dest))
        if got:
            dest[:got] = self._view[self._start:self._start + got]
            self._start += got
        return got

    def read_into(self, dest: memoryview) -> None:
        """Fill ``dest`` with the next ``len(dest)`` bytes.

        What is not buffered yet is received straight into ``dest``, with the
        bytes that follow it (the next frames of a pipelined batch) landing in
        the buffer in the same ``recvmsg_into`` call: one system call per value
        of a batch, not two.
        """
        n = len(dest)
        got = self._take_buffered(dest)
        if got == n:
            return
        self._start = self._end = 0          # every buffered byte went to dest
        if self._tls:                        # no recvmsg on TLS sockets: the value alone
            while got < n:
                try:
                    k = self.sock.recv_into(dest[got:], n - got)
                except OSError as exc:
                    raise StreamEnded(f"connection failed while receiving: {exc}") from exc
                if k == 0:
                    raise StreamEnded("connection closed by peer")
                got += k
            return
        while got < n:
            try:
                k = self.sock.recvmsg_into([dest[got:], self._view])[0]
            except OSError as exc:
                raise StreamEnded(f"connection failed while receiving: {exc}") from exc
            if k == 0:
                raise StreamEnded("connection closed by peer")
            if k > n - got:
                self._end = k - (n - got)
                got = n
            else:
                got += k

    def read_into_hashed(self, dest: memoryview) -> int:
        """Fill ``dest`` as :meth:`read_into` does and return the XXH3-64 of its bytes.

        Each piece is hashed as soon as it arrived, while it is still in the
        cache and while the sender's next bytes are on their way: the value's
        checksum costs no pass of its own after the last byte. A plain socket
        receives and hashes in the native core with the GIL released
        (:func:`kvstore.transfer.codec.recv_into_hashed`); a TLS socket, whose
        bytes only Python's ssl module can decrypt, receives here and hashes
        each piece with the native streaming hasher. The read-ahead takes none
        of the bytes that follow ``dest`` (they stay in the socket).

        Raises:
            StreamEnded: the peer closed the connection or the socket failed
                (its ``__cause__``: the OSError, TimeoutError or BlockingIOError).
        """
        got = self._take_buffered(dest)
        if self._tls:
            return self._hashing_tls(dest, got)
        try:
            return codec.recv_into_hashed(self.sock, dest, len(dest), got)
        except EOFError as exc:
            raise StreamEnded("connection closed by peer") from exc
        except OSError as exc:
            raise StreamEnded(f"connection failed while receiving: {exc}") from exc

    def _hashing_tls(self, dest: memoryview, got: int) -> int:
        """The rest of :meth:`read_into_hashed` on a TLS socket: ``got`` bytes of
        ``dest`` are there; the others are received (straight into ``dest``) and
        hashed piece by piece."""
        n, hashed = len(dest), 0
        hasher = codec.Hasher()
        while True:
            if got - hashed >= _HASH_PIECE_BYTES or got == n:
                hasher.update(dest[hashed:got])
                hashed = got
            if got == n:
                return hasher.intdigest()
            try:
                k = self.sock.recv_into(dest[got:], min(n - got, _HASH_PIECE_BYTES))
            except OSError as exc:
                raise StreamEnded(f"connection failed while receiving: {exc}") from exc
            if k == 0:
                raise StreamEnded("connection closed by peer")
            got += k

    def discard(self, n: int) -> None:
        """Skip the next ``n`` bytes."""
        while n > 0:
            self._fill(1)
            k = min(n, self._end - self._start)
            self._start += k
            n -= k


def discard(sock: socket.socket, size_bytes: int, scratch: memoryview) -> None:
    """Read and drop ``size_bytes`` (keeps a stream in sync after a refused PUT)."""
    while size_bytes > 0:
        chunk = min(size_bytes, len(scratch))
        recv_exact_into(sock, scratch[:chunk])
        size_bytes -= chunk


def send_parts(sock: socket.socket, header: bytes, payload: memoryview | None = None) -> None:
    """Send a header and an optional value in one gathered ``sendmsg`` (no copy;
    plain sends on a TLS socket)."""
    if payload is None or len(payload) == 0:
        sock.sendall(header)
        return
    if isinstance(sock, ssl.SSLSocket):
        sock.sendall(header)
        sock.sendall(payload)
        return
    sent = sock.sendmsg([header, payload])
    if sent < len(header):
        sock.sendall(memoryview(header)[sent:])
        sock.sendall(payload)
    elif sent < len(header) + len(payload):
        sock.sendall(payload[sent - len(header):])


def send_gathered(sock: socket.socket, parts: list) -> None:
    """Send byte buffers back to back with as few ``sendmsg`` calls as the
    kernel allows (at most 512 buffers each; no copies; plain sends on a TLS socket)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    if isinstance(sock, ssl.SSLSocket):
        for v in views:
            sock.sendall(v)
        return
    while views:
        batch = views[:512]
        sent = sock.sendmsg(batch)
        while batch and sent >= len(batch[0]):
            sent -= len(batch[0])
            batch.pop(0)
            views.pop(0)
        if sent:
            views[0] = views[0][sent:]


def local_address(shm_name: str) -> str:
    """The Unix socket (abstract namespace) where the node owning segment
    ``shm_name`` also serves this protocol, for clients on its host."""
    return f"\0kvstore-data-{shm_name}"


def keep_alive(sock: socket.socket, timeout_s: float) -> None:
    """Notice within about ``timeout_s`` that a TCP peer's host is gone.

    Without this, a connection to a host that dropped off the network lives
    until the kernel stops retransmitting (about 15 minutes) when data is in
    flight, and for ever when it is idle. Keepalive probes start after
    ``timeout_s`` of silence and repeat every third of it; ``TCP_USER_TIMEOUT``
    ends the connection once data (or probes) went unacknowledged for
    ``timeout_s``: the blocked call fails with ETIMEDOUT (``TimeoutError``).
    A live peer answers probes at kernel level, idle or not, and keeps its
    connection. No-op on Unix sockets; options the platform lacks are skipped.
    """
    if sock.family == socket.AF_UNIX:
        return
    whole_s = max(1, int(timeout_s))
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", whole_s), ("TCP_KEEPINTVL", max(1, whole_s // 3)),
                        ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", int(timeout_s * 1000))):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    for level, opt, value in opts:
        try:
            sock.setsockopt(level, opt, value)
        except OSError:
            pass


def tune_socket(sock: socket.socket) -> None:
    """Low latency and large buffers for bulk KV transfer."""
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)
        except OSError:
            pass


def kernel_timeout(conn: socket.socket, option: str, timeout_s: float) -> bool:
    """Give a plain (not TLS) blocking socket a timeout of ``timeout_s`` in the kernel:
    ``SO_RCVTIMEO`` (a read that waits longer fails with EAGAIN) or ``SO_SNDTIMEO``
    (a send that moves no byte for that long fails with EAGAIN; one that moved
    some returns what it moved). False where that is not possible. Python's own
    socket timeout would poll() before every recv and send."""
    if isinstance(conn, ssl.SSLSocket) or not hasattr(socket, option) \
            or conn.gettimeout() is not None:
        return False
    sec = int(timeout_s)
    try:
        conn.setsockopt(socket.SOL_SOCKET, getattr(socket, option),
                        struct.pack("@ll", sec, int((timeout_s - sec) * 1e6)))
    except OSError:
        return False
    return True
