"""``kvstore chaos``, short (issue 5, step 6): kill -9 a node, then a shard leader,
under one writer and two readers. Every acknowledged put stays readable with
its bytes, no read ever returns wrong bytes, and puts and reads resume within
15 s of each kill."""

from __future__ import annotations

import shutil

import pytest

from kvstore.tools.faults.chaos import run_chaos


@pytest.mark.skipif(shutil.which("etcd") is None,
                    reason="etcd is not on PATH (apt-get install etcd-server); .ci/run installs it")
def test_chaos_short(tmp_path):
    report = run_chaos(duration_s=16.0, kill_node_at_s=3.0, kill_leader_at_s=8.0,
                       log_dir=str(tmp_path))
    print(report.to_dict())
    assert report.acked_puts > 100
    assert report.lost == 0
    assert report.wrong_reads == 0
    assert report.reads > 100
    assert 0 <= report.failover_s < 15
    assert report.max_recovery_s < 15
