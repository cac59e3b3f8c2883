"""``kvstore up``: a multi-shard cluster in the foreground until Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from kvstore.client.client import KVClient

# `kvstore up` in a subprocess starts a cluster (out of fastlane.py's sight).
pytestmark = pytest.mark.slow


def test_up_prints_addresses_serves_and_stops_on_ctrl_c(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli.cli", "up", "--masters", "2",
                             "--nodes", "2", "--dram", "32MiB", "--log-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, COLUMNS="200"), start_new_session=True)
    try:
        seed = None
        deadline = time.monotonic() + 40
        lines = []
        while seed is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"KVClient\('([^']+)'\)", line)
            if m:
                seed = m.group(1)
        assert seed, "".join(lines)
        assert any("shard map:" in ln for ln in lines)
        with KVClient(seed) as kv:
            assert len(kv.shard_map.ranges) == 2
            for i in range(20):
                kv.put(f"up-{i}", b"v%d" % i)
            assert [bytes(kv.get(f"up-{i}")) for i in range(20)] == [b"v%d" % i for i in range(20)]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
