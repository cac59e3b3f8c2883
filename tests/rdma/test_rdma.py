"""The RDMA transport on a real RDMA device (marked ``rdma``; skipped without one).

Needs pyverbs (``pip install -e '.[rdma]'`` or Debian's ``python3-pyverbs``)
and a device named by ``KVSTORE_RDMA_DEVICE``. Without a NIC, soft-RoCE
works where the kernel allows it (root, ``rdma_rxe`` module; containers
usually do not)::

    sudo modprobe rdma_rxe
    sudo rdma link add rxe0 type rxe netdev lo     # or an Ethernet/veth netdev if lo is refused
    rdma link show; ibv_devices                    # rxe0 is there
    ulimit -l unlimited                            # memory registration pins pages
    KVSTORE_RDMA_DEVICE=rxe0 pytest -m rdma tests/rdma

Optional: ``KVSTORE_RDMA_PORT`` (default 1), ``KVSTORE_RDMA_GID_INDEX``
(default: the port's first non-zero GID). The pure parts (descriptors,
chunk plans) are tested without hardware in ``tests/unit/test_rdma_wire.py``.

The node side is the data server's own mount (``DataServer(rdma=...)``,
what ``kvstore node --rdma-device`` starts); a cluster whose nodes and
clients name a device (``KVClient(rdma_device=...)``) uses it for every node
that shared memory does not reach.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

from kvstore.errors import NotFound, Unavailable
from kvstore.keys import value_checksum
from kvstore.store.data_server import DataServer
from kvstore.store.node import StoreNode
from kvstore.store.tiers.dram import DramTier
from kvstore.transfer.base import ReadItem, WriteItem
from kvstore.transfer.rdma import RdmaNodeEndpoint, RdmaTransport
from kvstore.transfer.rdma_wire import QpDescriptor, decode_connect_reply
from kvstore.transfer.tcp import NodeConnection
from kvstore.transfer.verbs import RdmaDevice

DEVICE = os.environ.get("KVSTORE_RDMA_DEVICE", "")
PORT = int(os.environ.get("KVSTORE_RDMA_PORT", "1"))
GID_INDEX = int(os.environ["KVSTORE_RDMA_GID_INDEX"]) if os.environ.get("KVSTORE_RDMA_GID_INDEX") \
    else None

pytestmark = [
    pytest.mark.rdma,
    pytest.mark.skipif(not DEVICE, reason="set KVSTORE_RDMA_DEVICE to an RDMA device (e.g. rxe0)"),
    pytest.mark.skipif(importlib.util.find_spec("pyverbs") is None, reason="pyverbs not installed"),
]

MiB = 1024 * 1024


@pytest.fixture
def node():
    n = StoreNode(DramTier(16 * MiB), policy="none")
    yield n
    n.close()


@pytest.fixture
def endpoint(node):
    ep = RdmaNodeEndpoint(DEVICE, node.tier.segment.view, port=PORT, gid_index=GID_INDEX)
    yield ep
    ep.close()


@pytest.fixture
def rdma_node(node, endpoint):
    """(host, port) of the node's own data server with RDMA mounted."""
    server = DataServer(node, rdma=endpoint).start()
    yield (server.host, server.port)
    server.stop()


def _transport(address, **kwargs) -> RdmaTransport:
    return RdmaTransport(NodeConnection(*address), DEVICE, port=PORT, gid_index=GID_INDEX,
                         **kwargs)


def _value(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_queue_pairs_connect_and_move_bytes_both_ways(node, endpoint):
    """Client QP <-> node QP in one process: WRITE into the segment, READ it back."""
    dev = RdmaDevice(DEVICE, PORT, GID_INDEX)
    qp = dev.queue_pair(8)
    buf = bytearray(_value(4096, 1))
    mr = dev.register(memoryview(buf), remote=False)
    try:
        peer, reply = endpoint.accept(qp.descriptor().encode())
        node_qp, region = decode_connect_reply(reply)
        assert isinstance(node_qp, QpDescriptor) and region.length == len(node.tier.segment.view)
        qp.connect(node_qp)
        addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
        assert qp.run([(True, addr, mr.lkey, 4096, region.remote_address(8192, 4096),
                        region.rkey)], 10.0) == [True]
        assert bytes(node.tier.segment.view[8192:8192 + 4096]) == bytes(buf)
        node.tier.segment.view[8192:8192 + 16] = b"\xab" * 16
        assert qp.run([(False, addr, mr.lkey, 4096, region.remote_address(8192, 4096),
                        region.rkey)], 10.0) == [True]
        assert bytes(buf[:16]) == b"\xab" * 16
        peer.close()
    finally:
        qp.close()
        mr.close()
        dev.close()


@pytest.mark.parametrize("staging_bytes", [32 * MiB, 64 * 1024])   # roomy, and values split
def test_transport_puts_and_gets_through_the_node(rdma_node, node, staging_bytes):
    tr = _transport(rdma_node, staging_bytes=staging_bytes)
    try:
        values = [_value(n, i) for i, n in enumerate([32768, 0, 1, 200_000, 32768])]
        items = [WriteItem(f"k{i}", 100 + i, memoryview(v), value_checksum(v), "")
                 for i, v in enumerate(values)]
        assert tr.write_many(items) == [None] * len(items)
        assert tr.write_many(items[:1]) == [None]          # already present: no write
        for i, v in enumerate(values):
            obj = node.acquire(f"k{i}")
            try:
                assert bytes(node.read_view(obj)) == v
            finally:
                node.release(obj)
        dests = [bytearray(len(v)) for v in values]
        reads = [ReadItem(f"k{i}", 100 + i, len(v), value_checksum(v), memoryview(d))
                 for i, (v, d) in enumerate(zip(values, dests))]
        assert tr.read_many(reads) == [None] * len(reads)
        assert [bytes(d) for d in dests] == values
        missing = tr.read_many([ReadItem("nope", 0, 1, 0, memoryview(bytearray(1)))])
        assert isinstance(missing[0], NotFound)
        assert not tr.conn.broken
    finally:
        tr.close()


def test_registered_buffers_skip_the_staging_copy(rdma_node):
    tr = _transport(rdma_node, staging_bytes=4096)   # far too small: zero copy must bypass it
    try:
        src = np.frombuffer(_value(1 * MiB, 7), dtype=np.uint8).copy()
        dst = np.zeros_like(src)
        tr.register(src)
        tr.register(dst)
        ck = value_checksum(memoryview(src))
        assert tr.write_many([WriteItem("big", 1, memoryview(src), ck, "")]) == [None]
        assert tr.read_many([ReadItem("big", 1, src.nbytes, ck, memoryview(dst))]) == [None]
        assert np.array_equal(src, dst)
        tr.unregister(src)
        tr.unregister(dst)
    finally:
        tr.close()


def test_a_node_without_rdma_is_unavailable(node):
    server = DataServer(node).start()
    try:
        with pytest.raises(Unavailable, match="does not serve RDMA"):
            _transport((server.host, server.port))
    finally:
        server.stop()
