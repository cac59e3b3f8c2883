"""Same-host shared memory: one POSIX shared-memory segment per store node.

The node creates the segment (``/dev/shm/<name>`` on Linux, which is what
``shm_open`` uses) and places objects in it with its own offset allocator.
A client on the same host maps the segment and copies values in and out
itself; the node hands out offsets over the TCP control frames
(SHM_ALLOC / SHM_COMMIT, SHM_ACQUIRE / SHM_RELEASE) and holds a reference on
every object a client is reading, so that memory is never reused under it.

We map the segment with ``os.open`` + ``mmap`` instead of
``multiprocessing.shared_memory`` because on Python < 3.13 that class
registers attached segments with the resource tracker, which unlinks the
node's segment when a client process exits.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import socket
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator

from kvstore._proto import kvstore_pb2 as _pb
from kvstore.errors import KVStoreError, Unavailable, error_for_code
from kvstore.transfer import codec
from kvstore.transfer.base import ReadItem, Transport, WriteItem
from kvstore.transfer.protocol import Op
from kvstore.transfer.shm_slots import ReadSlots
from kvstore.transfer.tcp import (Location, NodeConnection, TcpTransport, check_read,
                                  read_by_reference)
from kvstore.types import TransportKind

SHM_DIR = "/dev/shm"
#: madvise(2) advice that maps every page of a range writable now (Linux >= 5.14).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
PREFAULT_CHUNK_BYTES = 8 << 20


def _libc_madvise():
    """libc's madvise(2) through ctypes, or None. A foreign call releases the GIL:
    ``mmap.madvise`` holds it for the whole call (about 7 ms per 8 MiB chunk of
    MADV_POPULATE_WRITE here), which stalled every other thread of a node that
    was still mapping its segment (a ping took 5-30 ms for the first seconds)."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


def host_id() -> str:
    """An id of this machine, boot and network namespace: equal host_ids share memory.

    The network namespace counts: processes in different namespaces are
    different hosts to kvstore (a node's Unix socket is not even reachable
    from another namespace), which is how one machine plays several hosts.
    """
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            pass
    try:
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        pass
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


