"""kvctl against the real cluster: JSON output, tables, errors and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kvstore.client import KVClient
from kvstore.keys import key_slot, value_checksum
from kvstore.tools.cli.kvctl import EXIT_NOT_FOUND, app

runner = CliRunner()


def kvctl(master: str | None, *args: str, env: dict | None = None):
    argv = (["--master", master] if master else []) + list(args)
    return runner.invoke(app, argv, env=env, prog_name="kvctl")


def kvctl_json(master: str, *args: str):
    result = kvctl(master, *args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture
def kv(master):
    with KVClient(master, prefer_shm=False) as client:
        yield client


@pytest.fixture
def objects(kv, key_prefix):
    """Three objects under a fresh prefix: key -> value."""
    values = {key_prefix + "a": b"A" * 3000, key_prefix + "b": bytes(5 * 1024 * 1024),
              key_prefix + "c": b""}
    assert kv.batch_put(list(values), list(values.values())) == [None] * 3
    return values


def test_nodes_json(master):
    out = kvctl_json(master, "nodes")
    assert [n["node_id"] for n in out["nodes"]] == ["n0", "n1"]
    for n in out["nodes"]:
        assert n["alive"] is True and n["tier"] == "DRAM"
        assert n["capacity_bytes"] == 64 * 1024 * 1024
        assert n["used_bytes"] + n["free_bytes"] == n["capacity_bytes"]
        assert isinstance(n["data_port"], int) and n["data_port"] > 0


def test_nodes_table(master):
    result = kvctl(master, "nodes")
    assert result.exit_code == 0, result.output
    assert "n0" in result.stdout and "n1" in result.stdout
    assert "MiB" in result.stdout


def test_ls_json_with_prefix_and_limit(master, objects, key_prefix):
    out = kvctl_json(master, "ls", key_prefix)
    assert [o["key"] for o in out["objects"]] == sorted(objects)
    assert [o["size_bytes"] for o in out["objects"]] == [len(v) for _, v in sorted(objects.items())]
    assert out["count"] == 3 and out["truncated"] is False
    assert all(o["replicas"][0]["node_id"] in ("n0", "n1") for o in out["objects"])
    limited = kvctl_json(master, "ls", key_prefix, "--limit", "2")
    assert [o["key"] for o in limited["objects"]] == sorted(objects)[:2]
    assert limited["truncated"] is True
    assert kvctl_json(master, "ls", key_prefix + "zzz")["objects"] == []


def test_ls_table_shows_human_sizes(master, objects, key_prefix):
    result = kvctl(master, "ls", key_prefix)
    assert result.exit_code == 0, result.output
    assert "5.0 MiB" in result.stdout and "2.9 KiB" in result.stdout
    assert key_prefix + "a" in result.stdout.replace("\n", "")


def test_inspect_json_does_not_count_an_access(master, kv, objects, key_prefix):
    key = key_prefix + "b"
    out = kvctl_json(master, "inspect", key)
    assert out["key"] == key and out["size_bytes"] == 5 * 1024 * 1024
    assert out["checksum"] == f"{value_checksum(objects[key]):016x}"
    assert out["slot"] == key_slot(key) and out["shard_id"] == 0
    assert len(out["replicas"]) == 1 and out["replicas"][0]["state"] == "COMPLETE"
    assert out["access_count"] == 0
    assert kvctl_json(master, "inspect", key)["access_count"] == 0
    kv.lookup([key])          # a master lookup counts (a get may use the client's metadata cache)
    assert kvctl_json(master, "inspect", key)["access_count"] == 1
    # A key that only prefixes others is not found.
    assert kvctl(master, "inspect", key_prefix).exit_code == EXIT_NOT_FOUND


def test_inspect_table(master, objects, key_prefix):
    result = kvctl(master, "inspect", key_prefix + "a")
    assert result.exit_code == 0, result.output
    assert "2.9 KiB (3000 B)" in result.stdout


def test_rm_and_evict(master, kv, objects, key_prefix):
    before = kvctl_json(master, "stats")["shards"][0]["counters"]
    assert kvctl_json(master, "rm", key_prefix + "a") == {
        "key": key_prefix + "a", "removed": True, "reason": "remove"}
    result = kvctl(master, "evict", key_prefix + "b")
    assert result.exit_code == 0 and "evicted" in result.stdout
    assert kv.batch_exists(sorted(objects)) == [False, False, True]
    after = kvctl_json(master, "stats")["shards"][0]["counters"]
    assert after["removes"] == before.get("removes", 0) + 1
    assert after["evicts"] == before.get("evicts", 0) + 1
    # Gone: a second rm is NotFound (exit 2) with one line on stderr.
    again = kvctl(master, "rm", key_prefix + "a")
    assert again.exit_code == EXIT_NOT_FOUND
    assert again.stdout == ""
    assert again.stderr.strip().count("\n") == 0 and "NotFound" in again.stderr


def test_stats_json(master, objects):
    out = kvctl_json(master, "stats")
    (shard,) = out["shards"]
    assert shard["shard_id"] == 0 and shard["address"] == master
    assert shard["nodes"] == shard["nodes_alive"] == 2
    assert shard["capacity_bytes"] == 2 * 64 * 1024 * 1024
    assert shard["num_objects"] >= 3 and shard["total_bytes"] >= 5 * 1024 * 1024 + 3000
    assert shard["counters"]["puts"] >= 3
    assert out["totals"]["num_objects"] == shard["num_objects"]
    table = kvctl(master, "stats")
    assert table.exit_code == 0 and "counters" in table.stdout


def test_master_from_environment(master):
    result = kvctl(None, "nodes", "--json", env={"KVSTORE_MASTER": master})
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)["nodes"]) == 2


def test_errors_exit_codes(master):
    bad_key = kvctl(master, "inspect", "")
    assert bad_key.exit_code == 1 and "InvalidArgument" in bad_key.stderr
    no_master = kvctl(None, "nodes", env={"KVSTORE_MASTER": ""})
    assert no_master.exit_code == 1 and "KVSTORE_MASTER" in no_master.stderr


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.tools.cli.kvctl", *args],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, **(env or {})))


def test_subprocess_json_and_errors(master, objects, key_prefix):
    """As a real process: JSON on stdout; errors are one stderr line and an exit code."""
    ok = _run("--master", master, "ls", key_prefix, "--json")
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["objects"]) == 3

    missing = _run("inspect", key_prefix + "missing", "--json", env={"KVSTORE_MASTER": master})
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.startswith("kvctl: error: NotFound") and "Traceback" not in missing.stderr
    assert missing.stderr.count("\n") == 1

    down = _run("--master", "127.0.0.1:1", "stats", "--json")
    assert down.returncode == 1 and down.stdout == ""
    assert down.stderr.startswith("kvctl: error: Unavailable") and "Traceback" not in down.stderr


def test_stats_counts_each_node_once_across_shards(tmp_path):
    # Every shard knows every node: the totals and the tier table must not add
    # the same node once per shard.
    from kvstore.tools.cluster.launcher import start_store_cluster
    c = start_store_cluster(masters=2, nodes=2, log_dir=str(tmp_path))
    try:
        out = kvctl_json(c.master, "stats")
        assert len(out["shards"]) == 2
        assert all(s["capacity_bytes"] == 2 * 64 * 1024 * 1024 for s in out["shards"])
        assert out["totals"]["capacity_bytes"] == 2 * 64 * 1024 * 1024
        assert out["totals"]["nodes_alive"] == 2
        table = kvctl(c.master, "stats")
        assert table.exit_code == 0, table.output
        dram = next(line for line in table.stdout.splitlines() if "DRAM" in line)
        assert "128.0 MiB" in dram and "256.0 MiB" not in dram
    finally:
        c.stop()


def test_piped_tables_never_wrap_a_row(master, kv, key_prefix):
    """stdout a pipe (a script, ``| cat``, a file): each row is one line, whole, however
    long its cells; rich would otherwise fold them at 80 columns (or $COLUMNS)."""
    key = key_prefix + "layer-31/" + "block-0123456789abcdef" * 8     # 200+ characters
    kv.put(key, b"v" * 3000)
    env = {"COLUMNS": "40"}                                # a narrow setting does not apply
    ls = _run("--master", master, "ls", key_prefix, env=env)
    assert ls.returncode == 0, ls.stderr
    (row,) = [line for line in ls.stdout.splitlines() if key in line]
    assert "2.9 KiB" in row and ":DRAM" in row             # the row's other cells too

    nodes = _run("--master", master, "nodes", env=env)
    assert nodes.returncode == 0, nodes.stderr
    for node in ("n0", "n1"):
        rows = [line.split() for line in nodes.stdout.splitlines() if line.startswith(node)]
        assert len(rows) == 2, nodes.stdout                # the node table and the tier table
        assert rows[0][1].startswith("127.0.0.1:") and rows[0][-2:] == ["s", "ago"], rows
        assert rows[1][1] == "DRAM" and len(rows[1]) == 13, rows    # 4 sizes, 3 counts

    stats = _run("--master", master, "stats", env=env)
    assert stats.returncode == 0, stats.stderr
    (shard,) = [line.split() for line in stats.stdout.splitlines() if master in line]
    assert shard[:2] == ["0", master] and "2/2" in shard, stats.stdout


def test_tables_keep_the_terminal_width(master):
    """On a terminal, rich sizes the tables to it, as before."""
    import fcntl
    import pty
    import re
    import struct
    import termios

    parent, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 60, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli.kvctl", "--master", master,
                             "nodes"], stdout=child, stderr=subprocess.PIPE, env=env)
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(parent, 65536)
        except OSError:                                    # EIO: the child closed its end
            break
        if not chunk:
            break
        out += chunk
    os.close(parent)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    proc.stderr.close()
    lines = re.sub(rb"\x1b\[[0-9;]*m", b"", out).decode().splitlines()
    assert any("n0" in line for line in lines)
    assert max(len(line.rstrip()) for line in lines) <= 60, lines
