"""A shard whose master is down or hung costs only its own keys.

Two master shards, one store node: a node's writes wait only for the shard
that owns their key (its STORED report), and the SDK's batch calls answer
the healthy shard's keys when another shard cannot be reached.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client import KVClient, Unavailable
from kvstore.keys import value_checksum
from kvstore.tools.cluster.launcher import start_store_cluster
from kvstore.transfer.protocol import Op
from kvstore.transfer.tcp import NodeConnection
from waits import wait_until


@pytest.fixture
def two_shards(tmp_path):
    with start_store_cluster(masters=2, nodes=1, log_dir=str(tmp_path)) as c:
        yield c             # stopping resumes a master a test left stopped


#: How long a node's write waits for its master's acknowledgement (DataServer's default).
NODE_ACK_TIMEOUT_S = 2.0


def _node_counters(host: str, port: int) -> dict:
    """The node's own counters (its STATS op), over a connection of their own."""
    conn = NodeConnection(host, port, timeout_s=5)
    try:
        conn.send(Op.STATS, "")
        code, _oid, size, _ck, _off, msg = conn.recv_header()
        assert code == pb.OK, msg
        buf = bytearray(size)
        conn.recv_value_into(size, memoryview(buf))
        return json.loads(buf)["counters"]
    finally:
        conn.close()


def keys_of(kv: KVClient, shard_id: int, n: int, prefix: str) -> list[str]:
    out, i = [], 0
    while len(out) < n:
        k = f"{prefix}{i}"
        if kv.shard_map.shard_for_key(k).shard_id == shard_id:
            out.append(k)
        i += 1
    return out


def test_a_hung_shard_does_not_slow_the_writes_of_another(two_shards):
    c = two_shards
    with KVClient(c.master, prefer_shm=False) as kv:
        mine = keys_of(kv, 0, 12, "iso0-")
        theirs = keys_of(kv, 1, 1, "iso1-")[0]
        kv.put(mine[0], b"warm")
        os.kill(c.shards[1][0].proc.pid, signal.SIGSTOP)
        # A write of shard 1's key lands on the node: its STORED report waits for
        # the hung master (and fails after the node's ack timeout).
        host, port = c.nodes["n0"].address.rsplit(":", 1)
        stuck = NodeConnection(host, int(port), timeout_s=15)
        value = b"x" * 1000
        stuck.send(Op.PUT, theirs, 123_456, len(value), value_checksum(value), memoryview(value))
        replies = []
        waiter = threading.Thread(target=lambda: replies.append(stuck.recv_header()))
        waiter.start()
        try:
            # The node committed it (puts: "warm" and this one) and waits for shard 1.
            wait_until(lambda: _node_counters(host, int(port))["puts"] >= 2,
                       what="the node to take the write for the hung shard")
            t0 = time.monotonic()
            for k in mine[1:]:
                assert kv.put(k, b"v" * 1000) is True
            # Each write that waited for the hung shard would take its ack timeout (2 s),
            # 22 s for these 11: a bound that needs no fast machine.
            assert time.monotonic() - t0 < len(mine[1:]) * NODE_ACK_TIMEOUT_S
        finally:
            os.kill(c.shards[1][0].proc.pid, signal.SIGCONT)
            waiter.join(timeout=10)
            stuck.close()
        assert replies and replies[0][0] in (pb.UNAVAILABLE, pb.FENCED, pb.NOT_FOUND)


def test_batches_answer_the_healthy_shard_when_another_is_down(two_shards):
    c = two_shards
    with KVClient(c.master, prefer_shm=False, failover_wait_s=2.0) as kv:
        mine = keys_of(kv, 0, 5, "down0-")
        theirs = keys_of(kv, 1, 5, "down1-")
        assert kv.batch_put(mine + theirs, [b"v"] * 10) == [None] * 10
        c.shards[1][0].proc.kill()
        c.shards[1][0].proc.wait()
        fresh = [k + "/2" for k in mine + theirs]
        fresh = [k for k in fresh if kv.shard_map.shard_for_key(k).shard_id == 0][:3] + \
            keys_of(kv, 1, 3, "down1-new-")
        results = kv.batch_put(fresh, [b"n"] * len(fresh))
        by_shard = [kv.shard_map.shard_for_key(k).shard_id for k in fresh]
        assert [r is None for r, s in zip(results, by_shard) if s == 0] == [True] * by_shard.count(0)
        assert all(isinstance(r, Unavailable) for r, s in zip(results, by_shard) if s == 1)
    with KVClient(c.master, prefer_shm=False, meta_cache_entries=0) as fresh_kv:
        got = fresh_kv.batch_get(mine + theirs)     # no cached metadata: each key asks its shard
        assert [bytes(g) for g in got[:5]] == [b"v"] * 5
        assert all(isinstance(g, Unavailable) for g in got[5:])
