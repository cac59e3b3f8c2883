"""A master with no standby restarts (issue 5, step 7).

Its index is gone; the nodes notice (heartbeats answered "unknown"),
register again with their inventories, and the new master rebuilds the
index from them: old keys are readable again, and new object ids start
above every id in the inventories, so new puts never overwrite old objects.
"""

from __future__ import annotations

import time

from kvstore.client.client import KVClient
from kvstore.errors import KVStoreError
from kvstore.tools.cluster.launcher import start_store_cluster
from kvtest import wait_for


def test_restarted_master_rebuilds_from_inventories(tmp_path):
    c = start_store_cluster(masters=2, nodes=2, log_dir=str(tmp_path))
    try:
        old = {f"old-{i}": f"old value {i}".encode() * 20 for i in range(100)}
        with KVClient(c.master, replica_num=2) as kv:
            for k, v in old.items():
                kv.put(k, v)
            ids_before = {m.key: m.object_id for m in kv.lookup(list(old))}
        # Restart shard 0's master (SIGKILL, same port): its index is empty now.
        c.shards[0][0].proc.kill()
        c.shards[0][0].proc.wait()
        c.restart_master(0)

        def all_back() -> bool:
            with KVClient(c.master) as probe:
                return all(not isinstance(m, KVStoreError) and len(m.replicas) == 2
                           for m in probe.lookup(list(old)))
        wait_for(all_back, timeout_s=10, interval_s=0.2)
        with KVClient(c.master, prefer_shm=False) as kv:
            for k, v in old.items():
                assert bytes(kv.get(k)) == v
            assert {m.key: m.object_id for m in kv.lookup(list(old))} == ids_before
            new = {f"new-{i}": f"new value {i}".encode() * 20 for i in range(100)}
            for k, v in new.items():
                assert kv.put(k, v)
            # Ids of shard 0's new puts are above every id it learned from inventories.
            shard0_old = [ids_before[k] for k in old if kv.shard_map.shard_for_key(k).shard_id == 0]
            shard0_new = [m.object_id for m in kv.lookup(list(new))
                          if kv.shard_map.shard_for_key(m.key).shard_id == 0]
            assert min(shard0_new) > max(shard0_old)
            time.sleep(1.0)                            # drop orders, if any, would have landed
            for k, v in old.items():
                assert bytes(kv.get(k)) == v
            for k, v in new.items():
                assert bytes(kv.get(k)) == v
    finally:
        c.stop()


def test_a_rebuilt_master_repairs_keys_to_the_count_their_puts_asked_for(tmp_path):
    # The master dies, then a node: the new master learns each key from its one
    # surviving replica, and that node's inventory says the put asked for 2, so
    # repair copies it to the third node (a master that counted only what it found
    # would leave these keys on one node for good).
    c = start_store_cluster(1, 3, log_dir=str(tmp_path))
    try:
        values = {f"k-{i}": f"value {i}".encode() * 20 for i in range(30)}
        with KVClient(c.master, replica_num=2, prefer_shm=False) as kv:
            for k, v in values.items():
                kv.put(k, v)
            victim = kv.lookup(["k-0"])[0].replicas[0].node.node_id
        c.shards[0][0].proc.kill()
        c.shards[0][0].proc.wait()
        c.nodes[victim].proc.kill()
        c.nodes[victim].proc.wait()
        c.restart_master(0)

        def all_repaired() -> bool:
            with KVClient(c.master) as probe:
                metas = probe.lookup(list(values))
            return all(not isinstance(m, KVStoreError) and len(m.replicas) == 2
                       and victim not in {r.node.node_id for r in m.replicas} for m in metas)
        wait_for(all_repaired, timeout_s=30, interval_s=0.3)
        with KVClient(c.master, prefer_shm=False) as kv:
            for k, v in values.items():
                assert bytes(kv.get(k)) == v
    finally:
        c.stop()
