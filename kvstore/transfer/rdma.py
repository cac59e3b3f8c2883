"""One-sided RDMA (pyverbs) behind the :class:`~kvstore.transfer.base.Transport` interface.

The node registers its DRAM segment (the same shared-memory segment the
``shm`` transport maps) as one memory region (MR) and hands out its address
and rkey; the client then moves value bytes with RDMA WRITE and RDMA READ
straight into and out of that segment, with no CPU work on the node. Where
in the segment is decided exactly as for ``shm``: the node's SHM_* control
frames on the client's TCP connection reserve, publish and pin objects, and
their offsets are offsets into the MR::

    client (RdmaTransport)                    store node (RdmaNodeEndpoint)
    PD, CQ, one RC QP, staging MR             PD, segment MR (remote read+write),
                                              one RC QP per client connection
      RDMA_CONNECT  (client QP descriptor) ->
                   <- node QP descriptor + segment MR descriptor
      both QPs: INIT -> RTR -> RTS
    put:  SHM_ALLOC   -> offset;  RDMA WRITE -> mr.addr + offset;  SHM_COMMIT (node verifies)
    get:  SHM_ACQUIRE -> offset;  RDMA READ  <- mr.addr + offset;  SHM_RELEASE

References and reservations keep their meaning: they belong to the TCP
connection, and the memory under an in-flight RDMA op is reserved or
referenced until the op's completion has been polled.

Control exchange (one frame each way, :mod:`kvstore.transfer.protocol`
headers)::

    request   header op=RDMA_CONNECT, key "", size=36 | QpDescriptor (36 B)
    response  header OK, size=68                      | QpDescriptor (36 B) | MrDescriptor (32 B)

    QpDescriptor  "KVRQ" | version u8 | port u8 | mtu u8 (ibv_mtu) | gid_index u8
                  | lid u16 | rd_atomic u16 | qpn u32 | psn u32 | gid 16 B
    MrDescriptor  "KVRM" | version u8 | 3 B pad | addr u64 | length u64 | rkey u32 | 4 B pad

A node without RDMA answers an error (a node that does not know the op
answers INVALID_ARGUMENT and closes the connection); the client raises
:class:`~kvstore.errors.Unavailable` and the caller falls back to TCP or
shared memory on a new connection.

Where it is mounted: ``kvstore node --rdma-device DEV`` makes one
:class:`RdmaNodeEndpoint` over the DRAM segment and hands it to the data
server, whose connections answer RDMA_CONNECT with a queue pair they own;
a connection closes its queue pairs first when it ends, then gives back its
reservations and references. ``KVClient(rdma_device=DEV)`` uses an
:class:`RdmaTransport` for every node that shared memory does not reach,
and TCP where either side cannot do RDMA.

pyverbs is imported lazily (only when an RDMA transport or endpoint is
made): on PyPI it is ``pyverbs`` (an sdist of rdma-core's bindings; the
``rdma`` extra), on Debian ``python3-pyverbs``. Without it, or without the
named device, constructors raise :class:`~kvstore.errors.Unavailable` with
what is missing.

Modules: :mod:`kvstore.transfer.rdma_wire` (descriptors, staging plans;
pure), :mod:`kvstore.transfer.verbs` (pyverbs wrappers), this one (the
transport and the node's half). Tests: ``tests/unit/test_rdma_wire.py``
(no hardware) and ``tests/rdma/test_rdma.py`` (marked ``rdma``; see its
docstring for soft-RoCE).

Thread safety: an :class:`RdmaTransport` is used by one thread (like every
transport). :class:`RdmaNodeEndpoint` may be called from several connection
threads; ``accept`` takes its lock. Polling a CQ blocks the calling thread
(never an event loop).
"""

from __future__ import annotations

import logging
import mmap
import threading
from typing import Any

