"""``kvstore bench`` end to end: one tiny run against its own cluster, then its rows and tables.

The run uses one small size, a 4 MiB rotation pool and 50 ms budgets: it
checks what the benchmark reports and that it tears down, not the numbers.
A second, leaner run with ``tls=True`` (no Redis, one round of 20 ms) checks
the ``+tls`` rows, their ratios to the plain rows and the progress count.
"""

from __future__ import annotations

import math
import shutil

import pytest
from typer.testing import CliRunner

from kvstore.tools.bench.command import bench_command, num_steps, run_bench
from kvstore.tools.bench.harness import OPS, PATHS, SYSTEMS
from kvstore.tools.bench.mooncake_peer import master_binary
from kvstore.tools.bench.report import check_targets, render, tls_vs_plain

SIZE_BYTES = 64 * 1024
KEYS = {"system", "path", "op", "size_bytes", "gbps", "ops_per_s", "cpu_us_per_op",
        "cpu_us_per_gib", "cpu_resolution_us"}
#: The processes each system's rows meter (the socket peer's server, Mooncake's holder...).
PROCESSES = {"memcpy": {"client"}, "socket": {"server", "client"},
             "redis": {"redis-server", "client"}, "mooncake": {"master", "holder", "client"},
             "kvstore": {"node", "master", "client"}}


def _redis_available() -> bool:
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    return shutil.which("redis-server") is not None


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    notes: list[str] = []
    out = run_bench([SIZE_BYTES], duration_s=0.05, warmup_s=0.01, clients=2, exists_keys=100,
                    pool_bytes=4 << 20, max_put_bytes=8 << 20, node_dram="256MiB",
                    note=notes.append)
    assert any("verify checksums: tcp only" in n for n in notes)
    return out


def test_rows_follow_the_json_schema(rows):
    for r in rows:
        assert set(r) == KEYS
        assert r["system"] in SYSTEMS and r["path"] in PATHS and r["op"] in OPS
        assert isinstance(r["size_bytes"], int)
        assert isinstance(r["gbps"], float) and isinstance(r["ops_per_s"], float)
        assert r["ops_per_s"] > 0 and r["gbps"] >= 0


def test_rows_give_cpu_per_process(rows):
    """Every row names its system's processes with finite, non-negative µs of CPU per
    value and per GiB (none per GiB for exists and lookup); work that must cost CPU shows some."""
    for r in rows:
        per_op, per_gib = r["cpu_us_per_op"], r["cpu_us_per_gib"]
        assert set(per_op) == PROCESSES[r["system"]], r
        assert set(per_gib) == (set(per_op) if r["size_bytes"] else set())
        for v in (*per_op.values(), *per_gib.values(), r["cpu_resolution_us"]):
            assert isinstance(v, float) and math.isfinite(v) and v >= 0
        if r["size_bytes"]:
            for name, us in per_op.items():   # per GiB is per value scaled by values per GiB
                assert per_gib[name] == pytest.approx(us * (1 << 30) / r["size_bytes"])
        assert per_op["client"] > 0           # the timed loop runs there
    for key in (("kvstore", "tcp", "put"), ("kvstore", "concurrent", "put"),
                ("redis", "tcp", "put")):
        found = [r for r in rows if (r["system"], r["path"], r["op"]) == key]
        if found:                             # redis: when installed
            assert all(v > 0 for v in found[0]["cpu_us_per_op"].values()), found[0]


