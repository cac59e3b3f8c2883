"""A reader that stops reading loses its connection and the object it held (issue 31, bug 9).

A raw GET of a 64 MiB object that reads 1 MiB and stops used to keep the
node's connection thread in ``sendmsg`` for good, and the object referenced:
its 64 MiB stayed used after ``remove`` returned, and the removed version
was still sent to the reader when it came back. The node's sends now have a
deadline (``--send-timeout-s``; by default ``--write-timeout-s``): a reader
that takes no byte of its reply for that long is dropped (counted
``stalled_reads``) and its reference released.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.client import KVClient, NotFound
from kvstore.keys import value_checksum
from kvstore.store.data_server import DataServer
from kvstore.store.node import StoreNode
from kvstore.store.tiers.dram import DramTier
from kvstore.tools.cluster import netns
from kvstore.tools.cluster.launcher import start_store_cluster
from kvstore.tools.cluster.processes import ProcessGroup, service_args
from kvstore.transfer.protocol import REQUEST, RESPONSE, Op, local_address
from kvtest import wait_for

MiB = 1024 * 1024
BIG = 64 * MiB
#: The node's stall deadline for this test (the default is 30 s). Given as
#: --write-timeout-s, which the send deadline follows unless --send-timeout-s is set.
STALL_S = 2


def _dram_used(kv: KVClient) -> int:
    (node,) = kv.node_stats().values()
    return node["tiers"][0]["used_bytes"]


def _stalled_reads(kv: KVClient) -> int:
    (node,) = kv.node_stats().values()
    return node["counters"].get("stalled_reads", 0)


def _read_some(sock: socket.socket, n: int) -> int:
    got = 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            break
        got += len(chunk)
    return got


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--write-timeout-s", "--send-timeout-s"])
def test_a_reader_that_stops_reading_is_dropped_and_its_object_freed(tmp_path, option):
    with start_store_cluster(1, 1, dram="128MiB", log_dir=str(tmp_path),
                             node_args=(option, str(STALL_S))) as cluster:
        (node,) = cluster.nodes.values()
        host, port = node.info["address"].rsplit(":", 1)
        with KVClient(cluster.master, prefer_shm=False) as kv:
            value = bytes(range(256)) * (BIG // 256)
            kv.put("big", value)
            assert _dram_used(kv) >= BIG

            reader = socket.socket()
            # A small receive buffer: the node's send blocks after a few MiB.
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            reader.connect((host, int(port)))
            try:
                key = b"big"
                reader.sendall(REQUEST.pack(Op.GET, 0, len(key), 0, 0, 0, 0) + key)
                got = _read_some(reader, RESPONSE.size + MiB)      # then it stops reading
                assert got == RESPONSE.size + MiB

                kv.remove("big")
                with pytest.raises(NotFound):
                    kv.get("big")
                # The node gives up on the reader within its deadline, and the
                # removed version's memory goes back.
                seen: list = []

                def released() -> bool:
                    seen[:] = [_dram_used(kv), _stalled_reads(kv)]
                    return seen == [0, 1]
                try:
                    wait_for(released, timeout_s=30, interval_s=0.2)
                except BaseException:
                    print(f"after 30 s: DRAM used {seen[0]} B, stalled_reads {seen[1]}")
                    raise

                # The reader comes back: the node closed the connection long
                # before the whole value was sent.
                reader.settimeout(10)
                try:
                    got += _read_some(reader, BIG)
                except ConnectionResetError:
                    pass
                assert got < RESPONSE.size + BIG
            finally:
                reader.close()
            # The node serves on.
            kv.put("after", b"x" * 1000)
            assert kv.get("after") == b"x" * 1000


def _tls_pair(tmp_path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    from kvstore.tls import TlsFiles, client_context, server_context
    from kvstore.tools.cluster.certs import make_certs

    certs = make_certs(tmp_path / "certs", ["127.0.0.1"])
    server = server_context(TlsFiles(str(certs.server_cert), str(certs.server_key)))
    client = client_context(TlsFiles(ca=str(certs.ca)))
    return server, client


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["tcp", "tls", "unix"])
def test_every_transport_drops_a_reader_that_stops(tmp_path, transport):
    """The same on the node's own data server, in this process, over plain TCP (the
    kernel's send timeout), TLS (the socket's own timeout) and the same-host Unix
    socket; the node's stall deadline is its write timeout, 1 s here."""
    tls_server, tls_client = _tls_pair(tmp_path) if transport == "tls" else (None, None)
    dram = DramTier(64 * MiB)
    node = StoreNode(dram)                       # no master: writes are confirmed at once
    server = DataServer(node, local_address=local_address(dram.name), tls=tls_server,
                        write_timeout_s=1.0).start()
    reader = None
    try:
        size = 32 * MiB
        value = b"v" * size
        obj, _ = node.begin_write("big", 1, size, value_checksum(value))
        node.write_view(obj)[:] = value
        node.commit_write(obj)
        if transport == "unix":
            reader = socket.socket(socket.AF_UNIX)
            reader.connect(local_address(dram.name))
        else:
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            reader.connect(("127.0.0.1", server.port))
            if tls_client is not None:
                reader = tls_client.wrap_socket(reader, server_hostname="127.0.0.1")
        reader.sendall(REQUEST.pack(Op.GET, 0, 3, 0, 0, 0, 0) + b"big")
        assert _read_some(reader, RESPONSE.size + MiB) == RESPONSE.size + MiB
        wait_for(lambda: node.stats().num_referenced == 1, timeout_s=10)
        assert node.drop("big")                  # doomed, but referenced by the send

        seen: list = []

        def released() -> bool:
            st = node.stats()
            seen[:] = [st.used_bytes, st.counters.get("stalled_reads", 0)]
            return seen == [0, 1]
        try:
            wait_for(released, timeout_s=30, interval_s=0.1)
        except BaseException:
            print(f"after 30 s: DRAM used {seen[0]} B, stalled_reads {seen[1]}")
            raise
        node.check_invariants(idle=True)
    finally:
        if reader is not None:
            reader.close()
        server.stop()
        node.close()


