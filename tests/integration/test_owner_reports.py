"""The node that holds the bytes makes an object visible (issue: the owner of the bytes reports).

A node acknowledges a write only once its master shard applied the node's
STORED event, so a returned put is visible to every reader at once; a write
the master never placed is refused and dropped; a write whose master does
not answer fails with Unavailable and its event stays queued.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client import KVClient, NotFound
from kvstore.keys import value_checksum
from kvstore.transfer.protocol import Op
from kvstore.transfer.tcp import NodeConnection
from kvtest import cluster_running, wait_for


@pytest.fixture(scope="module")
def owner(tmp_path_factory):
    with cluster_running(str(tmp_path_factory.mktemp("owner-logs")), num_nodes=1) as running:
        yield running


def node_conn(cluster) -> NodeConnection:
    host, port = cluster.nodes["n0"].address.rsplit(":", 1)
    return NodeConnection(host, int(port), timeout_s=10)


def granted_id(master: str, key: str) -> int:
    """An object id of a fresh placement grant for ``key`` (as the SDK places a put)."""
    with grpc.insecure_channel(master) as ch:
        g = pb_grpc.MasterStub(ch).GrantPlacement(pb.GrantPlacementRequest(num_ids=1, key=key),
                                                  timeout=5)
    return g.first_object_id


def test_a_returned_put_is_visible_to_every_other_reader(owner, transport):
    with KVClient(owner.master, prefer_shm=transport == "shm") as writer, \
            KVClient(owner.master, meta_cache_entries=0) as reader:
        keys = [f"vis-{transport}/{i}" for i in range(40)]
        for i, k in enumerate(keys):
            assert writer.put(k, b"v%d" % i) is True
            assert reader.batch_exists([k]) == [True]         # no wait, no retry
            assert reader.get(k) == b"v%d" % i
        assert writer.batch_put([k + "/b" for k in keys], [b"x"] * len(keys)) == [None] * len(keys)
        assert all(reader.batch_exists([k + "/b" for k in keys]))


def test_a_write_the_master_never_placed_is_refused_and_dropped(owner):
    conn = node_conn(owner)
    try:
        value = b"forged"
        conn.send(Op.PUT, "forged/k", 999_999_999, len(value), value_checksum(value),
                  memoryview(value))
        code, *_rest, msg = conn.recv_header()
        assert code == pb.NOT_FOUND, msg
        conn.send(Op.GET, "forged/k", 999_999_999)
        code, *_ = conn.recv_header()
        assert code == pb.NOT_FOUND                        # the node dropped it
    finally:
        conn.close()
    with KVClient(owner.master) as kv:
        assert kv.batch_exists(["forged/k"]) == [False]
        with pytest.raises(NotFound):
            kv.get("forged/k")


def test_a_write_whose_master_is_stopped_fails_then_lands_when_it_returns(owner):
    value = b"late" * 100
    oid = granted_id(owner.master, "late/k")
    master = owner.procs.child("master0").proc
    conn = node_conn(owner)
    os.kill(master.pid, signal.SIGSTOP)
    try:
        conn.send(Op.PUT, "late/k", oid, len(value), value_checksum(value), memoryview(value))
        code, *_rest, msg = conn.recv_header()       # within the connection's 10 s
        # Bounded: the node gave up at its ack timeout, and says so.
        assert code == pb.UNAVAILABLE and "did not confirm" in msg, msg
    finally:
        os.kill(master.pid, signal.SIGCONT)
        conn.close()
    # The STORED event stayed queued (at least once): the put lands after all.
    with KVClient(owner.master, meta_cache_entries=0) as kv:
        wait_for(lambda: kv.batch_exists(["late/k"]) == [True], timeout_s=10)
        assert kv.get("late/k") == value


def test_a_node_not_linked_to_a_master_acknowledges_no_write():
    """Before its agents register and after they stop, a node fails writes as unconfirmed."""
    from kvstore.store.agent import no_master_yet
    from kvstore.store.data_server import DataServer
    from kvstore.store.node import StoreNode
    from kvstore.store.tiers.dram import DramTier

    tier = DramTier(1 << 20)
    node = StoreNode(tier)
    node.events.set_delivery(no_master_yet)
    server = DataServer(node, ack_timeout_s=0.3).start()
    conn = NodeConnection("127.0.0.1", server.port, timeout_s=5)
    try:
        value = b"unconfirmed"
        t0 = time.monotonic()
        conn.send(Op.PUT, "orphan/k", 7, len(value), value_checksum(value), memoryview(value))
        code, *_rest, msg = conn.recv_header()
        assert code == pb.UNAVAILABLE and "did not confirm" in msg
        assert time.monotonic() - t0 > 0.25          # it waited for the 0.3 s ack timeout
    finally:
        conn.close()
        server.stop()
        node.close()
