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

import hashlib
import mmap
import os
import socket

from kvstore._proto import kvstore_pb2 as _pb
from kvstore.errors import InvalidArgument, KVStoreError, error_for_code
from kvstore.transfer.base import ReadItem, Transport, WriteItem
from kvstore.transfer.protocol import Op
from kvstore.transfer.tcp import NodeConnection, TcpTransport, check_read

SHM_DIR = "/dev/shm"


def host_id() -> str:
    """An id of this machine and boot: equal host_ids can share memory."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/etc/machine-id"):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
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
            else:
                size_bytes = os.fstat(fd).st_size
            self.size_bytes = size_bytes
            self._mmap = mmap.mmap(fd, max(size_bytes, 1))
        finally:
            os.close(fd)
        self.view = memoryview(self._mmap)

    def close(self) -> None:
        """Unmap; the creator also unlinks the segment."""
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

#: SHM_ALLOC's offset when the exact version is already stored.
ALREADY_PRESENT_OFFSET = 2**64 - 1


class ShmTransport(Transport):
    """Copies through the node's segment; control frames over a TCP connection.

    Put: SHM_ALLOC (node reserves, replies offset) -> copy -> SHM_COMMIT
    (node verifies the checksum and publishes). Get: SHM_ACQUIRE (node takes a
    read reference, replies offset) -> copy -> SHM_RELEASE. Each phase is
    pipelined over the whole batch.
    """

    name = "shm"

    def __init__(self, conn: NodeConnection, segment: ShmSegment):
        self.conn = conn
        self.segment = segment

    def _phase(self, op: Op, keys_ids: list[tuple], parents: list[str] | None = None):
        for i, (key, oid, size, ck) in enumerate(keys_ids):
            self.conn.send(op, key, oid, size, ck, parent=parents[i] if parents else "")
        return [self.conn.recv_header() for _ in keys_ids]

    def write_many(self, items: list[WriteItem]) -> list[KVStoreError | None]:
        out: list[KVStoreError | None] = [None] * len(items)
        replies = self._phase(Op.SHM_ALLOC, [(i.key, i.object_id, len(i.data), i.checksum)
                                             for i in items], [i.parent for i in items])
        to_commit = []
        seg = self.segment.view
        for idx, (it, (code, _oid, _size, _ck, offset, msg)) in enumerate(zip(items, replies)):
            if code != _pb.OK:
                out[idx] = error_for_code(code, msg, key=it.key)
            elif offset != ALREADY_PRESENT_OFFSET:
                n = len(it.data)
                if n:
                    seg[offset:offset + n] = it.data
                to_commit.append(idx)
        replies = self._phase(Op.SHM_COMMIT, [(items[i].key, items[i].object_id, 0, 0)
                                              for i in to_commit])
        for idx, (code, _oid, _size, _ck, _off, msg) in zip(to_commit, replies):
            if code != _pb.OK:
                out[idx] = error_for_code(code, msg, key=items[idx].key)
        return out

    def read_many(self, items: list[ReadItem], verify: bool = True) -> list[KVStoreError | None]:
        out: list[KVStoreError | None] = [None] * len(items)
        self.conn.send_frames([(Op.SHM_ACQUIRE, i.key, i.object_id) for i in items])
        replies = [self.conn.recv_header() for _ in items]
        held = []
        seg = self.segment.view
        try:
            for idx, (it, (code, oid, size, _ck, offset, msg)) in enumerate(zip(items, replies)):
                if code != _pb.OK:
                    out[idx] = error_for_code(code, msg, key=it.key)
                    continue
                held.append((it.key, oid))
                if size > len(it.dest):
                    out[idx] = InvalidArgument(f"destination holds {len(it.dest)} B, "
                                               f"value is {size} B", key=it.key)
                    continue
                if size:
                    it.dest[:size] = seg[offset:offset + size]
                out[idx] = check_read(it, size, verify)
        finally:
            # Releases go out without waiting: their replies are checked before
            # the next reply this connection reads (one round trip saved per batch).
            if not self.conn.broken:
                for key, oid in held:
                    self.conn.send(Op.SHM_RELEASE, key, oid, expect_reply=False)
        fallback = [idx for idx, reply in enumerate(replies) if reply[0] == _pb.NO_SPACE]
        if fallback:
            # Only on a slower tier and DRAM had no room to promote it: the node
            # serves it inline over TCP from that tier instead.
            for idx, err in zip(fallback, TcpTransport(self.conn).read_many(
                    [items[i] for i in fallback], verify)):
                out[idx] = err
        return out

    def close(self) -> None:
        self.conn.close()
        self.segment.close()
