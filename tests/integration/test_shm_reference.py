"""A shared-memory reader's reference pins the object's memory on the node.

The reader here is the low-level protocol (``NodeConnection`` + SHM_ACQUIRE)
mapping the node's segment itself: while it holds the reference, removing
the key and filling the node never reuses those bytes; after SHM_RELEASE
(or when the reader's connection goes away) they are freed and reused.

The SDK's own reads: their deferred SHM_RELEASE reaches the node although
the reader stays idle; a read of a remembered location skips the node only
while the node's read slots show that allocation in service (and is counted
by a deferred SHM_TOUCH), else its copy is kept only when the node's reply
names the same allocation.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.errors import InvalidArgument, KeyConflict, NoSpace, NotFound, Unavailable
from kvstore.keys import value_checksum
from kvstore.transfer.protocol import MAX_UNANSWERED, Op
from kvstore.transfer.shm import ShmSegment, ShmTransport
from kvstore.transfer.tcp import DEFER_FLUSH_S, NodeConnection
from kvtest import cluster_running, node_stats, wait_for

KiB = 1 << 10
OBJ = 256 * KiB          # four objects fill the 1 MiB node exactly


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    with cluster_running(str(tmp_path_factory.mktemp("shm-ref-logs")), num_nodes=1,
                         dram="1MiB") as running:
        yield running


@pytest.fixture
def kv(one_node):
    with KVClient(one_node.master, prefer_shm=True) as client:
        yield client
        # Leave the node empty for the next test.
        client.batch_remove([m.key for m in client.list()])
        wait_for(lambda: node_stats(client)["n0"].used_bytes == 0)


def value(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, OBJ, dtype=np.uint8).tobytes()


def offset_of(conn: NodeConnection, key: str) -> int:
    oid, _size, _ck, offset = conn.call(Op.SHM_ACQUIRE, key)
    conn.call(Op.SHM_RELEASE, key, oid)
    return offset


def num_objects_reported(kv: KVClient, n: int):
    """Wait until the node's heartbeat reports ``n`` objects; returns its NodeStatus.

    (Removal reaches the node with a heartbeat reply; only a heartbeat
    reporting the new count shows that the node has applied it.)
    """
    return wait_for(lambda: (lambda s: s if s.num_objects == n else None)(node_stats(kv)["n0"]))


def connect(kv: KVClient, key: str) -> tuple[NodeConnection, ShmSegment]:
    (meta,) = kv.lookup([key])
    node = meta.replicas[0].node
    return NodeConnection(node.host, node.data_port), ShmSegment(node.shm_name)


def test_reference_keeps_memory_through_remove_and_refill(kv):
    data = value(0)
    kv.put("pinned", data)
    conn, seg = connect(kv, "pinned")
    try:
        (meta,) = kv.lookup(["pinned"])
        oid, size, checksum, offset = conn.call(Op.SHM_ACQUIRE, "pinned", meta.object_id)
        assert (oid, size, checksum) == (meta.object_id, OBJ, value_checksum(data))
        pinned = seg.view[offset:offset + size]
        assert pinned == data

        num_objects_reported(kv, 1)
        kv.remove("pinned")
        with pytest.raises(NotFound):
            kv.get("pinned")
        # The drop reached the node (no object left), but the memory is still held.
        assert num_objects_reported(kv, 0).used_bytes == OBJ
        with pytest.raises(NotFound):
            conn.call(Op.SHM_ACQUIRE, "pinned")          # no new readers

        # New puts fill everything else; the fourth does not fit.
        for i in range(1, 4):
            assert kv.put(f"fill{i}", value(i)) is True
        with pytest.raises(NoSpace):
            kv.put("fill4", value(4))
        assert all(offset_of(conn, f"fill{i}") != offset for i in range(1, 4))
        assert pinned == data and value_checksum(pinned) == checksum
        assert kv.batch_get([f"fill{i}" for i in range(1, 4)]) == [value(i) for i in range(1, 4)]

        # Release: the memory goes back at once and the next put lands there.
        conn.call(Op.SHM_RELEASE, "pinned", oid)
        with pytest.raises(NotFound):
            conn.call(Op.SHM_RELEASE, "pinned", oid)     # released once only
        assert kv.put("fill4", value(4)) is True
        assert offset_of(conn, "fill4") == offset
        assert pinned == value(4)
        pinned.release()
    finally:
        conn.close()
        seg.close()


def test_reader_connection_closing_releases_its_references(kv):
    kv.put("held", value(7))
    conn, seg = connect(kv, "held")
    seg.close()
    conn.call(Op.SHM_ACQUIRE, "held")
    conn.call(Op.SHM_ACQUIRE, "held")                    # two references, one connection
    num_objects_reported(kv, 1)
    kv.remove("held")
    assert num_objects_reported(kv, 0).used_bytes == OBJ
    conn.close()                                         # a reader that goes away
    wait_for(lambda: node_stats(kv)["n0"].used_bytes == 0)


def shm_transport(kv: KVClient) -> ShmTransport:
    (tr,) = kv._connections._local.transports.map.values()   # this thread's one transport to n0
    assert isinstance(tr, ShmTransport)
    return tr


def test_idle_reader_drops_its_references(kv, one_node):
    kv.put("read-once", value(8))
    dest = bytearray(OBJ)
    assert kv.get_into("read-once", dest) == OBJ and dest == value(8)
    # The reader does nothing more; another client (its own connection, so it
    # cannot carry the reader's deferred release) sees the reference dropped.
    with KVClient(one_node.master) as observer:
        wait_for(lambda: observer.node_stats()["n0"]["num_referenced"] == 0,
                 timeout_s=max(1.0, 100 * DEFER_FLUSH_S))


def test_copy_from_a_remembered_location_needs_the_same_allocation(kv):
    kv.put("a", value(10))
    kv.put("b", value(11))
    dest = bytearray(OBJ)
    kv.get_into("a", dest)
    kv.get_into("b", dest)
    tr = shm_transport(kv)
    (meta_a,) = kv.lookup(["a"])
    (meta_b,) = kv.lookup(["b"])
    loc_a = tr._where[("a", meta_a.object_id)]
    loc_b = tr._where[("b", meta_b.object_id)]

    # Remembered and still in service (the read slots say so): no round trip.
    unref, guesses, wrong = tr.unreferenced, tr.guesses, tr.wrong_guesses
    assert kv.get_into("a", dest) == OBJ and dest == value(10)
    assert (tr.unreferenced, tr.guesses, tr.wrong_guesses) == (unref + 1, guesses, wrong)

    # An earlier lifetime of a's range (another serial) is not in service: the
    # read goes to the node, copying while the acquire is in flight.
    tr._where[("a", meta_a.object_id)] = (loc_a[0], loc_a[1], loc_a[2] - 1)
    assert kv.get_into("a", dest) == OBJ and dest == value(10)
    assert (tr.unreferenced, tr.guesses, tr.wrong_guesses) == (unref + 1, guesses + 1, wrong + 1)
    assert tr._where[("a", meta_a.object_id)] == loc_a

    # Without the read slots (a node that has none), every read asks the node,
    # and a copy made meanwhile is kept only when the reply names its allocation.
    tr.slots = None
    assert kv.get_into("a", dest) == OBJ and dest == value(10)
    assert (tr.guesses, tr.wrong_guesses) == (guesses + 2, wrong + 1)     # confirmed
    # Remembered at b's range: the guess copies b's bytes, the reply names a's
    # allocation, and a is copied again.
    tr._where[("a", meta_a.object_id)] = loc_b
    assert kv.get_into("a", dest) == OBJ and dest == value(10)
    assert (tr.guesses, tr.wrong_guesses) == (guesses + 3, wrong + 2)
    assert tr.unreferenced == unref + 1


def test_a_known_get_is_one_copy_with_no_request_and_keeps_the_errors(one_node):
    """KVClient.get_into of a key this thread read before from this host: the copy
    alone (its SHM_TOUCH deferred), no request sent and no reply awaited; what it
    cannot serve (a destination too small, a closed client) raises as ever."""
    kv = KVClient(one_node.master, prefer_shm=True)
    try:
        kv.put("known", value(16))
        dest = bytearray(OBJ)
        kv.get_into("known", dest)                 # learns the location
        tr = shm_transport(kv)
        conn = tr.conn
        real = conn.send, conn.recv_header

        def no_round_trip(*_args, **_kwargs):
            raise AssertionError("a known get went to the node")
        conn.send = conn.recv_header = no_round_trip
        try:
            dest[:] = bytes(OBJ)
            assert kv.get_into("known", dest) == OBJ and dest == value(16)
            assert kv._reads.get_known("known", memoryview(bytearray(OBJ - 1))) is None
        finally:
            conn.send, conn.recv_header = real
        with pytest.raises(InvalidArgument):
            kv.get_into("known", bytearray(OBJ - 1))
        kv.remove("known")
    finally:
        kv.close()
    with pytest.raises(Unavailable):
        kv.get_into("known", dest)


def test_unreferenced_reads_stop_at_a_removal_and_are_counted(kv, one_node):
    kv.put("d", value(15))
    dest = bytearray(OBJ)
    with KVClient(one_node.master) as observer:
        gets = observer.node_stats()["n0"]["counters"]["gets"]
        kv.get_into("d", dest)                 # acquires, remembers the location
        tr = shm_transport(kv)
        unref = tr.unreferenced
        for _ in range(3):
            assert kv.get_into("d", dest) == OBJ and dest == value(15)
        assert tr.unreferenced == unref + 3
        # Their deferred SHM_TOUCH frames reach the node: every read is counted.
        wait_for(lambda: observer.node_stats()["n0"]["counters"]["gets"] == gets + 4,
                 timeout_s=max(1.0, 100 * DEFER_FLUSH_S))
        num_objects_reported(kv, 1)
        observer.remove("d")                   # another client; the node drops it
        num_objects_reported(kv, 0)
    with pytest.raises(NotFound):
        kv.get_into("d", dest)
    assert tr.unreferenced == unref + 3


def test_a_reader_of_known_locations_reads_the_touch_replies_it_owes(kv, one_node):
    """A thread whose gets are all same-host copies never waits for a reply, but each
    get's SHM_TOUCH is answered: the replies are read once MAX_UNANSWERED are owed,
    so they never fill the socket (which stalled the node's sends, then a get for the
    socket timeout, 10 s, every few hundred thousand gets), and each get is counted."""
    kv.put("t", value(17))
    dest = bytearray(OBJ)
    kv.get_into("t", dest)                     # learns the location
    conn = shm_transport(kv).conn
    with KVClient(one_node.master) as observer:
        gets = observer.node_stats()["n0"]["counters"]["gets"]
        n = 6 * MAX_UNANSWERED
        for i in range(n):
            assert kv.get_into("t", dest) == OBJ
            assert conn._owed <= 2 * MAX_UNANSWERED
            if i % 100 == 0:
                conn.flush_deferred()          # as the flusher would, sooner
        assert dest == value(17) and not conn.broken
        wait_for(lambda: observer.node_stats()["n0"]["counters"]["gets"] == gets + n,
                 timeout_s=10)


def test_location_of_a_removed_and_rewritten_key(kv, one_node):
    kv.put("c", value(12))
    dest = bytearray(OBJ)
    kv.get_into("c", dest)                     # remembers c's location
    with KVClient(one_node.master) as other:   # another client replaces c
        other.remove("c")
        num_objects_reported(other, 0)
        other.put("filler", value(13))         # likely in c's old range
        other.put("c", value(14))
    assert kv.get_into("c", dest) == OBJ and dest == value(14)


def test_unreferenced_reads_racing_a_removal_see_whole_values_or_nothing(kv, one_node):
    """Nothing on the node holds an unreferenced reader's object: another client
    removes it mid-read and puts new values into its range. Every read returns
    the value whole or NotFound, never a mix or the newer bytes."""
    dest = bytearray(OBJ)
    good = 0
    for round_ in range(4):
        key = f"hot{round_}"
        kv.put(key, value(round_))
        kv.get_into(key, dest)                   # remembered: later reads skip the node

        def replace(i=round_):
            with KVClient(one_node.master, prefer_shm=True) as other:
                other.remove(key)
                for j in range(3):               # the node's free space, key's range included
                    other.put(f"filler{i}-{j}", value(100 + j))

        thread = threading.Thread(target=replace)
        thread.start()
        try:
            for _ in range(10_000):
                try:
                    assert kv.get_into(key, dest) == OBJ
                except NotFound:
                    break
                assert dest == value(round_)
                good += 1
            else:
                raise AssertionError("a removed key stayed readable")
        finally:
            thread.join()
        kv.batch_remove([f"filler{round_}-{j}" for j in range(3)])
        wait_for(lambda: node_stats(kv)["n0"].used_bytes == 0)
    assert good > 0 and shm_transport(kv).unreferenced > 0


def test_warm_up_maps_the_segment_before_the_first_copy(one_node):
    with KVClient(one_node.master, prefer_shm=True) as client:
        assert client.warm_up(timeout_s=30)
        (seg,) = client._connections._segments._current.values()
        assert seg.prefaulting is not None and not seg.prefaulting.is_alive()
        client.put("warm", value(1))
        assert client.get("warm") == value(1)
        client.remove("warm")


def test_a_large_shm_put_is_hashed_while_copied_and_keeps_every_rule(one_node):
    big = np.random.default_rng(7).integers(0, 256, OBJ + OBJ // 2 + 3, dtype=np.uint8).tobytes()
    with KVClient(one_node.master, prefer_shm=True) as client:
        assert client.put("big", big) is True
        (meta,) = client.lookup(["big"])
        assert meta.checksum == value_checksum(big) and meta.size_bytes == len(big)
        assert client.get("big") == big
        assert client.put("big", big) is False               # equal bytes: already present
        with pytest.raises(KeyConflict):
            client.put("big", big[:-1] + b"\0")
        assert client.get("big") == big
        client.remove("big")
