"""Issue 11's attacks on a real cluster with ``--auth``: each refused or ignored.

One master and two store nodes run as processes with a token file; the
nodes hold a ``node`` token, the test's client a ``client`` token. Each
scenario of the issue's first paragraph is tried against them, and the
store's objects read back byte-exact afterwards:

    anonymous RegisterNode               UNAUTHENTICATED, index unchanged
    a live node's id from another process PERMISSION_DENIED (register, heartbeat, events)
    a rogue node (client token, 1 TiB)    PERMISSION_DENIED, gets no puts
    anonymous Remove, client evict        UNAUTHENTICATED / PERMISSION_DENIED
    raw data-port PUT over a live key     KEY_CONFLICT (same id) / refused (new id)
    object straight to a node, master     never indexed, dropped
      restart
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys

import grpc
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVClient
from kvstore.errors import KeyConflict, KVStoreError, NotFound, Unauthenticated
from kvstore.keys import value_checksum
from kvstore.rpc import ClientCredentials, channel
from kvstore.transfer.protocol import Op, local_address
from kvstore.transfer.tcp import NodeConnection
from kvtest import start_secured_cluster, wait_for

TOKENS = {role: f"{role}-{secrets.token_hex(16)}" for role in ("admin", "client", "node")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_secured_cluster(tmp_path_factory.mktemp("security"), TOKENS, nodes=2)
    values = {f"live-{i}": os.urandom(2000 + i) for i in range(40)}
    with KVClient(c.master, token=TOKENS["client"]) as kv:
        for k, v in values.items():
            assert kv.put(k, v)
    c.values = values
    try:
        yield c
    finally:
        c.stop()


def stub(cluster, role: str | None):
    creds = ClientCredentials(token=TOKENS[role]) if role else None
    ch = channel(cluster.master, creds)
    return ch, pb_grpc.MasterStub(ch)


def object_count(cluster) -> int:
    ch, master = stub(cluster, "admin")
    with ch:
        return master.Stat(pb.StatRequest(), timeout=5).num_objects


def assert_intact(cluster, **client_kw) -> None:
    """Every object of the fixture reads back byte-exact (TCP and, same host, shm)."""
    for prefer_shm in (False, True):
        with KVClient(cluster.master, token=TOKENS["client"], prefer_shm=prefer_shm,
                      **client_kw) as kv:
            for k, v in cluster.values.items():
                assert bytes(kv.get(k)) == v, k
    assert object_count(cluster) == len(cluster.values)


def node_info(cluster, node_id: str) -> dict:
    return cluster.nodes[node_id].info


def registration(node_id: str, capacity: int, host: str = "127.0.0.1",
                 port: int = 1) -> pb.RegisterNodeRequest:
    return pb.RegisterNodeRequest(
        address=pb.NodeAddress(node_id=node_id, host=host, data_port=port),
        tier=pb.DRAM, capacity_bytes=capacity, max_object_bytes=capacity,
        incarnation=secrets.token_hex(16))


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value.code()


def test_anonymous_register_node_is_unauthenticated(cluster):
    ch, master = stub(cluster, None)
    with ch:
        assert code_of(lambda: master.RegisterNode(registration("n0", 1 << 30), timeout=5)) \
            is grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: master.Heartbeat(pb.HeartbeatRequest(node_id="n0"), timeout=5)) \
            is grpc.StatusCode.UNAUTHENTICATED
    assert_intact(cluster)


def test_live_node_id_from_another_process_is_refused(cluster):
    ch, master = stub(cluster, "node")       # even with a valid node token
    key = next(iter(cluster.values))
    with ch:
        code = code_of(lambda: master.RegisterNode(registration("n0", 1 << 30), timeout=5))
        assert code is grpc.StatusCode.PERMISSION_DENIED
        assert code_of(lambda: master.Heartbeat(
            pb.HeartbeatRequest(node_id="n0", incarnation="forged"), timeout=5)) \
            is grpc.StatusCode.PERMISSION_DENIED
        evicted = pb.ReplicaEvent(kind=pb.EVICTED, key=key, object_id=1)
        assert code_of(lambda: master.ReportEvents(pb.ReportEventsRequest(
            node_id="n0", incarnation="forged", events=[evicted]), timeout=5)) \
            is grpc.StatusCode.PERMISSION_DENIED
    assert_intact(cluster)


def test_rogue_node_gets_no_puts(cluster):
    for role, expected in ((None, grpc.StatusCode.UNAUTHENTICATED),
                           ("client", grpc.StatusCode.PERMISSION_DENIED)):
        ch, master = stub(cluster, role)
        with ch:
            assert code_of(lambda: master.RegisterNode(registration("rogue", 1 << 40),
                                                       timeout=5)) is expected
    with KVClient(cluster.master, token=TOKENS["client"]) as kv:
        keys = [f"after-rogue-{i}" for i in range(20)]
        for k in keys:
            assert kv.put(k, b"x" * 100)
        placed = {node for m in kv.lookup(keys) for node, _tier in
                  [(r.node.node_id, r.tier) for r in m.replicas]}
        assert placed <= {"n0", "n1"}
        kv.batch_remove(keys)


def test_remove_and_evict_need_credentials_and_roles(cluster, tmp_path):
    key = next(iter(cluster.values))
    ch, master = stub(cluster, None)
    with ch:
        assert code_of(lambda: master.Remove(pb.RemoveRequest(keys=[key]), timeout=5)) \
            is grpc.StatusCode.UNAUTHENTICATED
    ch, master = stub(cluster, "client")
    with ch:
        assert code_of(lambda: master.Remove(pb.RemoveRequest(keys=[key], reason="evict"),
                                             timeout=5)) is grpc.StatusCode.PERMISSION_DENIED
        # A client's List shows its tenants' keys (this token: the default tenant's).
        listed = master.List(pb.ListRequest(limit=1000), timeout=5)
        assert {m.key for m in listed.objects} == set(cluster.values)
    # kvctl, as an operator would: no token, then a client token, then an admin token.
    base = dict(os.environ)
    base.pop("KVSTORE_TOKEN", None)
    kvctl = [sys.executable, "-m", "kvstore.tools.cli.kvctl", "--master", cluster.master]
    anon = subprocess.run([*kvctl, "ls"], env=base, capture_output=True, text=True, timeout=60)
    assert anon.returncode != 0 and "UNAUTHENTICATED" in anon.stderr.upper()
    evict = subprocess.run([*kvctl, "evict", key], env={**base, "KVSTORE_TOKEN": TOKENS["client"]},
                           capture_output=True, text=True, timeout=60)
    assert evict.returncode != 0 and "PERMISSION" in evict.stderr.upper()
    nodes = subprocess.run([*kvctl, "nodes"], env={**base, "KVSTORE_TOKEN": TOKENS["admin"]},
                           capture_output=True, text=True, timeout=60)
    assert nodes.returncode == 0, nodes.stderr
    assert_intact(cluster)


def raw_put(conn: NodeConnection, key: str, object_id: int, data: bytes) -> None:
    conn.call(Op.PUT, key, object_id, len(data), value_checksum(data), memoryview(data))


def test_raw_data_port_put_over_a_live_key_is_refused(cluster):
    key, value = next(iter(cluster.values.items()))
    with KVClient(cluster.master, token=TOKENS["client"]) as kv:
        meta = kv.lookup([key])[0]
    owner = meta.replicas[0].node
    forged = b"F" * len(value)
    # Anonymous: refused before any PUT, over TCP and over the same-host Unix socket.
    for unix in (None, local_address(owner.shm_name)):
        conn = NodeConnection(owner.host, owner.data_port, unix_address=unix)
        with pytest.raises(Unauthenticated):
            raw_put(conn, key, meta.object_id, forged)
        conn.close()
    conn = NodeConnection(owner.host, owner.data_port, token=TOKENS["client"])
    try:
        with pytest.raises(KeyConflict):                     # its object id: committed bytes
            raw_put(conn, key, meta.object_id, forged)
        with pytest.raises(KVStoreError):                    # a new id: staged, then refused
            raw_put(conn, key, meta.object_id + 1_000_000, forged)
    finally:
        conn.close()
    assert_intact(cluster)


def test_object_written_straight_to_a_node_never_becomes_visible(cluster):
    with KVClient(cluster.master, token=TOKENS["client"]) as kv:
        target = kv.lookup([next(iter(cluster.values))])[0].replicas[0].node
    conn = NodeConnection(target.host, target.data_port, token=TOKENS["client"])
    try:
        with pytest.raises(NotFound):                        # the master refuses it at once
            raw_put(conn, "smuggled-now", 1 << 60, b"s" * 500)
        # With the master down the write cannot be confirmed: kept, unconfirmed ...
        master = cluster.shards[0][0]
        master.proc.kill()
        master.proc.wait()
        with pytest.raises(KVStoreError):
            raw_put(conn, "smuggled-later", (1 << 60) + 1, b"s" * 500)
    finally:
        conn.close()
    # ... and a restarted master (empty index) rebuilds from the nodes' inventories:
    # the confirmed objects come back, the smuggled ones never do.
    cluster.restart_master(0)
    wait_for(lambda: _count_or_zero(cluster) == len(cluster.values), timeout_s=20,
             interval_s=0.2)
    with KVClient(cluster.master, token=TOKENS["client"]) as kv:
        for k in ("smuggled-now", "smuggled-later"):
            assert not kv.exists(k)
            with pytest.raises(NotFound):
                kv.get(k)
    assert_intact(cluster)
    # The nodes dropped them too (the replayed STORED event was refused).
    wait_for(lambda: held_objects(cluster) == len(cluster.values), timeout_s=10)


def held_objects(cluster) -> int:
    """Objects the nodes hold, from their own stats."""
    with KVClient(cluster.master, token=TOKENS["admin"]) as kv:
        return sum(s["tiers"][0]["num_objects"] for s in kv.node_stats().values())


def _count_or_zero(cluster) -> int:
    try:
        return object_count(cluster)
    except grpc.RpcError:
        return 0


def test_sighup_reloads_the_token_file(cluster):
    """Run last: it rotates the client token of every server."""
    old = TOKENS["client"]
    new = f"client-{secrets.token_hex(16)}"
    text = cluster.auth_file.read_text().replace(old, new)
    cluster.auth_file.write_text(text)
    for child in [*cluster.shards[0], *cluster.nodes.values()]:
        child.proc.send_signal(signal.SIGHUP)
    key, value = next(iter(cluster.values.items()))

    def rotated() -> bool:
        try:
            with KVClient(cluster.master, token=new, prefer_shm=False) as kv:
                return bytes(kv.get(key)) == value
        except KVStoreError:
            return False
    wait_for(rotated, timeout_s=10)
    with pytest.raises(Unauthenticated):
        with KVClient(cluster.master, token=old, prefer_shm=False) as kv:
            kv.get(key)
    TOKENS["client"] = new
    assert_intact(cluster)
