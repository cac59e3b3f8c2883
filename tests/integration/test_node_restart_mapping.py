"""A long-lived same-host client lets go of a restarted node's segment.

A restarted node makes a new shared-memory segment; the old one is unlinked
and lives as long as some process maps it. A client thread that sits idle
(the RESP front keeps one per connection) used to keep its transport, and
with it the whole dead segment, for good: one segment's worth of memory per
node restart. Real processes, a real SIGKILL and restart, /proc/self/maps.
"""

from __future__ import annotations

import threading

from kvstore.client import KVClient
from kvstore.tools.cluster.launcher import start_store_cluster
from kvtest import wait_for


def _segments() -> set[str]:
    """The kvstore segments this process maps."""
    with open("/proc/self/maps") as f:
        return {line.split("/dev/shm/")[1].split()[0] for line in f
                if "/dev/shm/kvstore-" in line}


def test_an_idle_thread_does_not_keep_a_restarted_nodes_segment(tmp_path):
    with start_store_cluster(1, 1, dram="16MiB", log_dir=str(tmp_path)) as cluster, \
            KVClient(cluster.master, prefer_shm=True) as kv:
        kv.put("before", b"b" * 4096)
        assert kv.get("before") == b"b" * 4096
        old = _segments()
        assert len(old) == 1
        # Another thread reads through its own transport, then sits idle.
        go, idle_read, results = threading.Event(), threading.Event(), []

        def idle_worker():
            results.append(kv.get("before"))
            idle_read.set()
            go.wait(60)
            results.append(kv.get("after"))          # after the restart: reconnects

        worker = threading.Thread(target=idle_worker)
        worker.start()
        assert idle_read.wait(30)
        node = cluster.nodes["n0"].proc
        node.kill()
        node.wait()
        cluster.start_node("n0")

        def put_after() -> bool:
            try:
                kv.put("after", b"a" * 4096)
                return True
            except Exception:
                return False
        wait_for(put_after, timeout_s=30)
        assert kv.get("after") == b"a" * 4096
        # This thread's transport broke and was replaced: the old mapping is
        # gone although the idle thread's transport still held it.
        now = _segments()
        assert not now & old and len(now) == 1, (old, now)
        go.set()
        worker.join(30)
        assert results == [b"b" * 4096, b"a" * 4096]
        assert _segments() == now