def test_every_measurement_is_there_once(rows):
    got = [(r["system"], r["path"], r["op"], r["size_bytes"]) for r in rows]
    assert len(got) == len(set(got))
    expected = {("memcpy", "cold", "get")}
    expected |= {("socket", p, op) for p in ("reqresp", "stream") for op in ("get", "put")}
    expected |= {("kvstore", p, op) for p in ("shm", "tcp", "tcp-batch", "concurrent",
                                              "async-16", "async-64", "async-16-shm")
                 for op in ("get", "put")}
    if _redis_available():
        expected |= {("redis", "tcp", "get"), ("redis", "tcp", "put")}
    if master_binary() is not None:
        expected |= {("mooncake", "tcp", "get"), ("mooncake", "tcp", "put")}
    assert {g[:3] for g in got if g[3] == SIZE_BYTES} == expected
    assert ("kvstore", "tcp", "exists", 0) in got
    assert ("kvstore", "tcp", "lookup", 0) in got
    for r in rows:
        if r["size_bytes"]:
            assert r["gbps"] == pytest.approx(r["ops_per_s"] * r["size_bytes"] / 1e9)


def test_tables_and_targets_render(rows):
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(render(rows, verify=True))
    text = console.export_text()
    assert "vs limit: shm / cold memcpy" in text
    assert "targets (issues 4, 14, 16 and 33)" in text
    assert "µs/op" in text and "s/GiB" in text
    targets = {t[0]: t for t in check_targets(rows)}
    assert "batch_exists >= 200k keys/s" in targets
    assert "tcp-batch get >= 0.5x socket stream" in targets   # the 64 KiB target
    for name in ("tcp put: node CPU <= 20 us/op", "tcp get: node CPU <= 10 us/op"):
        _, size, value, _ok = targets[name]
        assert size == SIZE_BYTES and value is not None and value > 0


@pytest.fixture(scope="module")
def tls_run() -> tuple[list[dict], list[str]]:
    labels: list[str] = []
    out = run_bench([SIZE_BYTES], duration_s=0.02, warmup_s=0.005, rounds=1, clients=1,
                    exists_keys=100, pool_bytes=4 << 20, max_put_bytes=4 << 20,
                    node_dram="256MiB", use_redis=False, use_mooncake=False, tls=True,
                    progress=labels.append)
    return out, labels


def test_tls_rows_sit_beside_their_plain_twins(tls_run, rows):
    tls_rows, labels = tls_run
    got = [(r["system"], r["path"], r["op"], r["size_bytes"]) for r in tls_rows]
    assert len(got) == len(set(got))
    twins = {(p, op) for p in ("tcp", "tcp-batch") for op in ("get", "put")}
    assert {g[1:3] for g in got if "+tls" in g[1]} == {(f"{p}+tls", op) for p, op in twins}
    assert all(g[0] == "kvstore" and g[3] == SIZE_BYTES for g in got if "+tls" in g[1])
    assert {g[1:3] for g in got if g[0] == "kvstore" and g[3]} >= twins   # the plain rows too
    pairs = tls_vs_plain(tls_rows)
    assert {(p["path"], p["op"]) for p in pairs} == twins
    for p in pairs:
        assert p["size_bytes"] == SIZE_BYTES
        assert p["tls_over_plain"] == pytest.approx(p["tls_ops_per_s"] / p["plain_ops_per_s"])
        assert p["tls_over_plain"] > 0
    assert len(labels) == num_steps(1, use_redis=False, use_mooncake=False, tls=True)
    assert tls_vs_plain(rows) == []            # a run without --tls has no pairs


def test_tls_table_renders(tls_run, rows):
    from rich.console import Console

    # 120 columns hold every table whole (the measurements with their CPU columns):
    # no cell cut short.
    console = Console(record=True, width=120)
    console.print(render(tls_run[0], verify=None))
    text = console.export_text()
    assert "tls/plain" in text and "tcp-batch+tls" in text
    assert "…" not in text
    console = Console(record=True, width=160)
    console.print(render(rows, verify=None))
    assert "tls/plain" not in console.export_text()


def test_command_options_parse():
    import typer

    app = typer.Typer()
    app.command("bench")(bench_command)
    app.command("other")(lambda: None)   # two commands, so "bench" is a subcommand
    result = CliRunner().invoke(app, ["bench", "--help"])
    assert result.exit_code == 0
    for flag in ("--json", "--no-verify", "--duration-s", "--sizes", "--tls"):
        assert flag in result.output
