"""A store node's data port checks each op's key against the tenants of the
connection's token (kvstore.store.session): a raw frame cannot cross tenants.

One node (no master: writes resolve at once) serves a DataServer with a token
file binding tenant A's and B's client tokens; B's connection asks for A's
keys with every op. Reads answer as for a key the node does not hold, writes
are refused, and a reload of the file applies to open connections. A metrics
token reads and writes no object, and STATS (the node's store-wide figures)
answers admin and node tokens only.
"""

from __future__ import annotations

import json

import pytest

from kvstore.auth import TokenFile
from kvstore.errors import NotFound, PermissionDenied
from kvstore.keys import value_checksum
from kvstore.store.data_server import DataServer
from kvstore.store.node import StoreNode
from kvstore.store.tiers.dram import DramTier
from kvstore.transfer.protocol import Op
from kvstore.transfer.tcp import NodeConnection

MiB = 1 << 20
TOK_A, TOK_B, TOK_N, TOK_M, TOK_X = "a" * 32, "b" * 32, "n" * 32, "m" * 32, "x" * 32


def auth_text(b_tenants: str = "beta", b_role: str = "client") -> str:
    return (f"client {TOK_A} tenants=alpha\n{b_role} {TOK_B} tenants={b_tenants}\n"
            f"node {TOK_N}\nmetrics {TOK_M} tenants=alpha\nadmin {TOK_X}\n")