from kvstore._proto import kvstore_pb2 as _pb
from kvstore.errors import InvalidArgument, KVStoreError, Unavailable, error_for_code
from kvstore.transfer.base import ReadItem, Transport, WriteItem, hash_unhashed
from kvstore.transfer.buffers import writable_view
from kvstore.transfer.protocol import Op
from kvstore.transfer.rdma_wire import (MAX_CONNECT_BYTES, OP_RDMA_CONNECT, MrDescriptor,
                                        QpDescriptor, RegionTable, address_of,
                                        decode_connect_reply, encode_connect_reply, plan_rounds)
from kvstore.transfer.tcp import Location, NodeConnection, read_by_reference
from kvstore.transfer.verbs import RcQueuePair, RdmaDevice, close_quietly
from kvstore.types import TransportKind

__all__ = ["MAX_CONNECT_BYTES", "OP_RDMA_CONNECT", "RdmaNodeEndpoint", "RdmaTransport"]

log = logging.getLogger(__name__)

#: SHM_ALLOC's offset when the exact version is already stored (as for shm).
ALREADY_PRESENT_OFFSET = 2**64 - 1


# ---- node side ---------------------------------------------------------------------

class RdmaNodeEndpoint:
    """A store node's RDMA half: its segment registered once, one QP per client.

    Args:
        device: RDMA device name.
        segment: the node's DRAM segment (writable; outlives the endpoint).
        port, gid_index: see :class:`RdmaDevice`.

    Raises:
        Unavailable: no pyverbs, no device, or the segment cannot be registered.
    """

    def __init__(self, device: str, segment: memoryview, *, port: int = 1,
                 gid_index: int | None = None, qp_depth: int = 16):
        self.device = RdmaDevice(device, port, gid_index)
        self.qp_depth = qp_depth
        try:
            self.mr = self.device.register(segment, remote=True)
        except BaseException:
            self.device.close()
            raise
        self.region = MrDescriptor(addr=address_of(segment), length=len(segment),
                                   rkey=int(self.mr.rkey))
        self._lock = threading.Lock()

    def accept(self, request: bytes | memoryview) -> tuple[RcQueuePair, bytes]:
        """Answer one RDMA_CONNECT: a QP connected to the client's.

        Returns:
            (the QP, which the connection owns and closes first when it ends;
            the reply payload).

        Raises:
            InvalidArgument: malformed request.
            Unavailable: the QP could not be made or connected.
        """
        remote = QpDescriptor.decode(request)
        with self._lock:
            qp = self.device.queue_pair(self.qp_depth)
            try:
                qp.connect(remote)
            except BaseException:
                qp.close()
                raise
        return qp, encode_connect_reply(qp.descriptor(), self.region)

    def close(self) -> None:
        """After every peer QP is closed."""
        close_quietly(self.mr)
        self.device.close()


# ---- client side -------------------------------------------------------------------

