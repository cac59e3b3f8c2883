"""One behaviour, both SDKs (issue 32): every test here runs against the sync
:class:`KVClient` and the asyncio :class:`AsyncKVClient` alike, on real processes.

The rules are the client core's (:mod:`kvstore.client.core`), so the two must
agree on: already present, KeyConflict, NotFound; the WRONG_SHARD refresh; the
replica order and the fallback from a hung replica, reported to its master;
failover to a new master; a call against a hung master ending by its deadline.
The asyncio client is driven from the test's thread (:class:`AioFromThread`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time

import pytest

from kvstore.client.aio import AsyncKVClient
from kvstore.client.client import KVClient
from kvstore.errors import KeyConflict, NotFound, Unavailable
from kvstore.shardmap import ShardMap
from kvstore.tools.cluster.launcher import start_store_cluster

pytestmark = pytest.mark.slow          # real clusters of processes


class AioFromThread:
    """An AsyncKVClient whose calls a test makes as plain calls: each runs on an event
    loop in a thread of its own and is awaited to its end."""

    def __init__(self, master: str, **kwargs):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.client = AsyncKVClient(master, **kwargs)
        self._run(self.client.start())

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(120)

    def __getattr__(self, name: str):
        attr = getattr(self.client, name)
        if asyncio.iscoroutinefunction(attr):
            return lambda *args, **kwargs: self._run(attr(*args, **kwargs))
        return attr

    @property
    def shard_map(self) -> ShardMap:
        return self.client.shard_map

    @shard_map.setter
    def shard_map(self, value: ShardMap) -> None:
        self.client.shard_map = value

    def close(self) -> None:
        self._run(self.client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "AioFromThread":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture(params=["sync", "aio"])
def sdk(request):
    """Opens a client of the SDK under test: ``sdk(master, **kwargs)``."""
    if request.param == "sync":
        return lambda master, **kw: KVClient(master, prefer_shm=False, **kw)
    return AioFromThread


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    with start_store_cluster(masters=2, nodes=2,
                             log_dir=str(tmp_path_factory.mktemp("sdk"))) as c:
        yield c             # stopping resumes a process a test left stopped


def _on_shard(kv, shard_id: int, tag: str) -> str:
    return next(f"{tag}-{i}" for i in range(1000)
                if kv.shard_map.shard_for_key(f"{tag}-{i}").shard_id == shard_id)


def test_already_present_key_conflict_and_not_found(sdk, shards, request):
    tag = request.node.callspec.id
    with sdk(shards.master) as kv:
        key = f"rules-{tag}"
        assert kv.put(key, b"one") is True
        assert kv.put(key, b"one") is False                 # equal bytes: already present
        with pytest.raises(KeyConflict):
            kv.put(key, b"two")
        assert bytes(kv.get(key)) == b"one"
        with pytest.raises(NotFound):
            kv.get(f"rules-missing-{tag}")
        assert not kv.exists(f"rules-missing-{tag}")
        res = kv.batch_put([f"b-{tag}", f"b-{tag}"], [b"x", b"y"])    # one key twice
        assert sorted(type(r).__name__ for r in res) == ["KeyConflict", "NoneType"]
        (miss,) = kv.lookup([f"rules-missing-{tag}"])
        assert isinstance(miss, NotFound)
        kv.remove(key)
        with pytest.raises(NotFound):
            kv.get(key)


def test_a_stale_shard_map_is_refreshed_once_on_wrong_shard(sdk, shards, request):
    tag = request.node.callspec.id
    with sdk(shards.master, meta_cache_entries=0) as kv:
        keys = [_on_shard(kv, s, f"ws-{tag}-{s}") for s in (0, 1)]
        wrong = ShardMap.single(kv.shard_map.ranges[1].addresses[0])
        for call in (lambda: kv.batch_put(keys, [k.encode() for k in keys]) == [None, None],
                     lambda: [bytes(v) for v in kv.batch_get(keys)] == [k.encode() for k in keys],
                     lambda: kv.batch_exists(keys) == [True, True],
                     lambda: [m.key for m in kv.lookup(keys)] == keys):
            kv.shard_map = wrong                           # every key "on shard 1"
            assert call()
            assert len(kv.shard_map.ranges) == 2            # refreshed


def test_a_hung_replica_is_read_past_and_reported_to_its_master(sdk, shards, request):
    tag = request.node.callspec.id
    with sdk(shards.master, replica_num=2, timeout_s=4.0) as kv:
        key = _on_shard(kv, 0, f"hung-{tag}")
        kv.put(key, b"v" * 1000)
        meta = kv.lookup([key])[0]
        assert len(meta.replicas) == 2
        victim = meta.replicas[0].node.node_id              # read first (same host, DRAM)
        before = _reported(shards)
        os.kill(shards.nodes[victim].proc.pid, signal.SIGSTOP)
        try:
            with sdk(shards.master, timeout_s=4.0) as fresh:
                assert bytes(fresh.get(key)) == b"v" * 1000      # from the other replica
                assert bytes(fresh.get(key)) == b"v" * 1000      # the suspect now last
        finally:
            os.kill(shards.nodes[victim].proc.pid, signal.SIGCONT)
        assert _reported(shards) > before                     # ReportFailure reached it


def _reported(cluster) -> int:
    """Shard 0's count of nodes that clients reported failing a transfer."""
    with KVClient(cluster.master) as admin:
        return admin.stat()[0].counters.get("transfer_failures_reported", 0)


def test_a_call_against_a_hung_master_ends_by_its_deadline(sdk, shards, request):
    tag = request.node.callspec.id
    with sdk(shards.master, timeout_s=3.0, failover_wait_s=3.0, meta_cache_entries=0) as kv:
        key = _on_shard(kv, 0, f"dl-{tag}")
        kv.put(key, b"x")
        master = shards.shards[0][0]
        os.kill(master.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(Unavailable):
                kv.get(key)
            took_s = time.monotonic() - t0
        finally:
            os.kill(master.proc.pid, signal.SIGCONT)
        assert took_s < 10.0, took_s                         # its deadline is 3 s


@pytest.fixture(scope="module")
def ha(tmp_path_factory):
    if shutil.which("etcd") is None and not os.environ.get("KVSTORE_ETCD"):
        pytest.skip("no etcd (KVSTORE_ETCD, or etcd on PATH)")
    with start_store_cluster(masters=1, nodes=1, standbys=1, etcd="local", node_ttl_ms=2000,
                             log_dir=str(tmp_path_factory.mktemp("sdk-ha"))) as c:
        yield c


def test_calls_fail_over_to_the_new_leader(sdk, ha, request):
    from kvstore.tools.faults.chaos import serving
    tag = request.node.callspec.id
    deadline = time.monotonic() + 20
    while sum(serving(m.address) for m in ha.shards[0]) != 1:
        assert time.monotonic() < deadline, "no leader"
        time.sleep(0.2)
    leader = next(m for m in ha.shards[0] if serving(m.address))
    with sdk(ha.master, timeout_s=5.0, failover_wait_s=20.0) as kv:
        kv.put(f"ha-{tag}", b"before")
        os.kill(leader.proc.pid, signal.SIGSTOP)             # the standby takes over
        try:
            assert kv.put(f"ha-{tag}-after", b"after") is True
            assert bytes(kv.get(f"ha-{tag}")) == b"before"
        finally:
            os.kill(leader.proc.pid, signal.SIGCONT)         # it finds its lease gone
        assert bytes(kv.get(f"ha-{tag}-after")) == b"after"
