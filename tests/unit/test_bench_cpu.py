"""Tests for kvstore.tools.bench.cpu and the harness's CPU fields: readings and arithmetic.

No timing value is asserted: only that CPU readings exist, move forward, agree
with /proc within its tick, and turn into µs per value and per GiB exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstore.tools.bench.cpu import (PROC_TICK_S, CpuMeter, add_cpu, cpu_used, proc_stat_cpu_s,
                                     this_process)
from kvstore.tools.bench.harness import (GiB, DataPath, Op, Row, System, Timing, rate_row,
                                         timed, timed_interleaved, timed_row, with_cpu)


def _spin(n: int = 200_000) -> int:
    return sum(i * i for i in range(n))


def test_meter_reads_this_process_and_agrees_with_proc_stat():
    meter = this_process()
    before = meter.sample()
    _spin()
    used = cpu_used(before, meter.sample())
    assert set(used) == {"client"} and used["client"] > 0
    # The clock and utime + stime count the same run time; /proc rounds to its tick.
    clock, stat = meter.sample()["client"], proc_stat_cpu_s(os.getpid())
    assert abs(clock - stat) < 0.05 * clock + 3 * PROC_TICK_S
    assert meter.tick_s < PROC_TICK_S


def test_meter_reads_another_process_and_leaves_out_a_gone_one():
    child = subprocess.Popen([sys.executable, "-c", "sum(i * i for i in range(3_000_000))"])
    child.wait()
    meter = CpuMeter({"child": child.pid, "client": os.getpid()})
    assert set(meter.sample()) == {"client"}      # reaped: no reading rather than a wrong one
    sleeper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE)
    try:
        meter = CpuMeter({"sleeper": sleeper.pid})
        assert meter.sample()["sleeper"] >= 0.0
    finally:
        sleeper.stdin.close()
        sleeper.wait()


def test_proc_stat_parses_a_command_name_with_spaces_and_parentheses(tmp_path):
    # comm may hold ") (": the fields are counted from the last ")".
    exe = tmp_path / "a) (b"
    exe.symlink_to(sys.executable)
    child = subprocess.Popen([str(exe), "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)
    try:
        assert proc_stat_cpu_s(child.pid) >= 0.0
    finally:
        child.stdin.close()
        child.wait()


def test_add_cpu_sums_per_name():
    assert add_cpu({"node": 1.0, "client": 0.5}, {"node": 2.0}, {}) == {"node": 3.0,
                                                                       "client": 0.5}


def test_with_cpu_gives_us_per_value_and_per_gib():
    row = rate_row(System.KVSTORE, DataPath.TCP, Op.PUT, 64 * 1024, 100, 1.0)
    out = with_cpu(row, {"node": 0.002, "client": 0.001}, 100, 1e-9)
    assert out.cpu_us_per_op == pytest.approx({"node": 20.0, "client": 10.0})
    gib = 100 * 64 * 1024 / GiB
    assert out.cpu_us_per_gib == pytest.approx({"node": 2000.0 / gib, "client": 1000.0 / gib})
    assert out.cpu_resolution_us == pytest.approx(1e-5)
    assert with_cpu(row, {}, 100, 1e-9) is row                   # not metered
    exists = Row(System.KVSTORE, DataPath.TCP, Op.EXISTS, 0, 0.0, 1e5)
    assert with_cpu(exists, {"master": 0.001}, 1000, 1e-9).cpu_us_per_gib == {}
    d = out.to_dict()
    assert d["cpu_us_per_op"] == out.cpu_us_per_op and d["cpu_us_per_gib"] == out.cpu_us_per_gib


def test_timed_rows_count_every_timed_round_for_cpu():
    t = timed(lambda i: _spin(2_000), 0.03, 0.0, rounds=3, cpu=this_process())
    assert t.timed_ops >= t.ops > 0 and t.cpu_s["client"] > 0
    row = timed_row(System.MEMCPY, DataPath.COLD, Op.GET, 1024, t, values_per_iter=2)
    assert row.cpu_us_per_op["client"] == pytest.approx(
        t.cpu_s["client"] * 1e6 / (2 * t.timed_ops))
    a, b = timed_interleaved([lambda i: _spin(2_000), lambda i: None], 0.02, 0.0, 2,
                             [this_process(), None])
    assert a.cpu_s["client"] > 0 and a.timed_ops > 0 and b.cpu_s == {}
    assert timed_row(System.MEMCPY, DataPath.COLD, Op.GET, 1024,
                     Timing(1, 1.0, 1, 0.0)).cpu_us_per_op == {}
