"""The report link (kvstore.transfer.report_link) on a real master with ``--auth``.

Store nodes report their events (a put's STORED among them) to the master on
a plain socket instead of gRPC's StreamEvents; the master checks a proof of a
``node`` token first. Here: the node's puts travel the link (the master's
``link_reports`` counter), and raw connections that are not a node (no
proof, a wrong one, a client token's report, a frame declaring 4 GiB - 1, bytes that
are no report) are refused, each with an ERROR frame and a closed
connection, while the master keeps serving and the stored objects stay
whole. Then the master restarts on another report port: the node learns the
new one from its heartbeat, and puts go on.
"""

from __future__ import annotations

import os
import secrets
import socket

import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import proof
from kvstore.client.client import KVClient
from kvstore.transfer.report_link import HEADER, Frame, frame
from kvtest import start_secured_cluster, wait_for

TOKENS = {role: f"{role}-{secrets.token_hex(16)}" for role in ("admin", "client", "node")}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = start_secured_cluster(tmp_path_factory.mktemp("report-link"), TOKENS)
    try:
        yield c
    finally:
        c.stop()


def counters(kv: KVClient) -> dict:
    (shard,) = kv.stat()
    return shard.counters


def report_port(cluster) -> int:
    return cluster.shards[0][0].info["report_port"]


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    head = b""
    while len(head) < HEADER.size:
        chunk = sock.recv(HEADER.size - len(head))
        if not chunk:
            raise ConnectionError("closed")
        head += chunk
    kind, length = HEADER.unpack(head)
    body = b""
    while len(body) < length:
        chunk = sock.recv(length - len(body))
        if not chunk:
            raise ConnectionError("closed")
        body += chunk
    return kind, body


def closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True


def connect(cluster) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", report_port(cluster)), timeout=5)
    kind, nonce = recv_frame(sock)
    assert kind == Frame.HELLO and len(nonce) >= 16      # --auth: a nonce to prove
    return sock, nonce


def test_puts_travel_the_link(cluster):
    with KVClient(cluster.master, token=TOKENS["admin"]) as kv:
        before = counters(kv).get("link_reports", 0)
        values = {f"linked-{i}": os.urandom(1000 + i) for i in range(20)}
        for k, v in values.items():
            kv.put(k, v)
        assert counters(kv)["link_reports"] >= before + 20    # one report per put at least
        for k, v in values.items():
            assert bytes(kv.get(k)) == v


@pytest.mark.parametrize("attack", ["no-proof", "wrong-proof", "client-token", "huge-frame",
                                    "junk-report", "client-huge-report"])
def test_strangers_are_refused(cluster, attack):
    with KVClient(cluster.master, token=TOKENS["admin"]) as kv:
        kv.put(f"kept-{attack}", b"x" * 4096)
        refused = counters(kv).get("links_refused", 0)
        sock, nonce = connect(cluster)
        with sock:
            if attack == "no-proof":
                sock.sendall(frame(Frame.REPORT, pb.ReportEventsRequest(node_id="n0")
                                   .SerializeToString()))
                expect = pb.INVALID_ARGUMENT
            elif attack == "wrong-proof":
                sock.sendall(frame(Frame.PROVE, proof("not-a-token", nonce)))
                expect = pb.UNAUTHENTICATED
            elif attack == "client-token":      # proven (its calls are served), no reports
                sock.sendall(frame(Frame.PROVE, proof(TOKENS["client"], nonce))
                             + frame(Frame.REPORT, pb.ReportEventsRequest(node_id="n0")
                                     .SerializeToString()))
                expect = pb.PERMISSION_DENIED
            elif attack == "client-huge-report":   # refused at its header, no byte held
                sock.sendall(frame(Frame.PROVE, proof(TOKENS["client"], nonce))
                             + HEADER.pack(Frame.REPORT, (64 << 20) - 1))
                expect = pb.PERMISSION_DENIED
            elif attack == "huge-frame":
                sock.sendall(HEADER.pack(Frame.PROVE, (4 << 30) - 1))
                expect = pb.INVALID_ARGUMENT
            else:
                sock.sendall(frame(Frame.PROVE, proof(TOKENS["node"], nonce))
                             + frame(Frame.REPORT, b"\xff" * 64))
                expect = pb.INVALID_ARGUMENT
            kind, body = recv_frame(sock)
            assert (kind, body[0]) == (Frame.ERROR, expect), body
            assert closed(sock)
        assert counters(kv)["links_refused"] == refused + 1
        assert bytes(kv.get(f"kept-{attack}")) == b"x" * 4096     # the master serves on


def test_a_node_token_may_report(cluster):
    """A proof by a node token opens the link; a report of an unknown node is
    answered (known=False), not refused."""
    sock, nonce = connect(cluster)
    with sock:
        sock.sendall(frame(Frame.PROVE, proof(TOKENS["node"], nonce))
                     + frame(Frame.REPORT, pb.ReportEventsRequest(node_id="nobody")
                             .SerializeToString()))
        kind, body = recv_frame(sock)
        assert kind == Frame.ANSWER
        assert pb.ReportEventsResponse.FromString(body).known is False


def test_master_restart_moves_the_link(cluster):
    old_port = report_port(cluster)
    cluster.shards[0][0].proc.kill()
    cluster.shards[0][0].proc.wait()
    cluster.restart_master(0)
    assert report_port(cluster) not in (0, old_port)
    with KVClient(cluster.master, token=TOKENS["admin"]) as kv:

        def put_linked() -> bool:
            before = counters(kv).get("link_reports", 0)
            kv.put(f"after-restart-{secrets.token_hex(4)}", b"y" * 2048)
            return counters(kv).get("link_reports", 0) > before

        wait_for(put_linked, timeout_s=20, interval_s=0.2)     # the SDK waits out the warm-up
