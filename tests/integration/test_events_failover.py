"""The store's event log across a failover (etcd leader election): the standby that
takes over starts a new log under a larger epoch, and a watcher is told it lost
events instead of being resumed silently into another log."""

from __future__ import annotations

import shutil

import pytest

from kvstore.client import KVClient
from kvstore.client.events import EventWatcher, Lost
from kvstore.tools.cluster.launcher import start_store_cluster
from kvstore.tools.faults.chaos import serving
from waits import wait_until

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None,
                                reason="etcd is not on PATH (apt-get install etcd-server); "
                                       ".ci/run installs it")


def test_a_failover_starts_a_new_epoch_and_the_watcher_is_told(tmp_path):
    with start_store_cluster(masters=1, nodes=1, standbys=1, etcd="local", node_ttl_ms=2000,
                             log_dir=str(tmp_path)) as c:
        leader = wait_until(lambda: next((m for m in c.shards[0] if serving(m.address)), None),
                            timeout_s=20, what="a leader")
        with KVClient(c.master, prefer_shm=False) as kv, \
                EventWatcher(c.master, oldest=True, resume_after_loss=True) as w:
            kv.put("before", b"1")
            got = []
            wait_until(lambda: got.extend(w.events(timeout_s=0.2)) or got, timeout_s=20,
                       what="the event before the failover")
            leader.proc.kill()
            leader.proc.wait()
            kv.put("after", b"2")                # waits for the standby to take over
            wait_until(lambda: got.extend(w.events(timeout_s=0.2)) or len(got) >= 3,
                       timeout_s=60, what="the loss and the event after the failover")
    before, lost, after = got[:3]
    assert (before.kind, before.key, before.seq) == ("STORED", "before", 1)
    assert isinstance(lost, Lost) and lost.shard_id == 0 and "epoch" in lost.reason
    assert (after.kind, after.key, after.seq) == ("STORED", "after", 1)
    assert after.epoch > before.epoch
