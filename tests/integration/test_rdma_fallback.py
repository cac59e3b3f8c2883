"""RDMA where it cannot work (no pyverbs, no device, node without --rdma-device).

What runs everywhere: a node started without RDMA answers RDMA_CONNECT with
UNAVAILABLE and keeps the connection usable; a client that names an RDMA
device it cannot open reads and writes over TCP instead; a node asked for a
device it cannot open stops at start with one line. The data path over a
real device is in tests/rdma (marked ``rdma``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstore.client import KVClient
from kvstore._proto import kvstore_pb2 as pb
from kvstore.transfer.protocol import Op
from kvstore.transfer.rdma_wire import OP_RDMA_CONNECT
from kvstore.transfer.tcp import NodeConnection, TcpTransport
from kvstore.tools.cluster.processes import service_args
from kvtest import cluster_running


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with cluster_running(str(tmp_path_factory.mktemp("rdma-fallback-logs")), num_nodes=1,
                         dram="16MiB") as running:
        yield running


def test_node_without_rdma_refuses_the_op_and_keeps_the_connection(cluster):
    with KVClient(cluster.master, prefer_shm=False) as kv:
        kv.put("r", b"value")
        (meta,) = kv.lookup(["r"])
        node = meta.replicas[0].node
    conn = NodeConnection(node.host, node.data_port)
    try:
        conn.send(OP_RDMA_CONNECT, "", size=36, payload=memoryview(bytes(36)))
        code, *_rest, msg = conn.recv_header()
        assert code == pb.UNAVAILABLE and "--rdma-device" in msg
        conn.call(Op.PING, "")                     # the stream is still in step
    finally:
        conn.close()


def test_client_with_an_unusable_device_uses_tcp(cluster):
    with KVClient(cluster.master, prefer_shm=False, rdma_device="no-such-dev0") as kv:
        kv.put("r2", b"x" * 4096)
        assert bytes(kv.get("r2")) == b"x" * 4096
        assert all(isinstance(tr, TcpTransport)
                   for tr in kv._connections._local.transports.map.values())


def test_node_with_an_unusable_device_stops_with_one_line(cluster):
    p = subprocess.run([sys.executable, *service_args("node"), "--master", cluster.master,
                        "--dram", "1MiB", "--rdma-device", "no-such-dev0"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert p.stderr.strip().splitlines()[-1].startswith("kvstore node: --rdma-device no-such-dev0")