class ShmSegment:
    """A named shared-memory segment mapped into this process.

    Args:
        name: segment name (a file name under /dev/shm).
        size_bytes: size, required with ``create=True``.
        create: create a new segment (fails if it exists) instead of attaching.

    Raises:
        FileNotFoundError: attaching to a segment that does not exist.
        FileExistsError: creating a segment whose name is taken.
    """

    def __init__(self, name: str, size_bytes: int = 0, create: bool = False):
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self._owner = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, max(size_bytes, 1))
            st = os.fstat(fd)
            if not create:
                size_bytes = st.st_size
            self.inode = st.st_ino        # which file of that name (a restarted node makes another)
            self.size_bytes = size_bytes
            self._mmap = mmap.mmap(fd, max(size_bytes, 1))
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)
        self._closing = threading.Event()
        self.prefaulting: threading.Thread | None = None   # prefault_in_background's thread

    def prefault(self, limit_bytes: int | None = None, stop: threading.Event | None = None) -> int:
        """Map the segment's pages into this process now (the first ``limit_bytes``; None:
        all), so that no write or read of a value takes page faults.

        A page's first touch through a mapping costs a fault: here about 2 us
        per 4 KiB page for a new tmpfs page and 1.7 us for one another process
        already has, so a first 4 MiB copy takes 2.2 ms instead of 0.44 ms.
        Works in chunks of PREFAULT_CHUNK_BYTES (other threads run in between)
        and stops at ``stop``, at a closed segment, or on a kernel without
        MADV_POPULATE_WRITE.

        Returns:
            The bytes mapped.
        """
        end = self.size_bytes if limit_bytes is None else min(limit_bytes, self.size_bytes)
        base = 0
        if _MADVISE is not None and not self.closed:
            anchor = ctypes.c_char.from_buffer(self._mmap)   # its address only; no export kept
            base = ctypes.addressof(anchor)
            del anchor
        for off in range(0, end, PREFAULT_CHUNK_BYTES):
            if stop is not None and stop.is_set():
                return off
            n = min(PREFAULT_CHUNK_BYTES, end - off)
            try:
                # Without the GIL (see _libc_madvise). A chunk racing close() fails
                # or maps pages of whatever is mapped there then: never a write.
                if base:
                    if _MADVISE(base + off, n, MADV_POPULATE_WRITE) != 0:
                        return off
                else:
                    self._mmap.madvise(MADV_POPULATE_WRITE, off, n)
            except (OSError, ValueError, TypeError):
                return off
        return end

    def prefault_in_background(self, limit_bytes: int | None = None) -> threading.Thread:
        """:meth:`prefault` on a daemon thread (stopped by :meth:`close`)."""
        thread = threading.Thread(target=self.prefault, args=(limit_bytes, self._closing),
                                  name=f"prefault-{self.name}", daemon=True)
        thread.start()
        self.prefaulting = thread
        return thread

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (the view is released)."""
        return self._closing.is_set()

    def close(self) -> None:
        """Unmap; the creator also unlinks the segment."""
        self._closing.set()
        try:
            self.view.release()
            self._mmap.close()
        except (BufferError, ValueError):
            pass  # a view is still exported; the mapping goes with the process
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            self._owner = False


# ---- client side ----------------------------------------------------------

class SegmentMaps:
    """One mapping of each node segment for all of a client's threads.

    A client keeps a transport per thread and node; mapping the segment once per
    transport would prefault (and hold page tables for) the same pages once per
    thread. Mappings are counted and unmapped at their last :meth:`release`. A
    segment file that was replaced under the same name is mapped anew, never
    served from the old mapping.

    A node that restarts makes a new segment (its name carries the process id),
    and the old one, unlinked, lives as long as a mapping of it. Threads that
    sit idle keep their transports, and with them that mapping: a long-lived
    client (the RESP front keeps a worker thread per connection) would hold a
    whole dead segment per node restart. So a mapping is *retired* when a newer
    segment of its node is mapped (:meth:`acquire` with the node id) or a
    transport to its node failed (:meth:`retire_node`): it is unmapped as soon as
    no transport is inside an operation on it (:meth:`using`), and transports
    still holding it reconnect at their next use
    (``kvstore.client.connections``).

    Thread safety: all methods from any thread.
    """

    def __init__(self, prefault_bytes: int):
        self.prefault_bytes = prefault_bytes
        self._lock = threading.Lock()
        self._current: dict[str, ShmSegment] = {}   # name -> newest mapping
        self._refs: dict[int, int] = {}             # id(segment) -> transports using it
        self._by_node: dict[str, ShmSegment] = {}   # node id -> its newest mapping
        self._busy: dict[int, int] = {}             # id(segment) -> operations inside it
        self._retired: set[int] = set()

    def acquire(self, name: str, node_id: str | None = None) -> ShmSegment:
        """The mapping of segment ``name`` (one more user); raises OSError as ShmSegment.
        With ``node_id``, an older segment of that node is retired."""
        inode = os.stat(os.path.join(SHM_DIR, name)).st_ino
        stale = None
        with self._lock:
            seg = self._current.get(name)
            if seg is None or seg.inode != inode or seg.closed:
                seg = ShmSegment(name)
                # Map its pages ahead of the copies (a page's first touch here
                # is a fault, 1.7 us per 4 KiB), on a background thread, once.
                seg.prefault_in_background(self.prefault_bytes)
                self._current[name] = seg
            self._refs[id(seg)] = self._refs.get(id(seg), 0) + 1
            if node_id is not None:
                old = self._by_node.get(node_id)
                self._by_node[node_id] = seg
                if old is not None and old is not seg:
                    stale = self._retire_locked(old)
        if stale is not None:
            stale.close()
        return seg

    def wait_prefaulted(self, timeout_s: float) -> bool:
        """Until every current mapping's background prefault ended; False: ``timeout_s`` first."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads = [s.prefaulting for s in self._current.values() if s.prefaulting is not None]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def retire_node(self, node_id: str) -> None:
        """A transport to ``node_id`` failed: retire its mapping (see the class docstring)."""
        with self._lock:
            seg = self._by_node.pop(node_id, None)
            stale = self._retire_locked(seg) if seg is not None else None
        if stale is not None:
            stale.close()

    def _retire_locked(self, seg: ShmSegment) -> ShmSegment | None:
        """Mark ``seg`` retired; returns it when it can be unmapped now (no operation in it)."""
        self._retired.add(id(seg))
        if self._current.get(seg.name) is seg:
            del self._current[seg.name]
        return None if self._busy.get(id(seg)) else seg

    def enter(self, seg: ShmSegment) -> bool:
        """An operation on ``seg`` starts: it stays mapped until :meth:`leave`.
        False (and nothing to leave): ``seg`` was retired and unmapped."""
        with self._lock:
            if seg.closed:
                return False
            self._busy[id(seg)] = self._busy.get(id(seg), 0) + 1
            return True

    def leave(self, seg: ShmSegment) -> None:
        """An operation :meth:`enter` began ended (the last one out unmaps a retired ``seg``)."""
        with self._lock:
            left = self._busy.pop(id(seg)) - 1
            if left:
                self._busy[id(seg)] = left
            unmap = not left and id(seg) in self._retired
        if unmap:
            seg.close()

    @contextmanager
    def using(self, seg: ShmSegment) -> Iterator[memoryview]:
        """An operation on ``seg``: it stays mapped until the block ends; yields its view.

        Raises:
            Unavailable: ``seg`` was retired and unmapped (its node restarted or
                failed); the caller reconnects.
        """
        if not self.enter(seg):
            raise Unavailable(f"shared memory {seg.name} is unmapped: its node restarted "
                              "or failed")
        try:
            yield seg.view
        finally:
            self.leave(seg)

    def release(self, seg: ShmSegment) -> None:
        """One user fewer; the last one unmaps it."""
        with self._lock:
            left = self._refs.get(id(seg), 1) - 1
            if left > 0:
                self._refs[id(seg)] = left
                return
            self._refs.pop(id(seg), None)
            self._retired.discard(id(seg))
            if self._current.get(seg.name) is seg:
                del self._current[seg.name]
            for node_id, s in list(self._by_node.items()):
                if s is seg:
                    del self._by_node[node_id]
        seg.close()