# ---- a reader whose host drops off the network ----

READER = Path(__file__).with_name("netns_reader.py")


@pytest.mark.slow
@pytest.mark.skipif(netns.unavailable() is not None,
                    reason=f"network namespaces: {netns.unavailable()}")
def test_a_reader_whose_host_drops_off_is_dropped(tmp_path):
    """A node on host a; a reader on host b with a GET it stopped reading and an idle
    connection; then b's link goes down. Without a send deadline and keepalive the
    node kept both connections until the kernel gave up retransmitting (about 15
    minutes) and for ever; now both go within a few times the 2 s deadline."""
    with netns.NetHosts(["a", "b"], subnet="198.18.7.0/24") as hosts, \
            ProcessGroup(log_dir=str(tmp_path / "logs")) as procs:
        on_a, a = hosts.exec_args("a"), hosts["a"].address
        master = procs.start("master", service_args(
            "master", "--host", a, "--port", "0", "--insecure"), prefix=on_a).address
        node = procs.start("n0", service_args(
            "node", "--master", master, "--host", a, "--insecure", "--node-id", "n0",
            "--dram", "128MiB", "--write-timeout-s", str(STALL_S)), prefix=on_a)
        port = node.info["address"].rsplit(":", 1)[1]
        put = hosts.run("a", [sys.executable, "-c",
                              "import sys; from kvstore.client import KVClient; "
                              "KVClient(sys.argv[1]).put('big', b'b' * (64 << 20))", master],
                        capture_output=True, text=True, timeout=120)
        assert put.returncode == 0, put.stderr

        def connections() -> int:
            out = hosts.run("a", ["ss", "-Htn", "state", "established",
                                  f"( sport = :{port} )"], capture_output=True, text=True)
            return len(out.stdout.splitlines())

        before = connections()
        reader = hosts.popen("b", [sys.executable, str(READER), node.info["address"], "big"],
                             stdout=subprocess.PIPE, text=True)
        try:
            assert reader.stdout.readline().strip() == "ready"
            assert connections() == before + 2
            hosts.cut("b")
            seen = []

            def dropped() -> bool:
                seen[:] = [connections() - before]
                return seen == [0]
            try:
                wait_for(dropped, timeout_s=60, interval_s=0.5)
            except BaseException:
                print(f"after 60 s: {seen[0]} of the reader's 2 connections still open")
                raise
        finally:
            reader.kill()
            reader.wait()
        stats = hosts.run("a", [sys.executable, "-c",
                                "import sys; from kvstore.client import KVClient; "
                                "(n,) = KVClient(sys.argv[1]).node_stats().values(); "
                                "c = n['counters']; print(c['stalled_reads'], c['peers_lost'])",
                                master],
                          capture_output=True, text=True, timeout=60)
        assert stats.returncode == 0, stats.stderr
        # The GET it stopped reading; the idle connection (keepalive).
        assert stats.stdout.split() == ["1", "1"]
        procs.check()
