"""Clients' Lookup, Exists and GrantPlacement on the master's socket port
(kvstore.transfer.call_link, kvstore.master.call_port), on a real master with
``--auth`` and tenants.

Both SDKs learn the port from a gRPC answer and send the next calls there
(the master's ``port_calls`` counter); what they get is what gRPC gives: the
same metadata, NotFound for a missing key and for another tenant's, an Exists
that hides other tenants' keys, puts that take their grants there. Raw
connections: a metrics token's calls are refused per call (the link stays),
as are an unknown method, an undecodable request and too many keys; a link
that breaks sends the next call through gRPC.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket

import grpc
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import proof
from kvstore.client.aio import AsyncKVClient
from kvstore.client.client import KVClient
from kvstore.errors import NotFound
from kvstore.tools.cluster.launcher import start_store_cluster
from kvstore.transfer.call_link import CALL_METHODS, error_of_failed
from kvstore.transfer.report_link import HEADER, Frame, frame

ADMIN, ACME, METRICS, NODE = (secrets.token_hex(16) for _ in range(4))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("call-port")
    auth = tmp / "tokens"
    auth.write_text(f"admin {ADMIN}\nclient {ACME} tenants=acme\nmetrics {METRICS}\n"
                    f"node {NODE}\n")
    c = start_store_cluster(nodes=1, log_dir=str(tmp), master_args=("--auth", str(auth)),
                            node_args=("--auth", str(auth)), env={"KVSTORE_TOKEN": NODE})
    try:
        yield c
    finally:
        c.stop()


def port_calls(kv: KVClient) -> int:
    (shard,) = kv.stat()
    return shard.counters.get("port_calls", 0)


def port(cluster) -> int:
    return cluster.shards[0][0].info["report_port"]


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while len(data) < HEADER.size:
        data += sock.recv(HEADER.size - len(data))
    kind, length = HEADER.unpack(data)
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        assert chunk, "closed"
        body += chunk
    return kind, body


def proven(cluster, token: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port(cluster)), timeout=5)
    kind, nonce = recv_frame(sock)
    assert kind == Frame.HELLO
    sock.sendall(frame(Frame.PROVE, proof(token, nonce)))
    return sock


def test_sync_calls_take_the_port(cluster):
    with KVClient(cluster.master, token=ADMIN) as admin, \
            KVClient(cluster.master, token=ACME) as acme:
        admin.put("plain-1", b"a" * 100)
        acme.put("@acme/one", b"b" * 200)
        before = port_calls(admin)
        metas = [admin.lookup(["plain-1", "@acme/one"]) for _ in range(3)]
        assert port_calls(admin) >= before + 2      # the first may have named the port
        assert [(m.key, m.size_bytes, m.checksum, m.object_id) for m in metas[0]] == \
            [(m.key, m.size_bytes, m.checksum, m.object_id) for m in metas[2]]
        assert [m.size_bytes for m in metas[2]] == [100, 200]
        acme.lookup(["@acme/one"])
        # Another tenant's key and a missing one: NotFound, as on gRPC.
        assert isinstance(acme.lookup(["plain-1"])[0], NotFound)
        assert isinstance(admin.lookup(["never-put"])[0], NotFound)
        assert acme.batch_exists(["@acme/one", "plain-1"]) == [True, False]
        # Puts take their grants on the port too; the values read back whole.
        values = {f"@acme/v{i}": secrets.token_bytes(1000 + i) for i in range(40)}
        for k, v in values.items():
            acme.put(k, v)
        for k, v in values.items():
            assert bytes(acme.get(k)) == v
        assert acme._control._links, "the SDK never learned the port"


def test_async_calls_take_the_port(cluster):
    async def main():
        async with AsyncKVClient(cluster.master, token=ACME) as kv:
            await kv.put("@acme/async", b"c" * 300)
            for _ in range(3):
                (meta,) = await kv.lookup(["@acme/async"])
            assert meta.size_bytes == 300
            assert kv._links, "the SDK never learned the port"
            many = await asyncio.gather(*(kv.lookup([f"@acme/none-{i}"]) for i in range(20)))
            assert all(isinstance(r[0], NotFound) for r in many)
            assert await kv.batch_exists(["@acme/async", "plain-1"]) == [True, False]
            # A link that breaks: the next call goes through gRPC and learns it again.
            (await kv._links[next(iter(kv._links))]).transport.abort()
            await asyncio.sleep(0.05)
            (meta,) = await kv.lookup(["@acme/async"])
            assert meta.size_bytes == 300
    with KVClient(cluster.master, token=ADMIN) as admin:
        before = port_calls(admin)
        asyncio.run(main())
        assert port_calls(admin) >= before + 20


def test_a_broken_sync_link_falls_back(cluster):
    with KVClient(cluster.master, token=ADMIN) as kv:
        kv.put("fallback", b"f" * 50)
        kv.lookup(["fallback"])
        (link,) = kv._control._links.values()
        link._sock.shutdown(socket.SHUT_RDWR)          # the link breaks under the SDK
        assert kv.lookup(["fallback"])[0].size_bytes == 50
        assert kv.lookup(["fallback"])[0].size_bytes == 50


@pytest.mark.parametrize("case", ["metrics-role", "unknown-method", "undecodable",
                                  "too-many-keys"])
def test_bad_calls_fail_and_the_link_stays(cluster, case):
    token = METRICS if case == "metrics-role" else ADMIN
    with proven(cluster, token) as sock:
        if case == "unknown-method":
            body, expect = bytes([250]), grpc.StatusCode.UNIMPLEMENTED
        elif case == "undecodable":
            body, expect = bytes([CALL_METHODS["Lookup"]]) + b"\xff" * 32, \
                grpc.StatusCode.INVALID_ARGUMENT
        elif case == "too-many-keys":
            body = bytes([CALL_METHODS["Exists"]]) + pb.ExistsRequest(
                keys=[f"k{i}" for i in range(100_000)]).SerializeToString()
            expect = grpc.StatusCode.INVALID_ARGUMENT
        else:
            body = bytes([CALL_METHODS["Lookup"]]) + pb.LookupRequest(
                keys=["x"]).SerializeToString()
            expect = grpc.StatusCode.PERMISSION_DENIED
        sock.sendall(frame(Frame.CALL, body))
        kind, answer = recv_frame(sock)
        assert kind == Frame.FAILED
        err = error_of_failed(answer)
        assert answer[0] == expect.value[0], err
        # The link still answers (a metrics token: refused again, per call).
        sock.sendall(frame(Frame.CALL, bytes([CALL_METHODS["Exists"]])
                           + pb.ExistsRequest(keys=["x"]).SerializeToString()))
        kind, answer = recv_frame(sock)
        if case == "metrics-role":
            assert kind == Frame.FAILED
        else:
            assert kind == Frame.ANSWER
            assert pb.ExistsResponse.FromString(answer).exists == [False]


def test_a_wrong_proof_is_refused(cluster):
    sock = socket.create_connection(("127.0.0.1", port(cluster)), timeout=5)
    with sock:
        kind, nonce = recv_frame(sock)
        sock.sendall(frame(Frame.PROVE, proof("not-a-token", nonce)))
        kind, body = recv_frame(sock)
        assert (kind, body[0]) == (Frame.ERROR, pb.UNAUTHENTICATED)


def test_a_forked_child_opens_links_of_its_own(cluster):
    """A child inherits its parent's link and data connections: it must not use them
    (each process would read the other's answers: other keys' metadata and bytes)."""
    with KVClient(cluster.master, token=ADMIN) as kv:
        kv.put("fork-parent", b"p" * 10)
        kv.put("fork-child", b"c" * 20)
        kv.lookup(["fork-parent"])
        assert kv.lookup(["fork-parent"])[0].size_bytes == 10      # on the link now
        pid = os.fork()
        if pid == 0:                                              # the child
            code = 0
            try:
                for _ in range(200):
                    if kv.lookup(["fork-child"])[0].size_bytes != 20 \
                            or bytes(kv.get("fork-child")) != b"c" * 20:
                        code = 1
                        break
            except BaseException:                                 # noqa: BLE001
                code = 2
            os._exit(code)
        wrong = sum(kv.lookup(["fork-parent"])[0].size_bytes != 10
                    or bytes(kv.get("fork-parent")) != b"p" * 10 for _ in range(200))
        _, status = os.waitpid(pid, 0)
        assert (wrong, os.waitstatus_to_exitcode(status)) == (0, 0)


def test_a_forked_child_leaves_the_async_clients_sockets_alone(cluster):
    """The asyncio client in a child forgets its parent's link, data connections and
    channels without touching them (their transports are the parent loop's); the
    parent goes on answering right."""
    async def main():
        async with AsyncKVClient(cluster.master, token=ACME) as kv:
            await kv.put("@acme/afork", b"a" * 70)
            await kv.lookup(["@acme/afork"])
            assert kv._links
            conns, stubs = kv._conns, kv._stubs
            pid = os.fork()
            if pid == 0:
                os._exit(0 if not kv._links and kv._conns is not conns
                         and kv._stubs is not stubs else 1)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
            for _ in range(20):
                assert (await kv.lookup(["@acme/afork"]))[0].size_bytes == 70
    asyncio.run(main())
