"""The asyncio SDK's same-host data path: values copied through a node's segment.

The asyncio twin of :class:`~kvstore.transfer.shm.ShmTransport`: a client on
the node's host maps the node's shared-memory segment and copies values in
and out itself, with the control frames on the node's pipelined connection
(:class:`~kvstore.transfer.aio_tcp.AsyncNodeConnection`), beside the other
coroutines' requests::

    get   remembered location in service (read slots)  copy, SHM_TOUCH     no await (but one
                                                       turn of the loop past MAX_UNANSWERED)
          else                                         SHM_ACQUIRE -> copy -> SHM_RELEASE
    put   SHM_ALLOC -> copy -> SHM_COMMIT (the node verifies the checksum, the master is told)
          of PUT_MIN_BYTES or more (a smaller one goes over the connection with its PUT)

SHM_TOUCH, SHM_RELEASE and SHM_ABORT are sent without waiting for their
answers (:meth:`AsyncNodeConnection.send_only`). A copy runs in the loop's
thread with the GIL released (the copies of a TCP connection's values run
there too, in the kernel): a 4 MiB value holds the loop about 0.2 ms here.
Reads are not hashed: the node verified the bytes at the commit, and a read
reference (or the read slots, checked before and after the copy) keeps them
from changing during the copy, as for the sync SDK's shared-memory reads.

A read reference asked for by a coroutine cancelled (or timed out) while the
answer was on its way is released all the same (a release of what was not
taken is answered NOT_FOUND and dropped), and a reservation whose commit was
not sent is aborted; a frame never queued (cancelled while the connection's
writing was paused) is followed by nothing. An object the node cannot bring
into DRAM (SHM_ACQUIRE answers NO_SPACE) is read over the connection instead.

A mapping serves one connection to its node: a new connection (the old one
broke: the node may have restarted, on the same address, with a new segment)
retires it, and the next use maps the segment the node's address names again,
if that file is still there (a restarted node's is not: a node removes the
segments of dead nodes at start); until the client learns the new address,
values go over TCP.

Thread safety: one event loop, as the connections'.
"""

from __future__ import annotations

from collections import OrderedDict

from kvstore.errors import ChecksumMismatch, KVStoreError, Unavailable
from kvstore.transfer import codec
from kvstore.transfer.aio_tcp import AsyncNodeConnection
from kvstore.transfer.reply import Reply
from kvstore.transfer.protocol import Op
from kvstore.transfer.shm import ALREADY_PRESENT_OFFSET, SegmentMaps, ShmSegment
from kvstore.transfer.shm_slots import ReadSlots

#: Object locations a node's path remembers (for reads with no round trip).
LOCATIONS = 4096
#: Puts of smaller values go over the connection: one round trip carrying the
#: value beats two around a copy in wall time (64 in flight here: 57 us a 64 KiB
#: put over TCP, 92 through the segment; 256 KiB 96 against 116; 1 MiB even,
#: 4 MiB 1.05 ms against 0.72), though the segment halves the node's CPU.
PUT_MIN_BYTES = 1 << 20


def _copied(view: memoryview, offset: int, size: int,
            dest: memoryview | None) -> memoryview | bytearray:
    """``size`` bytes at ``offset`` of ``view``, copied into ``dest`` (or a new bytearray)."""
    out = bytearray(size) if dest is None else dest[:size]
    out[:] = view[offset:offset + size]
    return out