class RdmaTransport(Transport):
    """Values moved by one-sided RDMA; control frames over the node's TCP connection.

    Failure policy: when an RDMA op fails or times out, the QP is destroyed at
    once (so no late DMA can land in local memory), values already moved are
    still committed, and the TCP connection is closed: the node then closes
    its QP before it aborts the connection's reservations and drops its
    references, so a late write can never land in memory that was reused.
    ``conn.broken`` tells the SDK to make a new transport.

    Args:
        conn: a fresh connection to the node (RDMA_CONNECT must be its first
            frame). The transport owns it from now on.
        device: local RDMA device name.
        port, gid_index: see :class:`RdmaDevice`.
        staging_bytes: registered bounce buffer for memory that is not registered.
        depth: work requests in flight.
        timeout_s: per round of RDMA ops.

    Raises:
        Unavailable: no pyverbs or device, or the node does not serve RDMA
            (``conn`` is closed then: use a new one to fall back to TCP or shm).
    """

    kind = TransportKind.RDMA

    def __init__(self, conn: NodeConnection, device: str, *, port: int = 1,
                 gid_index: int | None = None, staging_bytes: int = 32 * 1024 * 1024,
                 depth: int = 32, timeout_s: float = 10.0):
        self.conn = conn
        self.timeout_s = timeout_s
        self.depth = depth
        self.regions = RegionTable()
        self._mrs: dict[int, tuple[Any, memoryview]] = {}   # start address -> (MR, view)
        self.device: RdmaDevice | None = None
        self.qp: RcQueuePair | None = None
        self._staging_mr = None
        self.staging: memoryview | None = None
        try:
            self.device = RdmaDevice(device, port, gid_index)
            self._staging_map = mmap.mmap(-1, staging_bytes)
            self.staging = memoryview(self._staging_map)
            self._staging_mr = self.device.register(self.staging, remote=False)
            self._staging_lkey = int(self._staging_mr.lkey)
            self.qp = self.device.queue_pair(depth)
            self.remote = self._handshake()
        except BaseException:
            self.close()
            raise

    def _handshake(self) -> MrDescriptor:
        payload = self.qp.descriptor().encode()
        self.conn.send(OP_RDMA_CONNECT, "", size=len(payload), payload=memoryview(payload))
        code, _oid, size, _ck, _off, msg = self.conn.recv_header()
        if code != _pb.OK:
            raise Unavailable(f"store node does not serve RDMA: {msg}")
        if size > MAX_CONNECT_BYTES:
            raise Unavailable(f"RDMA_CONNECT reply of {size} B")
        buf = bytearray(size)
        self.conn.recv_value_into(size, memoryview(buf))
        node_qp, region = decode_connect_reply(buf)
        self.qp.connect(node_qp)
        return region

    # -- memory --

    def register(self, buffer: Any) -> None:
        """Register caller memory (e.g. a KV cache tensor) for zero-copy transfers.

        Values and destinations that lie inside a registered buffer skip the
        staging copy. The buffer must stay alive until :meth:`unregister` or
        :meth:`close`.

        Raises:
            Unavailable: registration failed.
            ValueError: it overlaps a registered buffer.
        """
        view = writable_view(buffer)
        mr = self.device.register(view, remote=False)
        start = address_of(view)
        try:
            self.regions.add(start, len(view), int(mr.lkey))
        except ValueError:
            mr.close()
            raise
        self._mrs[start] = (mr, view)

    def unregister(self, buffer: Any) -> None:
        """Undo :meth:`register` (no-op for a buffer that is not registered)."""
        start = address_of(writable_view(buffer))
        entry = self._mrs.pop(start, None)
        if entry is not None:
            self.regions.remove(start)
            entry[0].close()

    # -- data --

    def _phase(self, op: Op, frames: list[tuple[str, int, int, int, str, int]]) -> list[tuple]:
        """Pipelined frames ``(key, object_id, size, checksum, parent, flags)``."""
        for key, oid, size, ck, parent, flags in frames:
            self.conn.send(op, key, oid, size, ck, parent=parent, flags=flags)
        return [self.conn.recv_header() for _ in frames]

    def _drop_qp(self) -> None:
        """After a failed op: no DMA may touch local memory any more."""
        if self.qp is not None:
            self.qp.close()
            self.qp = None
        self.conn.broken = True

    def _move(self, is_write: bool, jobs: list[tuple[int, memoryview, int]]) -> dict[int, bool]:
        """RDMA between local views and remote addresses.

        Args:
            jobs: ``(index, local view, remote address)``.

        Returns:
            Per job index, True when all its bytes moved.
        """
        ok: dict[int, bool] = {}
        direct, staged = [], []
        for idx, view, raddr in jobs:
            ok[idx] = self.qp is not None
            if not len(view):
                continue
            laddr = address_of(view)
            lkey = self.regions.find(laddr, len(view))
            if lkey is not None:
                direct.append((idx, (is_write, laddr, lkey, len(view), raddr, self.remote.rkey)))
            else:
                staged.append((idx, view, raddr))
        if direct and self.qp is not None:
            res = self.qp.run([op for _i, op in direct], self.timeout_s)
            for (idx, _op), good in zip(direct, res):
                ok[idx] = ok[idx] and good
            if not all(res):
                self._drop_qp()
        stage = self.staging
        base = address_of(stage)
        for rnd in plan_rounds([len(j[1]) for j in staged], len(stage), self.depth):
            if self.qp is None:
                for c in rnd:
                    ok[staged[c.item][0]] = False
                continue
            if is_write:
                for c in rnd:
                    stage[c.staging_offset:c.staging_offset + c.length] = \
                        staged[c.item][1][c.item_offset:c.item_offset + c.length]
            res = self.qp.run([(is_write, base + c.staging_offset, self._staging_lkey, c.length,
                                staged[c.item][2] + c.item_offset, self.remote.rkey)
                               for c in rnd], self.timeout_s)
            if not all(res):
                self._drop_qp()
            for c, good in zip(rnd, res):
                idx, view = staged[c.item][0], staged[c.item][1]
                ok[idx] = ok[idx] and good
                if good and not is_write:
                    view[c.item_offset:c.item_offset + c.length] = \
                        stage[c.staging_offset:c.staging_offset + c.length]
        return ok

    def write_many(self, items: list[WriteItem]) -> list[KVStoreError | None]:
        hash_unhashed(items)
        out: list[KVStoreError | None] = [None] * len(items)
        replies = self._phase(Op.SHM_ALLOC, [(i.key, i.object_id, len(i.data), i.checksum,
                                              i.parent, i.replica_num) for i in items])
        jobs = []
        for idx, (it, (code, _oid, _size, _ck, offset, msg)) in enumerate(zip(items, replies)):
            if code != _pb.OK:
                out[idx] = error_for_code(code, msg, key=it.key)
            elif offset != ALREADY_PRESENT_OFFSET:
                try:
                    jobs.append((idx, it.data, self.remote.remote_address(offset, len(it.data))))
                except InvalidArgument as err:
                    out[idx] = err   # the reservation goes with the connection (below)
                    self.conn.broken = True
        moved = self._move(True, jobs)
        commit = [idx for idx, _v, _a in jobs if moved[idx]]
        replies = self._phase(Op.SHM_COMMIT, [(items[i].key, items[i].object_id, 0, 0, "", 0)
                                              for i in commit])
        for idx, (code, _oid, _size, _ck, _off, msg) in zip(commit, replies):
            if code != _pb.OK:
                out[idx] = error_for_code(code, msg, key=items[idx].key)
        failed = [idx for idx, _v, _a in jobs if not moved[idx]]
        for idx in failed:
            out[idx] = Unavailable("RDMA write failed", key=items[idx].key)
        if self.conn.broken:
            # Never SHM_ABORT after a failed write: closing the connection makes
            # the node close its QP first, then give the reservations back.
            self.conn.close()
        return out

    def read_many(self, items: list[ReadItem], verify: bool = True) -> list[KVStoreError | None]:
        def rdma_read(jobs: list[tuple[int, Location]]) -> dict[int, KVStoreError]:
            failed: dict[int, KVStoreError] = {}
            reads = []
            for idx, (offset, size, _serial) in jobs:
                try:
                    reads.append((idx, items[idx].dest[:size],
                                  self.remote.remote_address(offset, size)))
                except InvalidArgument as err:
                    failed[idx] = err
            moved = self._move(False, reads)
            for idx, _view, _addr in reads:
                if not moved[idx]:
                    failed[idx] = Unavailable("RDMA read failed", key=items[idx].key)
            return failed
        # References are dropped only once no READ can still be reading: after the
        # completions, or (a failed READ breaks the connection) by closing it.
        return read_by_reference(self.conn, items, verify, rdma_read)

    def close(self) -> None:
        """Close the connection first (the node drops its QP), then local resources."""
        self.conn.close()
        self.conn.broken = True
        if self.qp is not None:
            self.qp.close()
            self.qp = None
        for mr, _view in self._mrs.values():
            close_quietly(mr)
        self._mrs.clear()
        if self._staging_mr is not None:
            close_quietly(self._staging_mr)
            self._staging_mr = None
        if self.device is not None:
            self.device.close()
            self.device = None
        if self.staging is not None:
            self.staging.release()
            self._staging_map.close()
            self.staging = None
