"""The native GET service (kvstore/store/native_gets.py) on a real node's data port:
GETs of a read copy are answered without Python, in order with Python's answers,
counted as Python's are, and a range still being sent is never reused."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.keys import value_checksum
from kvstore.store.data_server import DataServer
from kvstore.store.node import StoreNode
from kvstore.store.tiers.dram import DramTier
from kvstore.transfer.base import ReadItem, WriteItem
from kvstore.transfer.protocol import RESPONSE, Op
from kvstore.transfer.tcp import NodeConnection, TcpTransport

MiB = 1 << 20


def _value(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture()
def node():
    n = StoreNode(DramTier(96 * MiB), start_mover=False)      # no master: no lease to wait for
    server = DataServer(n).start()
    n.port = server.port
    python_reads = []
    acquire = n.acquire

    def counted(key, *args, **kw):                          # reads the Python loop serves
        python_reads.append(key)
        return acquire(key, *args, **kw)
    n.acquire = counted
    n.python_reads = python_reads
    try:
        yield n
    finally:
        server.stop()
        n.close()


@pytest.fixture()
def tr(node):
    transport = TcpTransport(NodeConnection("127.0.0.1", node.port, timeout_s=10))
    yield transport
    transport.close()


def _published(tr: TcpTransport, key: str, value: bytes) -> None:
    """Put ``value`` and read it once (the read through Python publishes its copy)."""
    assert tr.write_many([WriteItem(key, 1, memoryview(value), None, "", 1)]) == [None]
    assert _get(tr, key, value) == (None, value)


def _get(tr: TcpTransport, key: str, value: bytes, object_id: int = 0):
    dest = bytearray(len(value))
    item = ReadItem(key, object_id, len(value), value_checksum(value), memoryview(dest))
    (err,) = tr.read_many([item], verify=True)
    return err, bytes(dest)


def test_a_read_copy_is_served_natively_and_counted(node, tr):
    """Counted as it is sent: the node's gets include it by the time the reply is in."""
    values = {f"k{i}": _value(64 * 1024 + i, i) for i in range(4)}
    assert tr.write_many([WriteItem(k, i + 1, memoryview(v), None, "", 1)
                          for i, (k, v) in enumerate(values.items())]) == [None] * 4
    for k, v in values.items():                   # the first read: Python's, published
        assert _get(tr, k, v) == (None, v)
    assert sorted(node.python_reads) == sorted(values)
    gets_before = node.stats().counters["gets"]
    for _ in range(3):
        for k, v in values.items():
            assert _get(tr, k, v) == (None, v)
    assert len(node.python_reads) == 4            # none of the later reads went to Python
    assert node.stats().counters["gets"] - gets_before == 12
    # A pipelined batch: served, unknown (Python's NOT_FOUND), wrong version
    # (Python's), served again: answered in order.
    dests = [bytearray(len(values["k0"])), bytearray(10), bytearray(len(values["k1"])),
             bytearray(len(values["k2"]))]
    items = [ReadItem("k0", 0, len(values["k0"]), value_checksum(values["k0"]),
                      memoryview(dests[0])),
             ReadItem("missing", 0, 10, 0, memoryview(dests[1])),
             ReadItem("k1", 99, len(values["k1"]), value_checksum(values["k1"]),
                      memoryview(dests[2])),
             ReadItem("k2", 0, len(values["k2"]), value_checksum(values["k2"]),
                      memoryview(dests[3]))]
    out = tr.read_many(items, verify=True)
    assert out[0] is None and out[3] is None
    assert out[1].code == pb.NOT_FOUND and out[2].code == pb.NOT_FOUND
    assert bytes(dests[0]) == values["k0"] and bytes(dests[3]) == values["k2"]
    # Only the two Python answers went to Python: the GET after them went back.
    assert node.python_reads[4:] == ["missing", "k1"]
    # A put on the same connection after native gets: the Python loop takes it.
    assert tr.write_many([WriteItem("k9", 9, memoryview(b"late"), None, "", 1)]) == [None]
    node._table.check_invariants(idle=True)


def test_same_host_touches_of_a_served_copy_are_answered_natively(node, tr):
    """SHM_TOUCH (a same-host reader copied the value without the node) of a served
    copy is counted as a read without Python, in order with the GETs around it; a
    touch of another version goes to Python, which counts nothing and answers OK."""
    value = _value(4096, 7)
    _published(tr, "t", value)
    python_touches = []
    touch = node.touch
    node.touch = lambda key, object_id: python_touches.append(key) or touch(key, object_id)
    gets_before = node.stats().counters["gets"]
    conn = tr.conn
    for object_id in (1, 0, 1, 5):
        conn.send(Op.SHM_TOUCH, "t", object_id)
    conn.send(Op.GET, "t", 1)
    answers = [conn.recv_header() for _ in range(5)]
    assert [(code, oid, size) for code, oid, size, *_ in answers[:4]] == [
        (pb.OK, 1, 0), (pb.OK, 0, 0), (pb.OK, 1, 0), (pb.OK, 5, 0)]
    assert answers[4][:3] == (pb.OK, 1, len(value))
    got = bytearray(len(value))
    conn.recv_value_into(len(value), memoryview(got))
    assert got == value
    assert python_touches == ["t"]               # only the other version's touch
    assert node.stats().counters["gets"] - gets_before == 4
    assert node.python_reads == ["t"]            # the first read only


