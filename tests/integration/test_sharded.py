"""Sharded metadata (issue 5, step 1): several master shards on a static shard map.

Every store node registers and heartbeats with every shard; a key's metadata
lives on the shard owning its slot; a master asked about a key of another
shard answers WRONG_SHARD with a redirect (never a wrong answer), and the
client follows it.
"""

from __future__ import annotations

import grpc
import pytest

from kvstore.client.client import KVClient
from kvstore.errors import KVStoreError, WrongShard
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.tools.cluster.launcher import start_store_cluster
from kvstore.shardmap import ShardMap
from kvtest import wait_for


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    c = start_store_cluster(masters=2, nodes=2, log_dir=str(tmp_path_factory.mktemp("sharded")))
    try:
        yield c
        c.procs.check()
    finally:
        c.stop()


def test_keys_split_over_shards_and_every_node_registers_with_each(sharded):
    with KVClient(sharded.master) as kv:
        assert len(kv.shard_map.ranges) == 2
        keys = [f"sh-{i}" for i in range(200)]
        for k in keys:
            kv.put(k, k.encode() * 10)
        for k in keys:
            assert bytes(kv.get(k)) == k.encode() * 10
        assert all(kv.batch_exists(keys))
        stats = kv.stat()
        assert [s.shard_id for s in stats] == [0, 1]
        counts = [s.num_objects for s in stats]
        assert sum(counts) == 200 and min(counts) > 50, counts
        for s in stats:
            assert {n.address.node_id for n in s.nodes if n.alive} == {"n0", "n1"}
        # Each shard's index holds only keys of its own slots.
        smap = kv.shard_map
        for r in smap.ranges:
            for meta in kv._control.call(r.addresses, "List", pb.ListRequest(limit=1000)).objects:
                assert smap.shard_for_key(meta.key).shard_id == r.shard_id


def test_wrong_shard_gets_a_redirect_never_a_wrong_answer(sharded):
    with KVClient(sharded.master) as kv:
        kv.put("ws-key", b"v")
        owner = kv.shard_map.shard_for_key("ws-key")
        other = next(r for r in kv.shard_map.ranges if r.shard_id != owner.shard_id)
    with grpc.insecure_channel(other.addresses[0]) as ch:
        stub = pb_grpc.MasterStub(ch)
        ex = stub.Exists(pb.ExistsRequest(keys=["ws-key"]), timeout=5)
        assert ex.statuses[0].code == pb.WRONG_SHARD and ex.statuses[0].redirect == str(owner)
        lk = stub.Lookup(pb.LookupRequest(keys=["ws-key"]), timeout=5)
        assert lk.results[0].status.code == pb.WRONG_SHARD
        assert lk.results[0].status.redirect == str(owner)
        with pytest.raises(grpc.RpcError) as err:
            stub.GrantPlacement(pb.GrantPlacementRequest(num_ids=1, key="ws-key"), timeout=5)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_client_with_a_stale_map_follows_the_redirect(sharded):
    with KVClient(sharded.master) as kv:
        kv.put("stale-a", b"alpha")
        kv.put("stale-b", b"beta")
        # Pretend the client believes shard 1 owns everything (an old map).
        wrong = kv.shard_map.ranges[1].addresses[0]
        kv.shard_map = ShardMap.single(wrong)
        assert kv.batch_exists(["stale-a", "stale-b", "stale-none"]) == [True, True, False]
    with KVClient(sharded.master) as kv:      # a fresh metadata cache
        kv.shard_map = ShardMap.single(wrong)
        assert bytes(kv.get("stale-a")) == b"alpha"
        assert bytes(kv.get("stale-b")) == b"beta"
        assert len(kv.shard_map.ranges) == 2



def test_every_routed_call_refreshes_the_map_once_on_wrong_shard(sharded):
    """Puts (their placement grants), lookups, exists and removes all follow a
    WRONG_SHARD the same way: one shard map refresh, then those keys again."""
    keys = [f"stale-all-{i}" for i in range(20)]
    with KVClient(sharded.master, meta_cache_entries=0) as kv:
        wrong = kv.shard_map.ranges[1].addresses[0]
        assert {kv.shard_map.shard_for_key(k).shard_id for k in keys} == {0, 1}
        refreshes = []
        refresh = kv._control.refresh_shard_map
        kv._control.refresh_shard_map = lambda: (refreshes.append(1), refresh())[1]
        calls = [lambda: kv.batch_put(keys, [k.encode() for k in keys]) == [None] * len(keys),
                 lambda: all(not isinstance(m, KVStoreError) and m.key == k
                             for k, m in zip(keys, kv.lookup(keys))),
                 lambda: kv.batch_get(keys) == [k.encode() for k in keys],
                 lambda: all(kv.batch_exists(keys)),
                 lambda: kv.batch_remove(keys) == [None] * len(keys),
                 lambda: not any(kv.batch_exists(keys))]
        for n, call in enumerate(calls, 1):
            kv.shard_map = ShardMap.single(wrong)
            assert call()
            assert len(refreshes) == n and len(kv.shard_map.ranges) == 2


def test_a_second_wrong_shard_is_the_error_of_those_keys(sharded):
    with KVClient(sharded.master, meta_cache_entries=0) as kv:
        def on_shard(shard_id: int, tag: str) -> str:
            return next(f"stale-{tag}-{i}" for i in range(1000)
                        if kv.shard_map.shard_for_key(f"stale-{tag}-{i}").shard_id == shard_id)
        key0, key1, new0 = on_shard(0, "x"), on_shard(1, "x"), on_shard(0, "y")
        assert kv.batch_put([key0, key1], [b"0", b"1"]) == [None, None]
        # The client believes shard 1 owns everything, and so do the seeds.
        stale = ShardMap.single(kv.shard_map.ranges[1].addresses[0])
        kv._control.refresh_shard_map = lambda: setattr(kv._control, "shard_map", stale)
        kv.shard_map = stale
        miss, hit = kv.lookup([key0, key1])
        assert isinstance(miss, WrongShard) and miss.key == key0 and miss.redirect
        assert hit.key == key1
        (err,) = kv.batch_put([new0], [b"n"])
        assert isinstance(err, WrongShard) and err.key == new0
        with pytest.raises(WrongShard):
            kv.batch_exists([key0, key1])
        assert isinstance(kv.batch_remove([key0])[0], WrongShard)
        assert kv.batch_remove([key1]) == [None]

def test_node_events_go_to_the_shard_owning_the_key(sharded):
    with KVClient(sharded.master) as kv:
        keys = [f"rm-{i}" for i in range(40)]
        for k in keys:
            kv.put(k, b"x" * 1000)
        for k in keys:
            kv.remove(k)
        assert not any(kv.batch_exists(keys))
        # Drop orders reach the nodes through each shard's heartbeat replies.
        wait_for(lambda: sum(n.counters["drops"] for n in kv.stat()[0].nodes) >= len(keys),
                 timeout_s=5)