def _fits(loc: Location, it: ReadItem, seg: memoryview) -> bool:
    """Whether a remembered location may be copied from: inside the segment, and
    no larger than the destination."""
    offset, size, _serial = loc
    return size <= len(it.dest) and offset + size <= len(seg)


def _copy(dest: memoryview, src: memoryview, verify: bool) -> int | None:
    """Copy a value out of the segment (``dest`` and ``src`` of one length); with
    ``verify``, hash it on the way (one native pass) and return its XXH3-64."""
    if verify:
        return codec.copy_hashed(dest, src)
    if len(src):
        dest[:] = src
    return None


#: Puts of smaller values go as PUT frames on the control connection: one round
#: trip carrying the value beats two around a copy (see ShmTransport.write_many).
SEGMENT_PUT_MIN_BYTES = 1 << 20

#: SHM_ALLOC's offset when the exact version is already stored.
ALREADY_PRESENT_OFFSET = 2**64 - 1


class ShmTransport(Transport):
    """Copies through the node's segment; control frames over a TCP connection.

    Put: SHM_ALLOC (node reserves, replies offset) -> copy -> SHM_COMMIT
    (node verifies the checksum and publishes). Get: SHM_ACQUIRE (node takes a
    read reference, replies offset) -> copy -> SHM_RELEASE (deferred: it
    rides with the next request). Each phase is pipelined over the whole batch.

    Gets of an object this transport read before skip the node: they copy
    from the location that read learnt and check the node's read slots
    before and after (:mod:`kvstore.transfer.shm_slots`), then tell the node
    with a deferred SHM_TOUCH (no round trip). Where the slots say no (the
    object left service, the node's lease ran out, no table), the get copies
    while the acquire is in flight and keeps the copy when the reply names the
    same allocation (see :func:`read_by_reference`).

    Args:
        conn: the control connection to the node.
        segment: the node's segment, mapped here.
        locations: how many object locations to remember (0: never guess).
        maps: where ``segment`` came from (released there on close); None: this
            transport owns it and unmaps it on close.
    """

    kind = TransportKind.SHM

    def __init__(self, conn: NodeConnection, segment: ShmSegment, locations: int = 4096,
                 maps: SegmentMaps | None = None):
        self.conn = conn
        self.segment = segment
        self._maps = maps
        self.max_locations = locations
        self._where: OrderedDict[tuple[str, int], Location] = OrderedDict()
        self.slots = ReadSlots.attach(segment.view) if locations else None
        self.unreferenced = 0     # values read with no node round trip (checked in the slots)
        self.guesses = 0          # values copied from a remembered location during an acquire
        self.wrong_guesses = 0    # ... that the node's reply did not confirm (copied again)

    def control(self, op: Op, keys_ids: list[tuple], parents: list[str] | None = None,
                flags: list[int] | None = None):
        """Pipelined value-less frames ``(key, object_id, size, checksum)``; their reply
        headers. ``flags``: per frame (SHM_ALLOC: the replica_num, see the protocol)."""
        for i, (key, oid, size, ck) in enumerate(keys_ids):
            self.conn.send(op, key, oid, size, ck, parent=parents[i] if parents else "",
                           flags=flags[i] if flags else 0)
        return [self.conn.recv_header() for _ in keys_ids]

    def using(self) -> ContextManager[memoryview]:
        """The segment's view, kept mapped for the block (:meth:`SegmentMaps.using`).

        Raises:
            Unavailable: the mapping was retired (the node restarted or failed).
        """
        if self._maps is not None:
            return self._maps.using(self.segment)
        return nullcontext(self.segment.view)

    def write_many(self, items: list[WriteItem]) -> list[KVStoreError | None]:
        """Values under :data:`SEGMENT_PUT_MIN_BYTES` go with PUT frames on the control
        connection (one round trip each way for the batch, the bytes through the
        socket), the others through the segment (two, around the copies)."""
        small: list[int] = []
        large: list[int] = []
        for i, it in enumerate(items):
            (small if len(it.data) < SEGMENT_PUT_MIN_BYTES else large).append(i)
        out: list[KVStoreError | None] = [None] * len(items)
        if small:
            for i, err in zip(small, TcpTransport(self.conn).write_many([items[i] for i in small])):
                out[i] = err
        if large:
            with self.using() as seg:
                for i, err in zip(large, self._write_many(seg, [items[i] for i in large])):
                    out[i] = err
        return out

    def read_many(self, items: list[ReadItem], verify: bool = True) -> list[KVStoreError | None]:
        with self.using() as seg:
            return self._read_many(seg, items, verify)

    def _write_many(self, seg: memoryview, items: list[WriteItem]) -> list[KVStoreError | None]:
        # A value whose checksum is not known yet is hashed as it is copied
        # (codec.copy_hashed: one native pass, each piece hashed while in the
        # cache, GIL released; a pass of its own over a cold 4 MiB value costs
        # 60 % of the copy) and announced with SHM_COMMIT; the node verifies it
        # there either way.
        out: list[KVStoreError | None] = [None] * len(items)
        late = [i.checksum is None for i in items]
        replies = self.control(Op.SHM_ALLOC, [(i.key, i.object_id, len(i.data), i.checksum or 0)
                                             for i in items], [i.parent for i in items],
                               [i.replica_num for i in items])
        to_commit = []
        for idx, (it, (code, _oid, _size, ck, offset, msg)) in enumerate(zip(items, replies)):
            if code != _pb.OK:
                out[idx] = error_for_code(code, msg, key=it.key)
            elif offset == ALREADY_PRESENT_OFFSET:
                if it.checksum is None:
                    it.checksum = ck               # the stored version's
            else:
                n = len(it.data)
                if it.checksum is None:
                    it.checksum = codec.copy_hashed(seg[offset:offset + n], it.data)
                elif n:
                    seg[offset:offset + n] = it.data
                to_commit.append(idx)
        replies = self.control(Op.SHM_COMMIT, [(items[i].key, items[i].object_id, 0,
                                                items[i].checksum if late[i] else 0)
                                               for i in to_commit])
        for idx, (code, _oid, _size, _ck, _off, msg) in zip(to_commit, replies):
            if code != _pb.OK:
                out[idx] = error_for_code(code, msg, key=items[idx].key)
        return out

    def _read_many(self, seg: memoryview, items: list[ReadItem], verify: bool
                   ) -> list[KVStoreError | None]:
        slots = self.slots
        if slots is None or not self._where or self.conn.broken:
            return self._read_referenced(seg, items, verify)
        out: list[KVStoreError | None] = [None] * len(items)
        rest: list[int] = []
        for idx, it in enumerate(items):
            loc = self._where.get((it.key, it.object_id))
            if loc is None or not self._copy_unreferenced(seg, slots, it, loc, verify):
                rest.append(idx)
        if rest:
            errors = self._read_referenced(seg, [items[i] for i in rest], verify)
            for idx, err in zip(rest, errors):
                out[idx] = err
        return out

    def read_known(self, it: ReadItem, verify: bool) -> bool:
        """One value read from the location this transport learnt for it, with no
        round trip and no wait (the SDK's cached-get fast path): the copy checked
        in the read slots, as :meth:`read_many` does for a remembered location.

        Returns:
            True: ``it.dest`` holds the value. False: nothing is known about
            ``it.dest`` (no location, the slots say no, the mapping was retired, a
            checksum or size differed): read it through :meth:`read_many`.
        """
        loc = self._where.get((it.key, it.object_id))
        slots = self.slots
        if loc is None or slots is None or self.conn.broken:
            return False
        seg = self.segment
        maps = self._maps
        if maps is None:
            return self._copy_unreferenced(seg.view, slots, it, loc, verify)
        if not maps.enter(seg):
            return False
        try:
            return self._copy_unreferenced(seg.view, slots, it, loc, verify)
        finally:
            maps.leave(seg)

    def _copy_unreferenced(self, seg: memoryview, slots: ReadSlots, it: ReadItem,
                           loc: Location, verify: bool) -> bool:
        """Copy ``it`` from ``loc`` if its allocation stays in service throughout
        (checked in the read slots); False: nothing is known about ``it.dest``."""
        offset, size, serial = loc
        if not _fits(loc, it, seg) or not slots.serves(serial):
            return False
        actual = _copy(it.dest[:size], seg[offset:offset + size], verify)
        if not slots.still(serial) or check_read(it, size, verify, actual) is not None:
            return False
        self.unreferenced += 1
        self.conn.defer(Op.SHM_TOUCH, it.key, it.object_id)
        return True

    def _read_referenced(self, seg: memoryview, items: list[ReadItem], verify: bool
                         ) -> list[KVStoreError | None]:
        where = self._where
        copied: dict[int, Location] = {}
        hashed: dict[int, int] = {}

        def guess() -> dict[int, Location]:
            for idx, it in enumerate(items):
                loc = where.get((it.key, it.object_id))
                if loc is not None and _fits(loc, it, seg):
                    actual = _copy(it.dest[:loc[1]], seg[loc[0]:loc[0] + loc[1]], verify)
                    if actual is not None:
                        hashed[idx] = actual
                    copied[idx] = loc
            self.guesses += len(copied)
            return copied

        def copy(jobs: list[tuple[int, Location]]) -> dict[int, KVStoreError]:
            for idx, loc in jobs:
                offset, size, _serial = loc
                self.wrong_guesses += idx in copied
                actual = _copy(items[idx].dest[:size], seg[offset:offset + size], verify)
                if actual is not None:
                    hashed[idx] = actual
                if self.max_locations:
                    where[(items[idx].key, items[idx].object_id)] = loc
                    if len(where) > self.max_locations:
                        where.popitem(last=False)
            return {}
        return read_by_reference(self.conn, items, verify, copy, guess if where else None,
                                 hashed)

    def close(self) -> None:
        self.conn.close()
        if self._maps is not None:
            self._maps.release(self.segment)
        else:
            self.segment.close()
