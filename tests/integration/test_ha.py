"""Master HA through etcd (issue 5, step 5).

Each shard runs a leader and a standby; the leader holds an etcd lease.
Killing the leader (kill -9) or hanging it (SIGSTOP) lets the standby win
once the lease expires; it rebuilds the index from the nodes' inventories
and clients keep working. A leader that cannot renew its lease (hung etcd)
stops serving before the lease can expire: never two leaders per shard.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import asyncio

import grpc
import pytest

from kvstore import rpc
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.client import KVClient
from kvstore.errors import NotLeader, from_rpc_error
from kvstore.tools.faults.chaos import serving
from kvstore.tools.cluster.launcher import start_store_cluster
from waits import wait_until

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None,
                                reason="etcd is not on PATH (apt-get install etcd-server); "
                                       ".ci/run installs it")


@pytest.fixture
def ha(tmp_path):
    with start_store_cluster(masters=2, nodes=2, standbys=1, etcd="local", node_ttl_ms=2000,
                             log_dir=str(tmp_path)) as c:
        yield c             # stopping resumes a master a test left stopped


def leaders(c) -> list[list[bool]]:
    return [[serving(m.address) for m in shard] for shard in c.shards]


def wait_one_leader_per_shard(c, timeout_s=15.0) -> list[int]:
    def one_each():
        state = leaders(c)
        return state if all(sum(s) == 1 for s in state) else None
    state = wait_until(one_each, timeout_s=timeout_s, interval_s=0.2, what="one leader per shard")
    return [s.index(True) for s in state]


def _refusal_of(address: str) -> Exception:
    """What a standby at ``address`` answers a Lookup, on a blocking channel."""
    with rpc.channel(address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.MasterStub(ch).Lookup(pb.LookupRequest(keys=["k"]), timeout=5.0)
    return from_rpc_error(info.value)


async def _aio_refusal_of(address: str) -> Exception:
    async with rpc.aio_channel(address) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await pb_grpc.MasterStub(ch).Lookup(pb.LookupRequest(keys=["k"]), timeout=5.0)
    return from_rpc_error(info.value)


def test_a_standby_refuses_with_not_leader_naming_the_leader(ha):
    who = wait_one_leader_per_shard(ha)
    for shard, at in zip(ha.shards, who):
        leader, standby = shard[at].address, shard[1 - at].address
        deadline = time.monotonic() + 10     # a standby learns the leader from etcd's watch
        while True:
            sync_err = _refusal_of(standby)
            assert isinstance(sync_err, NotLeader), repr(sync_err)
            if sync_err.leader or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert sync_err.leader == leader       # a field, not text to parse
        aio_err = asyncio.run(_aio_refusal_of(standby))
        assert isinstance(aio_err, NotLeader) and aio_err.leader == leader


def test_failover_keeps_data_and_service(ha):
    who = wait_one_leader_per_shard(ha)
    data = {f"ha-{i}": f"value {i}".encode() * 30 for i in range(60)}
    with KVClient(ha.master, replica_num=2) as kv:
        for k, v in data.items():
            kv.put(k, v)
        # kill -9 shard 0's leader: the standby takes over within the lease ttl.
        ha.shards[0][who[0]].proc.kill()
        t0 = time.monotonic()
        kv.put("ha-after-kill", b"x")           # waits through the failover
        failover_s = time.monotonic() - t0
        assert failover_s < 15
        for k, v in data.items():
            assert bytes(kv.get(k)) == v
        assert sum(serving(m.address) for m in ha.shards[0] if m.proc.poll() is None) == 1
        kv.stat()                               # what kvctl top names each shard's leader by
        assert [kv.answering_master(i) for i in (0, 1)] == [
            ha.shards[0][1 - who[0]].address, ha.shards[1][who[1]].address]
    with KVClient(ha.master, prefer_shm=False) as fresh:     # no cached metadata
        for k, v in data.items():
            assert bytes(fresh.get(k)) == v
        assert bytes(fresh.get("ha-after-kill")) == b"x"


def test_hung_leader_steps_down_and_never_serves_beside_the_new_one(ha):
    who = wait_one_leader_per_shard(ha)
    old = ha.shards[1][who[1]]
    standby = ha.shards[1][1 - who[1]]
    with KVClient(ha.master) as kv:
        key = next(k for k in (f"hung-{i}" for i in range(1000))
                   if kv.shard_map.shard_for_key(k).shard_id == 1)
        os.kill(old.proc.pid, signal.SIGSTOP)
        try:
            kv.put(key, b"during")                   # the standby of shard 1 took over
            assert serving(standby.address)
        finally:
            os.kill(old.proc.pid, signal.SIGCONT)
        # Resumed, the old leader finds its lease expired: it must not serve.
        for _ in range(10):                      # watched for a second: never serving
            assert not serving(old.address)
            time.sleep(0.1)
        assert bytes(kv.get(key)) == b"during"


def test_hung_etcd_makes_leaders_step_down(tmp_path):
    # Its own etcd (not a shared CI one): this test stops it.
    c = start_store_cluster(masters=2, nodes=1, standbys=1, etcd="spawn", log_dir=str(tmp_path))
    try:
        _hung_etcd(c)
    finally:
        if c.etcd.proc.poll() is None:
            os.kill(c.etcd.proc.pid, signal.SIGCONT)
        c.stop()


def _hung_etcd(ha) -> None:
    wait_one_leader_per_shard(ha)
    os.kill(ha.etcd.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(3.5)                  # on purpose: > lease ttl (3 s), nobody can have renewed
        assert leaders(ha) == [[False, False], [False, False]]
    finally:
        os.kill(ha.etcd.proc.pid, signal.SIGCONT)
    wait_one_leader_per_shard(ha)
    with KVClient(ha.master) as kv:
        kv.put("after-etcd", b"ok")
        assert bytes(kv.get("after-etcd")) == b"ok"
