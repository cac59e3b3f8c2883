"""A store node's TCP PUT hashes a large value piece by piece as it arrives
(FrameReader.read_into_hashed: natively, GIL released): the bytes are still verified before
anything is stored, a pipelined batch around such a value keeps its frames, and
a value sent in dribbles hashes to the same checksum."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np

from kvstore._proto import kvstore_pb2 as pb
from kvstore.keys import value_checksum
from kvstore.store.data_server import DataServer
from kvstore.store.node import StoreNode
from kvstore.store.tiers.dram import DramTier
from kvstore.transfer.base import WriteItem
from kvstore.transfer.protocol import FrameReader
from kvstore.transfer.tcp import NodeConnection, TcpTransport

MiB = 1 << 20


def _value(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_hashing_while_receiving_matches_the_checksum_of_the_value():
    a, b = socket.socketpair()
    value = _value(3 * MiB + 5, 1)
    tail = b"next-frame"

    def dribble():                      # a header's worth first, then uneven pieces
        a.sendall(value[:100])
        for off in range(100, len(value), 700_001):
            a.sendall(value[off:off + 700_001])
            time.sleep(0.001)           # pacing: the pieces arrive apart
        a.sendall(tail)
    th = threading.Thread(target=dribble)
    th.start()
    try:
        reader = FrameReader(b)
        reader.read(10)                 # buffered bytes of the value count too
        dest = bytearray(len(value) - 10)
        assert reader.read_into_hashed(memoryview(dest)) == value_checksum(value[10:])
        assert bytes(dest) == value[10:]
        assert bytes(reader.read(len(tail))) == tail
    finally:
        th.join()
        a.close()
        b.close()


def test_a_large_put_with_other_bytes_than_announced_is_refused_and_leaves_nothing():
    node = StoreNode(DramTier(64 * MiB))          # no master: tickets resolve at once
    server = DataServer(node).start()
    tr = TcpTransport(NodeConnection("127.0.0.1", server.port, timeout_s=5))
    try:
        good, bad = _value(2 * MiB, 2), bytearray(_value(2 * MiB, 3))
        announced = value_checksum(bytes(bad))
        bad[MiB + 3] ^= 0xFF                       # one byte differs from what was hashed
        small = b"after the big ones"
        out = tr.write_many([
            WriteItem("big/good", 1, memoryview(good), value_checksum(good), "", 1),
            WriteItem("big/bad", 2, memoryview(bad), announced, "", 1),
            WriteItem("small", 3, memoryview(small), value_checksum(small), "", 1)])
        assert out[0] is None and out[2] is None
        assert out[1] is not None and out[1].code == pb.CHECKSUM_MISMATCH
        held = {k for k, *_ in node.inventory()}
        assert held == {"big/good", "small"}
        stats = node.stats()
        assert stats.num_writing == 0 and stats.used_bytes < 4 * MiB + (1 << 16)
        assert stats.counters["checksum_errors"] == 1
    finally:
        tr.close()
        server.stop()
        node.close()


def test_over_tls_large_values_are_hashed_by_the_python_receive(tmp_path):
    """A TLS socket has no file descriptor to receive from natively: its large PUT
    and GET values go through FrameReader's Python branch (hashed piece by piece
    with the native streaming hasher), with the same verdicts as plain TCP."""
    from kvstore.tls import TlsFiles, client_context, server_context
    from kvstore.tools.cluster.certs import make_certs
    from kvstore.transfer.base import ReadItem

    certs = make_certs(tmp_path / "certs", ["127.0.0.1"])
    node = StoreNode(DramTier(64 * MiB))
    server = DataServer(node, tls=server_context(
        TlsFiles(str(certs.server_cert), str(certs.server_key)))).start()
    conn = NodeConnection("127.0.0.1", server.port, timeout_s=5,
                          tls=client_context(TlsFiles(ca=str(certs.ca))))
    tr = TcpTransport(conn)
    try:
        good, bad = _value(3 * MiB + 1, 4), bytearray(_value(MiB, 5))
        announced = value_checksum(bytes(bad))
        bad[7] ^= 1
        out = tr.write_many([
            WriteItem("tls/good", 1, memoryview(good), None, "", 1),
            WriteItem("tls/bad", 2, memoryview(bad), announced, "", 1)])
        assert out[0] is None
        assert out[1] is not None and out[1].code == pb.CHECKSUM_MISMATCH
        dest = bytearray(len(good))
        item = ReadItem("tls/good", 1, len(good), value_checksum(good), memoryview(dest))
        assert tr.read_many([item], verify=True) == [None] and dest == good
        item = ReadItem("tls/good", 1, len(good), value_checksum(good) ^ 1,
                        memoryview(bytearray(len(good))))
        (err,) = tr.read_many([item], verify=True)
        assert err is not None and err.code == pb.CHECKSUM_MISMATCH
    finally:
        tr.close()
        server.stop()
        node.close()


def test_asyncio_values_over_tls_go_through_the_transport(tmp_path):
    """The asyncio connection sends a plain connection's values in one gathered send on
    its socket; over TLS they must go through the transport (a send on the socket would
    bypass the encryption): a large put and its get come back whole."""
    import asyncio

    from kvstore.tls import TlsFiles, client_context, server_context
    from kvstore.tools.cluster.certs import make_certs
    from kvstore.transfer.aio_tcp import AsyncNodeConnection
    from kvstore.transfer.protocol import Op

    certs = make_certs(tmp_path / "certs", ["127.0.0.1"])
    node = StoreNode(DramTier(64 * MiB))
    server = DataServer(node, tls=server_context(
        TlsFiles(str(certs.server_cert), str(certs.server_key)))).start()
    value = _value(2 * MiB + 3, 6)

    async def go():
        conn = await AsyncNodeConnection.open("127.0.0.1", server.port, timeout_s=5,
                                              tls=client_context(TlsFiles(ca=str(certs.ca))))
        try:
            put = await conn.request(Op.PUT, "tls/async", 1, len(value), value_checksum(value),
                                     payload=value)
            assert put.code == pb.OK
            got = await conn.request(Op.GET, "tls/async", 1, max_value_bytes=len(value))
            assert got.code == pb.OK and bytes(got.value) == value
        finally:
            conn.close()
    try:
        asyncio.run(go())
    finally:
        server.stop()
        node.close()
