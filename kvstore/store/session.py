"""One data connection of a store node: its frame loop, its op handlers, what it holds.

A connection owns the references and reservations it takes (SHM_ACQUIRE,
SHM_ALLOC); when it closes, for any reason, they are released in
``finally`` so a crashed client never pins memory for good.

A write (PUT, SHM_COMMIT) is acknowledged only once the node's master shard
has applied its STORED event (:mod:`kvstore.store.events`): the reply waits
in the connection's reply queue, in order, while the rest of a pipelined
batch is read; before the queue is sent, the session delivers the pending
events (one report for the batch, and for concurrent connections) and fails
a write its master refused (NOT_FOUND: the put was revoked or timed out) or
could not confirm within ``ack_timeout_s`` (UNAVAILABLE; the event stays
queued, so the object may still become visible, or be refused and dropped).

A frame may block its connection's thread for a bounded time: a put or a
read of an object that is only on a slower tier waits for the node's mover
to make room in DRAM (backpressure; see ``node.py``). A TCP GET whose object
cannot get DRAM room soon is served from its slower copy through a
per-connection staging buffer; an SHM_ACQUIRE needs DRAM and answers
NO_SPACE instead (the client then reads that object over TCP).

Thread safety: connection threads share only the :class:`StoreNode`, which
locks itself. Sockets block; ``recv_into``/``sendall`` release the GIL, and
so do lmdb reads. Every op's key is checked against the token's tenants
(:mod:`kvstore.store.tenancy`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterable

from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import Role, TokenFile, new_nonce
from kvstore.errors import (Internal, InvalidArgument, KVStoreError, NotFound, Unauthenticated,
                            Unavailable)
from kvstore.rpc import check_replica_num
from kvstore.store.events import Ticket
from kvstore.store.native_gets import GetPump
from kvstore.store.node import StoreNode
from kvstore.store.objects import StoredObject
from kvstore.store.polling import Pollers
from kvstore.store.stats import NodeCounter
from kvstore.store.tiers.base import TierIOError
from kvstore.store.tenancy import ConnectionScope, own_parent
from kvstore.transfer import codec
from kvstore.transfer.protocol import (REQUEST, RESPONSE, FrameReader, Op, StreamEnded,
                                       kernel_timeout, send_gathered)
from kvstore.transfer.rdma_wire import MAX_CONNECT_BYTES, OP_RDMA_CONNECT

log = logging.getLogger(__name__)
_MAX_NAMES_BYTES = 8192   # key + parent key; both are at most MAX_KEY_BYTES (512 B)
_MAX_GATHER_BYTES = 4 * 1024 * 1024    # values held back for one gathered send, at most
_MAX_GATHER_PARTS = 512
#: A PUT value at least this large is hashed piece by piece as it arrives
#: (FrameReader.read_into_hashed).
_HASH_WHILE_RECEIVING_BYTES = 256 * 1024
_OP_NAMES = {**{op.value: op.name.lower() for op in Op}, OP_RDMA_CONNECT: "rdma_connect"}
_CODE_NAMES = {v: k for k, v in pb.Code.items()}


class _Ack:
    """A write's reply slot in a session's reply queue, filled once its STORED event
    is resolved (see the module docstring)."""

    __slots__ = ("ticket", "key", "object_id", "size_bytes", "checksum", "reply")

    def __init__(self, ticket: Ticket, key: str, object_id: int, size_bytes: int, checksum: int):
        self.ticket = ticket
        self.key = key
        self.object_id = object_id
        self.size_bytes = size_bytes
        self.checksum = checksum
        self.reply = b""


class Session:
    """One client connection: its frame loop and what it holds."""

    def __init__(self, node: StoreNode, conn: socket.socket, rdma=None,
                 pollers: "Pollers | None" = None, ack_timeout_s: float = 2.0,
                 tokens: TokenFile | None = None, tally=None, write_timeout_s: float = 30.0,
                 lease=None, send_timeout_s: float | None = None):
        self.node = node
        self.lease = lease               # a kvstore.store.lease.MasterLease, or None (no master)
        self.write_timeout_s = write_timeout_s
        self.send_timeout_s = send_timeout_s or write_timeout_s
        self._py_timeout_s: float | None = None   # the (TLS) socket's Python timeout now
        self._kernel_timeout = kernel_timeout(conn, "SO_RCVTIMEO", write_timeout_s)
        # Sends: a reader that takes no byte of its replies for send_timeout_s is
        # dropped (_flush), so it never pins the objects being sent, or this thread.
        self._kernel_send_timeout = kernel_timeout(conn, "SO_SNDTIMEO", self.send_timeout_s)
        self.tally = tally               # a kvstore.metrics.RequestTally, or None
        self.bytes_in = 0                # value bytes written to the node (PUT, SHM_COMMIT)
        self.bytes_out = 0               # ... read from it (GET, SHM_ACQUIRE, SHM_TOUCH)
        self.ack_timeout_s = ack_timeout_s
        self.tokens = tokens
        # The caller's role once it proved a token (the ops it may use: tenancy.py).
        self.role: Role | None = Role.ADMIN if tokens is None else None
        self.tenancy = ConnectionScope(tokens)    # its tenants (kvstore.store.tenancy)
        self._allows, self._check_read = self.tenancy.allows, self.tenancy.check_read
        self.nonce = b""
        self.pollers = pollers or Pollers(1)
        self.conn = conn
        self.rdma = rdma
        self.rdma_peers: list = []       # queue pairs of this connection (RDMA_CONNECT)
        self.reader = FrameReader(conn)
        # Read references (SHM_ACQUIRE) and reservations (SHM_ALLOC) by (key, object_id).
        self.reading: dict[tuple[str, int], list[StoredObject]] = {}
        self.reading_bytes = 0           # ... their values' bytes
        self.writing: dict[tuple[str, int], StoredObject] = {}
        self.parent: str | None = None   # parent key of the frame being handled
        self.replica_num = 0             # its flags: the replicas a PUT / SHM_ALLOC asked for
        self.staging = bytearray()       # GET of an object DRAM had no room for
        self.out = bytearray()           # reply headers not sent yet (see _reply)
        self.parts: list = []            # ... before them: headers, values, _Acks, in order
        self.parts_bytes = 0
        self.acks: list[_Ack] = []       # writes in parts waiting for their STORED event
        self.sending: list[StoredObject] = []   # referenced until their values are sent
        self.closing = False             # the stream cannot be trusted: answer, then close
        self.eager = False               # poll for the next request after answering
        # None: GETs stay here.
        self.gets = GetPump.of(self, self.pollers.poll_s, self.pollers.limit)

    def run(self) -> None:
        handlers = {Op.PUT: self._put, Op.GET: self._get, Op.SHM_ALLOC: self._shm_alloc,
                    Op.SHM_COMMIT: self._shm_commit, Op.SHM_ACQUIRE: self._shm_acquire,
                    Op.SHM_RELEASE: self._shm_release, Op.SHM_ABORT: self._shm_abort,
                    Op.PING: self._ping, Op.PIN: self._pin, Op.UNPIN: self._unpin,
                    Op.PREFETCH: self._prefetch, Op.STATS: self._stats,
                    Op.AUTH_HELLO: self._auth_hello, Op.AUTH_PROVE: self._auth_prove,
                    Op.DROP: self._drop, Op.SHM_TOUCH: self._shm_touch,
                    OP_RDMA_CONNECT: self._rdma_connect}
        while True:
            answered_at = 0.0
            if (self.out or self.parts) and self.reader.buffered() < REQUEST.size and not (
                    self.acks and self._more_requests()):
                self._flush()   # no further request at hand: answer before blocking
                answered_at = time.perf_counter()
                if self.gets is not None:
                    self.gets.answered()        # it polls for the next request natively
                elif self.eager and self.pollers.take():
                    try:
                        self.reader.poll(REQUEST.size, self.pollers.poll_s)
                    finally:
                        self.pollers.give()
            if self.gets is not None and not self.writing and self.gets.takes_next():
                if self.out or self.parts:
                    self._flush()        # Python's answers first: replies stay in order
                    self.gets.answered()
                self.gets.serve()        # GETs of served copies natively, until one frame is not
            blocked_at = time.perf_counter() if self.reader.buffered() < REQUEST.size else 0.0
            if self.writing:
                # Reservations held (SHM_ALLOC without its SHM_COMMIT yet): the
                # next frame must come within write_timeout_s.
                with self._timed(f"{len(self.writing)} shm reservation(s) not committed",
                                 self.writing.values()):
                    header = self.reader.read(REQUEST.size)
            else:
                header = self._idle_read()
            op, self.replica_num, key_len, parent_len, object_id, size, checksum = \
                REQUEST.unpack(header)
            if blocked_at:
                # A client back within the poll window of its answer runs a tight loop
                # (a get per copy): poll for its next request instead of sleeping.
                waited = time.perf_counter() - (answered_at or blocked_at)
                self.eager = waited < self.pollers.poll_s
            if key_len + parent_len > _MAX_NAMES_BYTES:
                # Not a frame of ours: the stream cannot be trusted any more.
                self._reply_error(InvalidArgument(f"key and parent of {key_len + parent_len} B"))
                self._flush()
                return
            names = bytes(self.reader.read(key_len + parent_len))
            key = names[:key_len].decode("utf-8", errors="replace")
            self.parent = own_parent(key, names[key_len:].decode("utf-8", errors="replace"))
            handler = handlers.get(op)
            if handler is None:
                # Unknown op: the stream cannot be trusted any more.
                self._reply_error(InvalidArgument(f"unknown op {op}"))
                self._flush()
                return
            if self.role is None and op not in (Op.AUTH_HELLO, Op.AUTH_PROVE):
                # Anything before the handshake: refuse and close (its value, if
                # any, is never read).
                self._reply_error(Unauthenticated("this node needs authentication "
                                                  "(AUTH_HELLO, AUTH_PROVE) first"))
                self._flush()
                return
            tally = self.tally
            t0 = time.perf_counter() if tally is not None else 0.0
            code = "OK"
            try:
                handler(key, object_id, size, checksum)
            except StreamEnded:
                # The stream ended (or stalled) inside this frame: the bytes read
                # of it are no frame, and nothing follows. Never parse them as one.
                raise
            except KVStoreError as err:
                code = _CODE_NAMES.get(err.code, "INTERNAL")
                self._reply_error(err)
            if tally is not None:
                tally.observe(_OP_NAMES.get(op, "unknown"), code, time.perf_counter() - t0)
            if self.closing:
                self._flush()
                return

    # ---- replies ----
    # Replies are gathered while further requests of a pipelined batch are
    # already buffered, and sent together: one gathered sendmsg (values
    # straight from the segment, no copies) and one wake-up of the client per
    # batch instead of one per key. A value stays referenced until it is sent.
    def _reply(self, *, object_id: int = 0, size: int = 0, checksum: int = 0, offset: int = 0,
               serial: int = 0, payload: memoryview | None = None,
               hold: StoredObject | None = None) -> None:
        """Queue one OK reply; ``hold`` (the payload's object) is released once it is sent."""
        self.out += RESPONSE.pack(pb.OK, 0, 0, 0, object_id, size, checksum, offset, serial)
        if payload is not None and len(payload):
            self.parts += [bytes(self.out), payload]
            self.out = bytearray()
            self.parts_bytes += len(payload)
        if hold is not None:
            self.sending.append(hold)
        if self.parts_bytes >= _MAX_GATHER_BYTES or len(self.parts) >= _MAX_GATHER_PARTS:
            self._flush()

    def _reply_stored(self, ticket: Ticket, obj: StoredObject) -> None:
        """Queue a write's OK reply, sent once the master applied its STORED event."""
        if self.out:
            self.parts.append(bytes(self.out))
            self.out = bytearray()
        ack = _Ack(ticket, obj.key, obj.object_id, obj.size_bytes, obj.checksum)
        self.parts.append(ack)
        self.acks.append(ack)
        if len(self.parts) >= _MAX_GATHER_PARTS:
            self._flush()

    def _more_requests(self) -> bool:
        """Whether the next request of a pipelined batch is at hand already (no wait):
        its write joins the same report to the master."""
        self.reader.poll(REQUEST.size, 0.0)
        return self.reader.buffered() >= REQUEST.size

    def _settle_acks(self) -> None:
        """Deliver the queued writes' events and turn each _Ack into its reply."""
        acks, self.acks = self.acks, []
        delivered = self.node.events.wait([a.ticket for a in acks], self.ack_timeout_s)
        for ack in acks:
            if ack.ticket.done and ack.ticket.error is None:
                ack.reply = RESPONSE.pack(pb.OK, 0, 0, 0, ack.object_id, ack.size_bytes,
                                          ack.checksum, 0, 0)
                continue
            err = ack.ticket.error or Unavailable(
                f"the master did not confirm the write within {self.ack_timeout_s} s"
                + ("" if delivered else " (unreachable)"), key=ack.key)
            msg = str(err.message).encode()[:1024]
            ack.reply = RESPONSE.pack(err.code, 0, len(msg), 0, 0, 0, 0, 0, 0) + msg

    def _reply_error(self, err: KVStoreError) -> None:
        msg = str(err.message).encode()[:1024]
        self.out += RESPONSE.pack(err.code, 0, len(msg), 0, 0, 0, 0, 0, 0) + msg

    def _flush(self) -> None:
        if not self._kernel_send_timeout:
            self._set_py_timeout(self.send_timeout_s)   # TLS: the send deadline
        if self.acks:
            self._settle_acks()
        parts, self.parts, self.parts_bytes = self.parts, [], 0
        if self.out:
            parts.append(bytes(self.out))
            self.out = bytearray()
        parts = [p.reply if type(p) is _Ack else p for p in parts]
        try:
            send_gathered(self.conn, parts)
        except OSError as exc:        # the client went away: not a node failure
            if isinstance(exc, (BlockingIOError, TimeoutError)):
                # No byte taken for send_timeout_s (EAGAIN, a TLS timeout), or the
                # reader's host stopped acknowledging (ETIMEDOUT, see keep_alive).
                self.node.count(NodeCounter.STALLED_READS)
                log.warning("a data client took no byte of its replies for %.1f s (%s): "
                            "dropping its connection and the objects it was sent",
                            self.send_timeout_s, exc)
            raise Unavailable(f"client connection lost: {exc}") from exc
        finally:
            self._release_sent()

    def _release_sent(self) -> None:
        held, self.sending = self.sending, []
        for obj in held:
            self.node.release(obj)

    # ---- ops ----
    def _put(self, key: str, object_id: int, size: int, checksum: int) -> None:
        # The value's bytes must keep coming (within write_timeout_s each), whether
        # they are stored or discarded: a stalled writer holds nothing for long.
        try:
            self._check_put(key)
            obj, present = self.node.begin_write(key, object_id, size, checksum,
                                                 self.parent, self.replica_num)
        except KVStoreError:
            with self._timed(f"a refused PUT of {size} B"):
                self.reader.discard(size)
            raise
        if present:
            with self._timed(f"a PUT of {size} B already stored"):
                self.reader.discard(size)
            self._reply(object_id=object_id, size=size, checksum=checksum)
            return
        # A large value is hashed as it arrives (kvstore.transfer.codec, GIL
        # released); a smaller one is taken with the frames after it in one
        # recvmsg, then hashed from the cache (natively too).
        actual = None
        try:
            if size:
                with self._timed(f"a PUT of {size} B", (obj,)):
                    view = self.node.write_view(obj)
                    if size >= _HASH_WHILE_RECEIVING_BYTES:
                        actual = self.reader.read_into_hashed(view)
                    else:
                        self.reader.read_into(view)
                        actual = codec.value_hash(view)
        except BaseException:
            self.node.abort_write(obj)
            raise
        self.bytes_in += size
        self._reply_stored(self.node.commit_write(obj, actual=actual), obj)

    def kernel_timeouts(self) -> bool:
        """Whether reads and sends wait under the kernel's timeouts (a plain socket)."""
        return self._kernel_timeout and self._kernel_send_timeout

    def _idle_read(self) -> memoryview:
        """The next request's header, waiting for it as long as it takes: for as long
        as the client's host answers TCP keepalive (see ``keep_alive``)."""
        try:
            if not self._kernel_timeout:
                self._timeout(False)
                return self.reader.read(REQUEST.size)
            while True:
                try:
                    return self.reader.read(REQUEST.size)
                except StreamEnded as exc:
                    if not isinstance(exc.__cause__, BlockingIOError):
                        raise        # (what was received of the header stays buffered)
        except StreamEnded as exc:
            # ETIMEDOUT: keepalive probes went unanswered (no timeout of ours is
            # on while idle; SO_RCVTIMEO says EAGAIN).
            if isinstance(exc.__cause__, TimeoutError):
                self.node.count(NodeCounter.PEERS_LOST)
                log.info("a data client's host stopped answering: connection closed")
            raise

    def _timeout(self, on: bool) -> None:
        """Make blocking reads wait at most write_timeout_s (on) or for ever.

        A plain socket has the kernel's receive timeout (SO_RCVTIMEO) from the
        start: nothing to do, and its reads cost no poll(). A TLS socket's
        Python timeout is set lazily: a pipelined batch of PUTs keeps it on
        from its first value to the flush of their replies."""
        if not self._kernel_timeout:
            self._set_py_timeout(self.write_timeout_s if on else None)

    def _set_py_timeout(self, timeout_s: float | None) -> None:
        """The (TLS) socket's Python timeout, set only when it changes."""
        if timeout_s != self._py_timeout_s:
            self.conn.settimeout(timeout_s)
            self._py_timeout_s = timeout_s

    @contextlib.contextmanager
    def _timed(self, what: str, holding: Iterable[StoredObject] = ()):
        """Blocking reads inside wait at most write_timeout_s for each byte; a stall
        ends the connection (Unavailable) and is counted once the space of the
        unfinished writes ``holding`` is given back (a reader of the counter sees
        the space free). The timeout stays on after the block until the session
        is about to flush or wait idle."""
        self._timeout(True)
        try:
            yield
        except Unavailable as exc:
            if isinstance(exc.__cause__, (TimeoutError, BlockingIOError)):
                for obj in holding:
                    self.node.abort_write(obj)
                self._stalled(what)
            raise

    def _get(self, key: str, object_id: int, _size: int, _checksum: int) -> None:
        # An object only on SSD (or GPU) is promoted to DRAM first; when DRAM has
        # no room soon, it is served from its slower copy through a staging buffer.
        self._check_lease(key)
        self._check_read(key)
        obj = self.node.acquire(key, object_id, require_dram=False)
        self.bytes_out += obj.size_bytes
        if obj.alloc is not None:
            # Sent from the segment with the batch; released once sent.
            self._reply(object_id=obj.object_id, size=obj.size_bytes, checksum=obj.checksum,
                        payload=self.node.read_view(obj), hold=obj)
            return
        try:
            payload = self._staging(obj.size_bytes)
            try:
                self.node.read_into(obj, payload)
            except TierIOError as exc:
                raise Internal(f"reading the slower copy failed: {exc}", key=key) from exc
            self._reply(object_id=obj.object_id, size=obj.size_bytes, checksum=obj.checksum,
                        payload=payload)
            self._flush()    # the staging buffer is this connection's only one
        finally:
            self.node.release(obj)

    def _stalled(self, what: str) -> None:
        self.node.count(NodeCounter.STALLED_WRITES)
        log.warning("a data client stalled over %.1f s in %s: dropping its connection and "
                    "reservations", self.write_timeout_s, what)

    def _staging(self, size_bytes: int) -> memoryview:
        if len(self.staging) < size_bytes:
            self.staging = bytearray(size_bytes)
        return memoryview(self.staging)[:size_bytes]

    def _check_put(self, key: str) -> None:
        """A write's frame: the lease holds, and its replica count (flags) is one a
        put may ask for, as the master would refuse that inventory."""
        check_replica_num(self.replica_num, unset_ok=True, key=key)
        self.tenancy.check_write(key)
        self._check_lease(key)

    def _check_lease(self, key: str) -> None:
        """Reads and writes only while the node's master lease holds (see
        :mod:`kvstore.store.lease`); Unavailable, counted, otherwise."""
        if self.lease is not None:
            try:
                self.lease.check(key)
            except Unavailable:
                self.node.count(NodeCounter.FENCED)
                raise

    def _shm_alloc(self, key: str, object_id: int, size: int, checksum: int) -> None:
        self._check_put(key)
        obj, present = self.node.begin_write(key, object_id, size, checksum, self.parent,
                                             self.replica_num)
        if present:                   # the stored checksum (the writer may not know it yet)
            self._reply(object_id=object_id, size=size, checksum=obj.checksum,
                        offset=2**64 - 1)
            return
        self.writing[(key, object_id)] = obj
        self._reply(object_id=object_id, size=size, checksum=checksum, offset=obj.alloc.offset,
                    serial=obj.alloc.serial)

    def _shm_commit(self, key: str, object_id: int, _size: int, checksum: int) -> None:
        # A non-zero checksum is the value's, announced late (a value written
        # part by part, see kvstore.client.parts); 0 keeps the one SHM_ALLOC gave.
        obj = self.writing.pop((key, object_id), None)
        if obj is None:
            raise NotFound("no reservation for this key on this connection", key=key)
        self.tenancy.check_write(key, undo=lambda: self.node.abort_write(obj))   # scope changed
        # The client's bytes in the segment, hashed natively with the GIL released.
        actual = codec.value_hash(self.node.write_view(obj))
        ticket = self.node.commit_write(obj, checksum or None, actual=actual)
        self.bytes_in += obj.size_bytes
        self._reply_stored(ticket, obj)

    def _shm_abort(self, key: str, object_id: int, _size: int, _checksum: int) -> None:
        obj = self.writing.pop((key, object_id), None)
        if obj is not None:
            self.node.abort_write(obj)
        self._reply(object_id=object_id)

    def _shm_acquire(self, key: str, object_id: int, _size: int, _checksum: int) -> None:
        self._check_lease(key)
        self._check_read(key)
        # Its own references can't go while it waits for this reply: past DRAM with
        # them, answered NO_SPACE at once (the client reads it over TCP after them).
        obj = self.node.acquire(key, object_id, held_bytes=self.reading_bytes)
        self.reading.setdefault((key, obj.object_id), []).append(obj)
        self.reading_bytes += obj.size_bytes
        self.bytes_out += obj.size_bytes
        self._reply(object_id=obj.object_id, size=obj.size_bytes, checksum=obj.checksum,
                    offset=obj.alloc.offset, serial=obj.alloc.serial)

    def _shm_release(self, key: str, object_id: int, _size: int, _checksum: int) -> None:
        held = self.reading.get((key, object_id))
        if not held:
            raise NotFound("no read reference on this key on this connection", key=key)
        obj = held.pop()
        self.reading_bytes -= obj.size_bytes
        self.node.release(obj)
        if not held:
            del self.reading[(key, object_id)]
        self._reply(object_id=object_id)

    def _shm_touch(self, key: str, object_id: int, _size: int, _checksum: int) -> None:
        if self._allows(key):
            self.bytes_out += self.node.touch(key, object_id)
        self._reply(object_id=object_id)

    def _ping(self, key: str, object_id: int, size: int, checksum: int) -> None:
        self._reply()

    def _pin(self, key: str, object_id: int, ttl_ms: int, _checksum: int) -> None:
        self._check_read(key)
        self.node.pin(key, object_id, ttl_ms)
        self._reply(object_id=object_id)

    def _unpin(self, key: str, object_id: int, soft: int, _checksum: int) -> None:
        self._check_read(key)
        self.node.unpin(key, object_id, soft=bool(soft))
        self._reply(object_id=object_id)

    def _prefetch(self, key: str, object_id: int, deadline_ms: int, _checksum: int) -> None:
        self._check_read(key)
        in_dram = self.node.prefetch(key, object_id, deadline_ms)
        self._reply(object_id=object_id, offset=int(in_dram))

    def _drop(self, key: str, object_id: int, _size: int, _checksum: int) -> None:
        # OK whether or not this node still had it: it does not now (tenancy: as not held).
        if self._allows(key):
            self.node.drop_removed(key, object_id)
        self._reply(object_id=object_id)

    def _stats(self, _key: str, _object_id: int, _size: int, _checksum: int) -> None:
        self.tenancy.check_stats()          # store-wide figures: admin and node tokens only
        payload = json.dumps(self.node.stats().to_dict()).encode()
        self._reply(size=len(payload), payload=memoryview(payload))

    def _auth_hello(self, _key: str, _object_id: int, _size: int, _checksum: int) -> None:
        if self.tokens is None:
            self._reply()                   # no authentication needed: an empty nonce
            return
        self.nonce = new_nonce()
        self._reply(size=len(self.nonce), payload=memoryview(self.nonce))

    def _auth_prove(self, _key: str, _object_id: int, size: int, _checksum: int) -> None:
        if size > 64:
            self.closing = True             # not a proof: its bytes cannot be trusted
            raise InvalidArgument(f"AUTH_PROVE of {size} B")
        answer = bytes(self.reader.read(size))
        if self.tokens is None:
            self._reply()
            return
        found = self.tokens.proof_credentials(self.nonce, answer) if self.nonce else None
        self.nonce = b""                    # one answer per nonce
        if found is None:
            self.closing = True
            raise Unauthenticated("unknown credentials")
        self.role = self.tenancy.proved(*found)
        self._reply()

    def _rdma_connect(self, _key: str, _object_id: int, size: int, _checksum: int) -> None:
        if size > MAX_CONNECT_BYTES:
            self.closing = True     # not a frame of ours: its payload cannot be skipped safely
            raise InvalidArgument(f"RDMA_CONNECT of {size} B")
        request = bytes(self.reader.read(size))
        self.tenancy.check_role()           # remote access to the segment: object roles only
        if self.rdma is None:
            raise Unavailable("this node serves no RDMA (start it with --rdma-device)")
        peer, reply = self.rdma.accept(request)
        self.rdma_peers.append(peer)
        self._reply(size=len(reply), payload=memoryview(reply))

    def release_all(self) -> None:
        self._release_sent()
        # Queue pairs first: no remote access to the segment once reservations
        # and references go back.
        for peer in self.rdma_peers:
            peer.close()
        self.rdma_peers.clear()
        for objs in self.reading.values():
            for obj in objs:
                self.node.release(obj)
        self.reading.clear()
        self.reading_bytes = 0
        for obj in self.writing.values():
            self.node.abort_write(obj)
        self.writing.clear()