class AsyncShm:
    """One node's segment as this client maps it, and the locations it learnt there.

    Args:
        segment: the node's segment, mapped (and counted) in ``maps``.
        maps: the client's mappings (released there by :meth:`close`).
    """

    def __init__(self, segment: ShmSegment, maps: SegmentMaps, conn: AsyncNodeConnection):
        self.segment = segment
        self._maps = maps
        self.conn = conn            # the connection to the node this mapping serves
        self.slots = ReadSlots.attach(segment.view)
        self._where: OrderedDict[tuple[str, int], tuple[int, int, int]] = OrderedDict()
        self.unreferenced = 0       # reads with no round trip (checked in the read slots)

    @property
    def usable(self) -> bool:
        """Whether the mapping is still there (a retired one: the node restarted or failed)."""
        return not self.segment.closed

    def read_known(self, key: str, object_id: int, size_bytes: int,
                   dest: memoryview | None) -> memoryview | bytearray | None:
        """The value copied from the location a read learnt, if the read slots show it
        in service throughout (its SHM_TOUCH queued on the connection): no await.
        None: nothing is known about ``dest`` (read it with :meth:`read`)."""
        loc = self._where.get((key, object_id))
        slots = self.slots
        if loc is None or slots is None or self.conn.broken is not None:
            return None
        offset, size, serial = loc
        if size != size_bytes or (dest is not None and len(dest) < size):
            return None
        if not slots.serves(serial) or not self._maps.enter(self.segment):
            return None
        try:
            out = _copied(self.segment.view, offset, size, dest)
        finally:
            self._maps.leave(self.segment)
        if not slots.still(serial):
            return None
        self.unreferenced += 1
        self.conn.send_only(Op.SHM_TOUCH, key, object_id)
        return out

    async def read(self, key: str, object_id: int, size_bytes: int, dest: memoryview | None,
                   timeout_s: float) -> memoryview | bytearray | KVStoreError:
        """The value through a read reference (SHM_ACQUIRE, the copy, SHM_RELEASE), or
        the node's answer as an error (NotFound...); ``dest`` (when given) holds
        ``size_bytes`` at least.

        Raises:
            Unavailable: the connection broke, the answer did not come in time, or
                the mapping was retired meanwhile.
        """
        conn, asked = self.conn, []
        try:
            reply = await conn.request(Op.SHM_ACQUIRE, key, object_id, timeout_s=timeout_s,
                                       on_queued=lambda: asked.append(True))
            err = reply.error(key)
            if err is not None:
                asked.clear()                # nothing was taken
                return err
            size = reply.size
            if size != size_bytes or reply.offset + size > self.segment.size_bytes:
                return ChecksumMismatch(f"the node holds {size} B at {reply.offset}, "
                                        f"{size_bytes} B expected", key=key)
            with self._maps.using(self.segment) as view:
                out = _copied(view, reply.offset, size, dest)
            self._remember(key, object_id, (reply.offset, size, reply.serial))
            return out
        finally:
            if asked:
                conn.send_only(Op.SHM_RELEASE, key, object_id)

    async def write(self, key: str, object_id: int, value: memoryview, checksum: int | None,
                    parent: str, replica_num: int, timeout_s: float) -> Reply:
        """Put ``value`` (``checksum`` its XXH3-64; None: hashed as it is copied, named
        with SHM_COMMIT) through a reservation: the commit's answer (or SHM_ALLOC's, an
        error or "this version is stored already"); an OK one names the checksum.

        Raises:
            Unavailable: the connection broke, an answer did not come in time, or
                the mapping was retired meanwhile.
        """
        n, conn, reserving = len(value), self.conn, []
        try:
            reply = await conn.request(Op.SHM_ALLOC, key, object_id, n, checksum or 0,
                                       parent=parent, flags=replica_num, timeout_s=timeout_s,
                                       on_queued=lambda: reserving.append(True))
            if not reply.ok or reply.offset == ALREADY_PRESENT_OFFSET:
                reserving.clear()            # nothing is reserved
                return reply
            if reply.offset + n > self.segment.size_bytes:
                raise Unavailable(f"the node reserved {n} B at {reply.offset}, past the "
                                  f"end of its segment {self.segment.name} as mapped here")
            with self._maps.using(self.segment) as view:
                with view[reply.offset:reply.offset + n] as dst:
                    if checksum is None:
                        late = codec.copy_hashed(dst, value)   # one pass, the GIL released
                    elif n:
                        dst[:] = value
            reserving.clear()                # the commit ends it, whatever comes back
            return await conn.request(Op.SHM_COMMIT, key, object_id, 0,
                                      late if checksum is None else 0, timeout_s=timeout_s)
        finally:
            if reserving:
                conn.send_only(Op.SHM_ABORT, key, object_id)

    def _remember(self, key: str, object_id: int, loc: tuple[int, int, int]) -> None:
        where = self._where
        where[(key, object_id)] = loc
        where.move_to_end((key, object_id))
        if len(where) > LOCATIONS:
            where.popitem(last=False)

    def close(self) -> None:
        self._maps.release(self.segment)


class AsyncShms:
    """The segments of the nodes on this host, mapped on first use (one per node, the
    newest: a restarted node's new segment retires the old mapping).

    Args:
        host_id: this host's id (:func:`kvstore.transfer.shm.host_id`).
        prefault_bytes: how much of each segment to map ahead of the copies.
    """

    def __init__(self, host_id: str, prefault_bytes: int):
        self.host_id = host_id
        self._maps = SegmentMaps(prefault_bytes)
        self._by_node: dict[str, AsyncShm] = {}
        self._gone: set[str] = set()        # segment files not there (TCP for those names)

    def local(self, node) -> bool:
        """Whether ``node`` (a :class:`~kvstore.types.NodeAddress`) is on this host with a
        segment that may be there."""
        return bool(node.shm_name) and node.host_id == self.host_id and (
            node.shm_name not in self._gone)

    def of(self, node, conn: AsyncNodeConnection) -> AsyncShm | None:
        """The path to ``node`` through its segment for ``conn``, the connection to it
        now; None: not on this host, or its segment cannot be mapped here (TCP then)."""
        shm = self._by_node.get(node.node_id)
        if (shm is not None and shm.conn is conn and shm.segment.name == node.shm_name
                and shm.usable):
            return shm
        if not self.local(node):
            return None
        if shm is not None:                  # another connection, or another segment
            del self._by_node[node.node_id]
            shm.close()
            self._maps.retire_node(node.node_id)
        try:
            segment = self._maps.acquire(node.shm_name, node.node_id)
        except FileNotFoundError:
            self._gone.add(node.shm_name)
            return None
        except OSError:
            return None                      # tried again at the next use
        shm = self._by_node[node.node_id] = AsyncShm(segment, self._maps, conn)
        return shm

    def wait_prefaulted(self, timeout_s: float) -> bool:
        """Until every mapped segment's prefault ended; False: ``timeout_s`` first."""
        return self._maps.wait_prefaulted(timeout_s)

    def close(self) -> None:
        for shm in self._by_node.values():
            shm.close()
        self._by_node.clear()