@pytest.fixture
def node(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(auth_text())
    tokens = TokenFile(str(path))
    store = StoreNode(DramTier(16 * MiB))
    server = DataServer(store, tokens=tokens).start()
    server.auth_path = path
    server.token_file = tokens
    try:
        yield server
    finally:
        server.stop()
        store.close()


def put(conn: NodeConnection, key: str, object_id: int, data: bytes) -> None:
    conn.call(Op.PUT, key, object_id, len(data), value_checksum(data), memoryview(data))


def get(conn: NodeConnection, key: str, object_id: int = 0) -> int:
    """A raw GET: the value's size (its bytes are read and dropped)."""
    size = conn.call(Op.GET, key, object_id)[1]
    conn.recv_value_into(size, memoryview(bytearray(size)))
    return size


def connect(server, token: str) -> NodeConnection:
    return NodeConnection("127.0.0.1", server.port, timeout_s=5, token=token)


def test_raw_frames_cannot_cross_tenants(node):
    a, b = connect(node, TOK_A), connect(node, TOK_B)
    try:
        put(a, "@alpha/k", 1, b"A" * 100)
        put(b, "@beta/k", 2, b"B" * 100)
        # B's reads of A's key: the node's answer for a key it does not hold.
        with pytest.raises(NotFound) as missing:
            get(b, "@alpha/never")
        for op in (Op.GET, Op.SHM_ACQUIRE, Op.PIN, Op.UNPIN, Op.PREFETCH):
            with pytest.raises(NotFound) as hidden:
                b.call(op, "@alpha/k", 0, 1000 if op is Op.PREFETCH else 0)
            assert hidden.value.message == "not on this node" == \
                (missing.value.message if op is Op.GET else hidden.value.message)
        # B's writes of A's key (existing or not) are refused; its bytes are skipped.
        for key in ("@alpha/k", "@alpha/new", "plain-default-key"):
            with pytest.raises(PermissionDenied):
                put(b, key, 10, b"X" * 5000)
            with pytest.raises(PermissionDenied):
                b.call(Op.SHM_ALLOC, key, 11, 100, 0)
        # DROP and SHM_TOUCH of A's key: OK, and nothing happens to it.
        b.call(Op.DROP, "@alpha/k", 1)
        b.call(Op.SHM_TOUCH, "@alpha/k", 1)
        assert get(a, "@alpha/k") == 100
        # The connection still works for B's own keys, and A's for A's.
        assert get(b, "@beta/k") == 100
        with pytest.raises(NotFound):
            get(a, "@beta/k")
    finally:
        a.close()
        b.close()


def test_a_node_token_sees_every_tenant(node):
    a, n = connect(node, TOK_A), connect(node, TOK_N)
    try:
        put(a, "@alpha/k", 1, b"A" * 10)
        assert get(n, "@alpha/k") == 10
    finally:
        a.close()
        n.close()


def test_a_reload_applies_to_open_connections(node):
    a, b = connect(node, TOK_A), connect(node, TOK_B)
    try:
        put(a, "@alpha/k", 1, b"A" * 10)
        with pytest.raises(NotFound):
            get(b, "@alpha/k")
        node.auth_path.write_text(auth_text("beta,alpha"))
        assert node.token_file.reload()
        assert get(b, "@alpha/k") == 10                  # the same connection, widened
        node.auth_path.write_text(f"client {TOK_A} tenants=alpha\nnode {TOK_N}\n")
        assert node.token_file.reload()
        with pytest.raises(NotFound):                     # B's token is gone: no key
            get(b, "@alpha/k")
        with pytest.raises(PermissionDenied):
            put(b, "@beta/x", 5, b"x")
    finally:
        a.close()
        b.close()


def stats(conn: NodeConnection) -> dict:
    size = conn.call(Op.STATS, "")[1]
    buf = bytearray(size)
    conn.recv_value_into(size, memoryview(buf))
    return json.loads(buf)


def test_a_metrics_token_reads_and_writes_no_object(node):
    a, m = connect(node, TOK_A), connect(node, TOK_M)
    try:
        put(a, "@alpha/k", 1, b"A" * 100)
        denied = set()
        for key in ("@alpha/k", "@alpha/never"):     # its own tenant's keys, existing or not
            for op, size in ((Op.GET, 0), (Op.SHM_ACQUIRE, 0), (Op.PIN, 0), (Op.UNPIN, 0),
                             (Op.PREFETCH, 1000), (Op.SHM_ALLOC, 100), (Op.DROP, 0),
                             (Op.SHM_TOUCH, 0)):
                with pytest.raises(PermissionDenied) as err:
                    m.call(op, key, 1, size)
                denied.add(err.value.message)
            with pytest.raises(PermissionDenied) as err:
                put(m, key, 7, b"M" * 5000)             # its bytes are skipped
            denied.add(err.value.message)
        assert len(denied) == 1 and "metrics token" in denied.pop()   # says nothing of keys
        with pytest.raises(PermissionDenied):
            stats(m)
        m.call(Op.PING, "")                            # the connection still works
        assert get(a, "@alpha/k") == 100               # nothing happened to the object
    finally:
        a.close()
        m.close()


def test_stats_answer_admin_and_node_tokens_only(node):
    a, n, x = connect(node, TOK_A), connect(node, TOK_N), connect(node, TOK_X)
    try:
        put(a, "@alpha/k", 1, b"A" * 100)
        with pytest.raises(PermissionDenied):
            stats(a)                                   # a scoped client token
        assert get(a, "@alpha/k") == 100               # ... whose connection goes on
        assert stats(n)["num_objects"] == 1 == stats(x)["num_objects"]
    finally:
        a.close()
        n.close()
        x.close()


def test_a_reload_that_makes_a_client_token_a_metrics_one_ends_its_object_ops(node):
    b = connect(node, TOK_B)
    try:
        put(b, "@beta/k", 1, b"B" * 10)
        node.auth_path.write_text(auth_text(b_role="metrics"))
        assert node.token_file.reload()
        with pytest.raises(PermissionDenied):
            get(b, "@beta/k")
    finally:
        b.close()


def test_native_gets_follow_the_token_and_its_reloads(node):
    """The native GET service (kvstore/store/native_gets.py) answers only a connection
    that may read every key (the admin token here), and a reload that takes the
    token away reaches a GET the native service would have answered."""
    admin, a = connect(node, TOK_X), connect(node, TOK_A)
    serving = node.node.tier.serving
    try:
        put(admin, "@alpha/n", 1, b"N" * 100)
        assert get(admin, "@alpha/n") == 100          # through Python: published
        before = serving.gets
        assert get(admin, "@alpha/n") == 100 and get(admin, "@alpha/n") == 100
        assert serving.gets == before + 2             # answered natively
        assert get(a, "@alpha/n") == 100              # a tenant's token: Python's loop
        assert serving.gets == before + 2
        node.auth_path.write_text(auth_text().replace(f"admin {TOK_X}\n", ""))
        assert node.token_file.reload()
        with pytest.raises(NotFound):                 # checked again: the token is gone
            get(admin, "@alpha/n")
        assert serving.gets == before + 2
    finally:
        admin.close()
        a.close()
