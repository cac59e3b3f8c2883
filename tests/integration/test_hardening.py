"""Issue 13's bugs, each on real processes (a test per bug; see the issue).

    malformed node address   the master refuses to register it (INVALID_ARGUMENT), and
                             the SDK turns an unusable address into Unavailable (a typed,
                             retryable error that revokes the put), never a UnicodeError
"""

from __future__ import annotations

import secrets

import grpc
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import Unavailable
from kvstore.tools.cluster.processes import ProcessGroup, service_args
from kvstore.transfer.tcp import NodeConnection
from waits import wait_until


@pytest.fixture()
def master(tmp_path):
    with ProcessGroup(log_dir=str(tmp_path)) as procs:
        yield procs.start("master", service_args("master"))


@pytest.mark.parametrize("host,port,node_id", [
    ("a" * 70, 7000, "n"),                 # an IDNA label over 63 characters
    ("h" * 300, 7000, "n"),                # longer than any DNS name
    ("", 7000, "n"),
    ("bad host/x", 7000, "n"),
    ("127.0.0.1", 0, "n"),
    ("127.0.0.1", 70000, "n"),
    ("127.0.0.1", 7000, "n" * 500),
    ("127.0.0.1", 7000, "tab\there"),
])
def test_the_master_refuses_an_address_no_client_could_use(master, host, port, node_id):
    with grpc.insecure_channel(master.address) as ch:
        stub = pb_grpc.MasterStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.RegisterNode(pb.RegisterNodeRequest(
                address=pb.NodeAddress(node_id=node_id, host=host, data_port=port),
                tier=pb.DRAM, capacity_bytes=1 << 30, max_object_bytes=1 << 30,
                incarnation=secrets.token_hex(16)), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "node address" in err.value.details()
        reply = stub.Stat(pb.StatRequest(), timeout=10)
        assert not reply.nodes                     # nothing half-registered


@pytest.mark.parametrize("host", ["a" * 70, "x" * 300])
def test_the_sdk_transport_gives_a_typed_error_for_an_unusable_host(host):
    with pytest.raises(Unavailable):
        NodeConnection(host, 7000, timeout_s=1)


# ---- one huge request (bug 6) ----

def test_a_call_over_the_key_limit_is_refused_and_the_sdk_splits_batches(master):
    from kvstore.client import KVClient
    from kvstore.rpc import MAX_KEYS_PER_CALL

    too_many = MAX_KEYS_PER_CALL + 1
    with grpc.insecure_channel(master.address) as ch:
        stub = pb_grpc.MasterStub(ch)
        for call, request in (
                (stub.Exists, pb.ExistsRequest(keys=[f"k{i}" for i in range(too_many)])),
                (stub.Lookup, pb.LookupRequest(keys=[f"k{i}" for i in range(too_many)])),
                (stub.Remove, pb.RemoveRequest(keys=[f"k{i}" for i in range(too_many)]))):
            with pytest.raises(grpc.RpcError) as err:
                call(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert str(MAX_KEYS_PER_CALL) in err.value.details()
    with KVClient(master.address) as kv:
        keys = [f"k{i}" for i in range(2 * MAX_KEYS_PER_CALL + 5)]
        assert kv.batch_exists(keys) == [False] * len(keys)      # three calls, no error


# ---- the OpenAI front drops nothing silently (bug 7) ----

def test_the_http_front_refuses_fields_it_cannot_honour(tmp_path):
    import json
    import urllib.error
    import urllib.request

    with ProcessGroup(log_dir=str(tmp_path)) as procs:
        # A conductor address nothing listens on: parsing comes first, so a
        # refused body is 400, and an accepted one only then fails (503).
        front = procs.start("http", service_args("http", "--conductor", "127.0.0.1:9"))

        def post(body: dict) -> tuple[int, dict]:
            req = urllib.request.Request(f"http://{front.address}/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as exc:
                return exc.code, json.loads(exc.read())

        base = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        for extra, field in (({"images": ["data:image/png;base64,AAAA"]}, "images"),
                             ({"multi_modal_data": {"image": "x"}}, "multi_modal_data"),
                             ({"tools": []}, "tools"),
                             ({"logit_bias": {"5": 100}}, "logit_bias"),
                             ({"stream": True, "stream_options": {"continuous": 1}},
                              "stream_options")):
            code, body = post({**base, **extra})
            assert code == 400, (extra, body)
            assert body["error"]["param"] == field, body
        code, body = post({**base, "temperature": 0.7, "user": "me"})
        assert code == 503, body          # accepted, then no conductor to run it


# ---- the master forgets dead nodes (bug 5) ----

def test_dead_nodes_are_forgotten_with_their_replicas(tmp_path):
    from kvstore.client import KVClient, NotFound

    with ProcessGroup(log_dir=str(tmp_path)) as procs:
        m = procs.start("master", service_args("master", "--node-ttl-ms", "1000",
                                               "--node-forget-ms", "2000"))
        with grpc.insecure_channel(m.address) as ch:
            stub = pb_grpc.MasterStub(ch)
            for i in range(200):                       # junk registrations that never beat
                stub.RegisterNode(pb.RegisterNodeRequest(
                    address=pb.NodeAddress(node_id=f"junk{i}", host="127.0.0.1", data_port=9),
                    tier=pb.DRAM, capacity_bytes=1 << 20, max_object_bytes=1 << 20,
                    incarnation=secrets.token_hex(16)), timeout=10)
            node = procs.start("node", service_args("node", "--master", m.address,
                                                    "--node-id", "real", "--dram", "16MiB"))
            with KVClient(m.address) as kv:
                kv.put("kept", b"v" * 1000)
                assert len(stub.Stat(pb.StatRequest(), timeout=10).nodes) == 201
                wait_until(lambda: len(stub.Stat(pb.StatRequest(), timeout=10).nodes) <= 1,
                           timeout_s=15, interval_s=0.2, what="the junk nodes to be forgotten")
                (st,) = kv.stat()
                assert [n.address.node_id for n in st.nodes] == ["real"]
                assert kv.get("kept") == b"v" * 1000      # a live node's objects stay
                node.proc.kill()
                node.proc.wait(10)
                wait_until(lambda: not stub.Stat(pb.StatRequest(), timeout=10).nodes,
                           timeout_s=15, interval_s=0.2, what="the dead node to be forgotten")
                (st,) = kv.stat()
                assert st.num_objects == 0 and st.counters["forgotten"] == 1
                assert kv.batch_exists(["kept"]) == [False]
                assert isinstance(kv.lookup(["kept"])[0], NotFound)


# ---- a master restart keeps every key and every rule (bug 1) ----

def _lookup_codes(address: str, keys: list[str], seconds: float) -> dict[str, int]:
    """What a master answers to Lookup of ``keys``, polled for ``seconds``: per outcome
    (``found``, ``not_found``, ``unavailable``, ``other``) the number of answers."""
    import time

    out = {"found": 0, "not_found": 0, "unavailable": 0, "other": 0}
    end = time.monotonic() + seconds
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.MasterStub(ch)
        while time.monotonic() < end:
            try:
                reply = stub.Lookup(pb.LookupRequest(keys=keys), timeout=2)
                for r in reply.results:
                    out["found" if r.status.code == pb.OK else
                        "not_found" if r.status.code == pb.NOT_FOUND else "other"] += 1
            except grpc.RpcError as exc:
                out["unavailable" if exc.code() == grpc.StatusCode.UNAVAILABLE else "other"] += 1
            time.sleep(0.05)                            # pacing: an engine's lookups
    return out


@pytest.mark.parametrize("outage_s", [1, 5, 30])
def test_a_master_restart_answers_no_false_not_found_and_overwrites_nothing(tmp_path, outage_s):
    import os
    import signal
    import threading
    import time

    from kvstore.client import KVClient, KeyConflict, Unavailable as SdkUnavailable
    from kvstore.tools.cluster.launcher import start_store_cluster

    with start_store_cluster(1, 2, dram="32MiB", log_dir=str(tmp_path)) as cluster:
        values = {f"live/{i}": os.urandom(4096 + i) for i in range(20)}
        with KVClient(cluster.master) as kv:
            for k, v in values.items():
                kv.put(k, v)
        master = cluster.shards[0][0]
        master.proc.send_signal(signal.SIGKILL)
        master.proc.wait(10)
        time.sleep(outage_s)                        # the outage under test
        restarted = cluster.restart_master(0)
        ready_at = time.monotonic()
        accepted = []

        def overwrite():
            with KVClient(cluster.master) as w:
                for k in list(values)[:5]:
                    try:
                        w.put(k, b"other bytes " + k.encode())
                        accepted.append(k)
                    except (KeyConflict, SdkUnavailable):
                        pass

        back: list[float] = []

        def nodes_back():
            with grpc.insecure_channel(restarted.address) as ch:
                stub = pb_grpc.MasterStub(ch)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    st = stub.Stat(pb.StatRequest(), timeout=5)
                    if sum(n.alive for n in st.nodes) == 2:
                        back.append(time.monotonic() - ready_at)
                        return
                    time.sleep(0.02)

        threads = [threading.Thread(target=overwrite), threading.Thread(target=nodes_back)]
        for t in threads:
            t.start()
        codes = _lookup_codes(restarted.address, list(values), 5.0)
        for t in threads:
            t.join(30)
        print(f"HARDENING outage {outage_s} s: lookups {codes}, overwrites accepted "
              f"{len(accepted)}, nodes back {back[0] if back else None} s after READY")
        assert codes["not_found"] == 0 and codes["other"] == 0, codes
        assert codes["found"] > 0
        assert accepted == []
        # Back within nodes_back's 10 s (the figure is printed above; speed is the bench's).
        assert back, "the nodes did not come back within 10 s of the master's READY"
        with KVClient(cluster.master) as kv:
            for k, v in values.items():
                assert kv.get(k) == v


# ---- a put that cannot fit evicts nothing; a stalled writer frees its space (bug 3) ----

@pytest.fixture()
def crowded(tmp_path):
    """One node: 64 MiB DRAM, a 40 MiB object pinned, 50 small evictable objects."""
    import os

    from kvstore.client import KVClient
    from kvstore.tools.cluster.launcher import start_store_cluster

    with start_store_cluster(1, 1, dram="64MiB", eviction_policy="default",
                             node_args=("--write-timeout-s", "1"),
                             log_dir=str(tmp_path)) as cluster:
        kv = KVClient(cluster.master, prefer_shm=False)
        kv.put("big", os.urandom(40 << 20))
        kv.pin("big")
        small = {f"small/{i}": os.urandom(100_000) for i in range(50)}
        for k, v in small.items():
            kv.put(k, v)
        try:
            yield cluster, kv, small
        finally:
            kv.close()


def _evictions(kv) -> int:
    (own,) = kv.node_stats().values()
    return own["counters"]["evictions"]


def test_a_put_that_cannot_fit_fails_at_once_and_evicts_nothing(crowded):
    # "At once" is the no_fit counter (refused without waiting for room), not a timing.
    from kvstore.client import NoSpace

    cluster, kv, small = crowded
    with pytest.raises(NoSpace) as err:
        kv.put("huge", b"x" * (30 << 20))
    assert "nothing was evicted" in str(err.value)
    assert _evictions(kv) == 0
    assert all(kv.get(k) == v for k, v in small.items())
    (own,) = kv.node_stats().values()
    assert own["counters"]["no_fit"] >= 1


def test_a_value_above_the_high_watermark_is_too_large_and_evicts_nothing(crowded):
    # 62 MiB fits the 64 MiB tier but not under its 95 % watermark: stored, it
    # would be evicted at once, and every other object with it.
    from kvstore.client import TooLarge

    cluster, kv, small = crowded
    with pytest.raises(TooLarge) as err:
        kv.put("over", b"x" * (62 << 20))
    assert "largest object" in str(err.value)
    assert _evictions(kv) == 0
    assert all(kv.get(k) == v for k, v in small.items())


def test_a_stalled_writer_loses_its_reservation_in_bounded_time(crowded):
    from kvstore.transfer.protocol import Op

    cluster, kv, small = crowded
    host, port = cluster.nodes["n0"].address.rsplit(":", 1)
    (before,) = kv.node_stats().values()
    stalled = NodeConnection(host, int(port), timeout_s=10)
    size = 15 << 20                                  # fits: reserved, then never sent
    stalled.send(Op.PUT, "stalled", 999_999, size, 12345, memoryview(b"x" * 1000))

    def own() -> dict:
        (stats,) = kv.node_stats().values()
        return stats
    # Reserved (seen before the node's 1 s write timeout frees it) ...
    wait_until(lambda: own()["tiers"][0]["used_bytes"] >= before["tiers"][0]["used_bytes"] + size,
               interval_s=0.02, what="the stalled write's reservation")
    # ... and freed: bounded time is the write timeout, far under this deadline.
    after = wait_until(lambda: (s := own())["counters"]["stalled_writes"] == 1 and s,
                       what="the stalled reservation to be freed")
    assert after["tiers"][0]["used_bytes"] == before["tiers"][0]["used_bytes"]
    assert _evictions(kv) == 0
    assert all(kv.get(k) == v for k, v in small.items())
    stalled.close()


# ---- running out of file descriptors (bug 2) ----

def _ping(address: str) -> str:
    """``ok``, ``refused`` (UNAVAILABLE) or ``timeout`` for one PING on a new connection."""
    from kvstore.transfer.protocol import Op

    host, port = address.rsplit(":", 1)
    try:
        conn = NodeConnection(host, int(port), timeout_s=2)
    except Unavailable:
        return "timeout"
    try:
        conn.send(Op.PING, "")
        code = conn.recv_header()[0]
        return "ok" if code == pb.OK else "refused" if code == pb.UNAVAILABLE else str(code)
    except Unavailable as exc:
        return "timeout" if "timed out" in str(exc) else "refused"
    finally:
        conn.close()


def _node_with_fd_limit(procs, master, nofile: int, *extra: str):
    import shutil

    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) is not installed")
    return procs.start("node", service_args("node", "--master", master.address, "--node-id",
                                            "fd", "--dram", "16MiB", *extra),
                       prefix=["prlimit", f"--nofile={nofile}:{nofile}"])


def test_connections_over_the_cap_are_refused_clearly(tmp_path):
    import socket

    with ProcessGroup(log_dir=str(tmp_path)) as procs:
        master = procs.start("master", service_args("master"))
        node = _node_with_fd_limit(procs, master, 1024, "--max-connections", "40")
        host, port = node.address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port))) for _ in range(40)]
        try:
            assert _ping(node.address) == "refused"
        finally:
            for s in idle[:10]:
                s.close()
        wait_until(lambda: _ping(node.address) == "ok", what="a freed connection slot")
        for s in idle[10:]:
            s.close()


