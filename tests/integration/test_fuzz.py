"""``kvstore fuzz``, short: a fresh cluster with --auth, every surface, the invariants hold.

The long run is a command (README: ``kvstore fuzz --inputs 1000000``); this
one sends 2,000 inputs twice with one seed and checks that both runs sent
the same inputs (the per-surface SHA-256 in the report) and that nothing
broke: no process exit, no wrong or failed reference read, every surface
still answering, memory within 1.5x of its start.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.tools.faults.fuzz.report import SURFACES

# `kvstore fuzz` in a subprocess starts a cluster of its own (out of fastlane.py's sight).
pytestmark = pytest.mark.slow


def _fuzz(tmp_path, name: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "kvstore.tools.cli.cli", "fuzz", "--inputs", "2000",
                          "--seed", "1", "--json", "--log-dir", str(tmp_path / name)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_short_fuzz_run_breaks_nothing_and_is_reproducible(tmp_path):
    first = _fuzz(tmp_path, "first")
    assert first["passed"] and first["failures"] == []
    assert first["inputs"] == 2000 and first["batches"] == 2
    assert first["process_exits"] == {}
    assert first["wrong_bytes"] == 0 and first["failed_reads"] == 0 and first["reads"] > 0
    assert first["probe_failures"] == {}
    assert first["cross_tenant_tries"] > 0 and first["cross_tenant_reads"] == 0
    assert set(first["rss"]) == {"master", "node", "conductor", "resp"}
    assert all(0 < t["ratio"] <= 1.5 for t in first["rss"].values())
    for name in SURFACES:
        s = first["surfaces"][name]
        assert s["inputs"] > 0 and sum(s["answers"].values()) > 0, (name, s)
        assert s["unexpected"] == 0 and s["no_answer"] == 0, (name, s)
    again = _fuzz(tmp_path, "again")
    assert {n: s["inputs_sha256"] for n, s in again["surfaces"].items()} == \
        {n: s["inputs_sha256"] for n, s in first["surfaces"].items()}