def test_a_fenced_node_serves_nothing_natively(node, tr):
    v = _value(4096, 7)
    _published(tr, "f", v)
    node.tier.lease(time.monotonic() - 1)         # the fence fell: Python decides
    assert _get(tr, "f", v) == (None, v)
    assert node.python_reads == ["f", "f"]
    node.tier.lease(float("inf"))
    assert _get(tr, "f", v) == (None, v)
    assert node.python_reads == ["f", "f"]


def test_a_range_being_sent_is_not_reused_until_the_send_ends(node, tr):
    size = 24 * MiB
    big, other = _value(size, 1), _value(size, 2)
    _published(tr, "big", big)
    # A reader that asks and does not read: the native send stalls on a full socket.
    slow = socket.create_connection(("127.0.0.1", node.port))
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    slow.sendall(NodeConnection._frame(Op.GET, "big"))
    time.sleep(0.3)
    used = node.tier.used_bytes
    assert node.drop("big")                       # freed while being sent: deferred
    assert node.tier.used_bytes == used
    # Other writes must not land in the range under the send.
    assert tr.write_many([WriteItem(f"o{i}", 10 + i, memoryview(other), None, "", 1)
                          for i in range(2)]) == [None, None]
    got = bytearray()
    header = b""
    while len(header) < RESPONSE.size:
        header += slow.recv(RESPONSE.size - len(header))
    code, *_rest = RESPONSE.unpack(header)
    assert code == pb.OK
    while len(got) < size:
        chunk = slow.recv(4 * MiB)
        assert chunk
        got += chunk
    assert bytes(got) == big                      # whole, never overwritten
    slow.close()
    deadline = time.monotonic() + 5
    while node.tier._deferred and time.monotonic() < deadline:   # its send ended
        node.tier.reap()
        time.sleep(0.01)
    assert not node.tier._deferred
    node._table.check_invariants(idle=True)


def test_a_prefetched_copy_read_natively_counts_as_used(node, tr):
    v = _value(8192, 3)
    _published(tr, "p", v)
    before = node.stats().counters
    assert node.prefetch("p", 0, 60_000)
    assert _get(tr, "p", v) == (None, v)          # native: the protection ends as used
    deadline = time.monotonic() + 5               # noted when the connection waits
    while (node.stats().counters["prefetch_used"] == before["prefetch_used"]
           and time.monotonic() < deadline):
        time.sleep(0.01)
    assert node.stats().counters["prefetch_used"] - before["prefetch_used"] == 1
    assert node.python_reads == ["p"]


@pytest.mark.slow
def test_native_answers_stay_right_under_eviction_drops_and_new_versions():
    """Readers on four connections while a writer fills a small DRAM tier (evicting
    what was served) and a dropper drops keys: every answer is its object's bytes
    (each read is verified against the checksum of the value put under that key),
    or NOT_FOUND; nothing is left referenced or reserved afterwards."""
    import threading

    node = StoreNode(DramTier(8 * MiB), start_mover=False)
    server = DataServer(node).start()
    values = {f"s{i}": _value(96 * 1024 + 64 * (i % 7), 100 + i) for i in range(160)}
    keys = list(values)
    stop = threading.Event()
    errors: list[str] = []
    served = [0]

    def transport():
        return TcpTransport(NodeConnection("127.0.0.1", server.port, timeout_s=10))

    def writer():
        tr = transport()
        oid = 1
        while not stop.is_set():
            for k in keys:
                if stop.is_set():
                    break
                oid += 1
                out = tr.write_many([WriteItem(k, oid, memoryview(values[k]), None, "", 1)])
                if out[0] is not None and out[0].code not in (pb.NO_SPACE, pb.KEY_CONFLICT,
                                                              pb.NOT_FOUND):   # dropped midway
                    errors.append(f"put {k}: {out[0]}")
        tr.close()

    def dropper():
        i = 0
        while not stop.is_set():
            node.drop(keys[i % len(keys)])
            i += 7
            time.sleep(0.002)

    def reader(seed: int):
        tr = transport()
        rng = np.random.default_rng(seed)
        while not stop.is_set():
            batch = [keys[j] for j in rng.integers(0, len(keys), 8)]
            dests = [bytearray(len(values[k])) for k in batch]
            items = [ReadItem(k, 0, len(values[k]), value_checksum(values[k]), memoryview(d))
                     for k, d in zip(batch, dests)]
            for k, d, err in zip(batch, dests, tr.read_many(items, verify=True)):
                if err is None:
                    served[0] += 1
                    if bytes(d) != values[k]:
                        errors.append(f"wrong bytes for {k}")
                elif err.code != pb.NOT_FOUND:
                    errors.append(f"get {k}: {err}")
        tr.close()

    threads = [threading.Thread(target=writer), threading.Thread(target=dropper)] + [
        threading.Thread(target=reader, args=(s,)) for s in range(4)]
    try:
        for t in threads:
            t.start()
        time.sleep(6)
        stop.set()
        for t in threads:
            t.join(30)
        assert not errors, errors[:5]
        assert served[0] > 500 and node.tier.serving.gets > 0
        assert node.stats().counters["evictions"] > 0
        node.tier.reap()
        node._table.check_invariants(idle=True)
    finally:
        stop.set()
        server.stop()
        node.close()