def test_the_accept_loop_survives_running_out_of_fds(tmp_path):
    import socket

    with ProcessGroup(log_dir=str(tmp_path)) as procs:
        master = procs.start("master", service_args("master"))
        # A cap above the fd limit: the limit is hit first, as with no cap at all.
        node = _node_with_fd_limit(procs, master, 160, "--max-connections", "10000",
                                   "--metrics-port", "0")
        host, port = node.address.rsplit(":", 1)
        idle = []
        for _ in range(200):                  # more than the node has fds for
            idle.append(socket.create_connection((host, int(port)), timeout=5))
        # Out of fds: a new connection is queued, never accepted.
        wait_until(lambda: _ping(node.address) == "timeout", interval_s=0,
                   what="the node to run out of fds")
        health = f"http://{node.info['metrics_address']}/health"

        def status() -> int:
            import urllib.error
            import urllib.request
            try:
                return urllib.request.urlopen(health, timeout=5).status
            except urllib.error.HTTPError as exc:
                return exc.code

        # The metrics port's own accept needs an fd too; it gets one once any frees.
        for s in idle[:150]:
            s.close()
        wait_until(lambda: _ping(node.address) == "ok", interval_s=0,
                   what="the node to accept again")
        for s in idle[150:]:
            s.close()
        wait_until(lambda: status() == 200, interval_s=0.1, what="the node's health back to 200")
        from kvstore.client import KVClient

        with KVClient(master.address) as kv:
            (own,) = kv.node_stats().values()
        assert own["counters"]["accept_errors"] > 0


# ---- once remove returns, nobody reads the value (bug 8) ----

@pytest.mark.parametrize("prefer_shm", [True, False])
def test_no_reader_gets_a_value_once_remove_returned(tmp_path, prefer_shm):
    from kvstore.client import KVClient, NotFound
    from kvstore.tools.cluster.launcher import start_store_cluster

    with start_store_cluster(1, 2, dram="32MiB", log_dir=str(tmp_path)) as cluster:
        with KVClient(cluster.master, prefer_shm=prefer_shm) as writer, \
                KVClient(cluster.master, prefer_shm=prefer_shm) as reader:
            keys = [f"rm/{i}" for i in range(30)]
            for k in keys:
                writer.put(k, k.encode() * 100, replica_num=2)
            for k in keys:                      # both hold the metadata in their caches
                assert reader.get(k) == writer.get(k) == k.encode() * 100
            served = 0
            for k in keys:
                writer.remove(k)
                for kv in (writer, reader):     # at once, no sleep
                    try:
                        kv.get(k)
                        served += 1
                    except NotFound:
                        pass
            assert served == 0
