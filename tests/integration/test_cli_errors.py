"""Bad input to the command lines ends in one line on stderr and status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstore.client import KVClient
from kvstore.errors import InvalidArgument
from kvstore.shardmap import ShardMap
from waits import wait_until

CASES = [
    # (argv after python -m, what the line says)
    (["kvstore.tools.cli.cli", "certs", "/proc/no-such-folder", "--host", "10.0.0.1"],
     "No such file or directory"),
    (["kvstore.tools.cli.cli", "demo", "--block-tokens", "0", "--requests", "1"], "--block-tokens"),
    (["kvstore.tools.cli.cli", "demo", "--node-dram", "banana", "--requests", "1"],
     "not a byte size"),
    # kvstore up checks --dram before it starts a process (a master was left to fail alone)
    (["kvstore.tools.cli.cli", "up", "--dram", "abc"], "not a byte size"),
    (["kvstore.tools.cli.cli", "up", "--dram", "0"], "larger than 0 B"),
    (["kvstore.tools.cli.cli", "up", "--dram", "1000TiB"], "shared memory has"),
    (["kvstore.tools.cli.services", "node", "--master", "127.0.0.1:99999"], "port 1-65535"),
    (["kvstore.tools.cli.services", "node", "--master", "127.0.0.1", "--check-config"],
     "not an address"),
    (["kvstore.tools.cli.services", "master", "--shard-map", "garbage"], "not an address"),
    (["kvstore.tools.cli.services", "master", "--node-ttl-ms", "-5", "--check-config"],
     "--node-ttl-ms"),
    (["kvstore.tools.cli.services", "master", "--shard-id", "5", "--check-config"], "--shard-id"),
    (["kvstore.tools.cli.services", "node", "--master", "127.0.0.1:1", "--dram", "99999999GiB",
      "--check-config"], "shared memory has"),
    (["kvstore.tools.cli.services", "node", "--master", "127.0.0.1:1", "--busy-poll-us", "-1",
      "--check-config"], "--busy-poll-us must be within 0 to 1000000"),
]
# The RESP front: every numeric option bounded, argparse's own errors one line too.
_RESP = ["kvstore.tools.cli.services", "resp", "--master", "127.0.0.1:1", "--check-config"]
CASES += [
    (_RESP + ["--max-bulk", "0"], "--max-bulk must be 1KiB to 512MiB"),
    (_RESP + ["--max-bulk", "1023"], "--max-bulk must be 1KiB to 512MiB"),
    (_RESP + ["--max-bulk", "513MiB"], "--max-bulk must be 1KiB to 512MiB"),
    (_RESP + ["--max-bulk", "1000TiB"], "got 1000TiB"),
    (_RESP + ["--max-bulk", "-1"], "--max-bulk: not a byte size"),
    (_RESP + ["--max-clients", "0"], "--max-clients must be 1 to 65536"),
    (_RESP + ["--max-clients", "10000000"], "--max-clients must be 1 to 65536"),
    (_RESP + ["--max-clients", "many"], "--max-clients: invalid int value"),
    (_RESP + ["--port", "99999"], "99999 is not a port"),
    (_RESP + ["--port", "-1"], "-1 is not a port"),
    (_RESP + ["--port", "http"], "'http' is not a port"),
    (_RESP + ["--replica-num", "0"], "--replica-num must be in [1, 16], got 0"),
    (_RESP + ["--no-such-option"], "unrecognized arguments"),
    (["kvstore.tools.cli.cli", "resp", "--master", "127.0.0.1:1", "--max-bulk", "1000TiB"],
     "kvstore resp: error: --max-bulk must be 1KiB to 512MiB"),
    (["kvstore.tools.cli.cli", "resp", "--master", "127.0.0.1:1", "--max-bulk", "-5GiB"],
     "--max-bulk: expected one argument"),
]


def _case_id(argv: list[str]) -> str:
    if argv[1] == "resp":              # what varies: the entry point and the option
        rest = [a for a in argv[2:] if a not in _RESP]
        return " ".join([argv[0].rsplit(".", 1)[1], "resp", *rest])
    return " ".join(argv[1:3])


@pytest.mark.parametrize("argv,says", CASES, ids=[_case_id(c[0]) for c in CASES])
def test_bad_input_is_one_line_and_status_2(argv, says):
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("option,value", [("--max-bulk", "1KiB"), ("--max-bulk", "512MiB"),
                                          ("--max-clients", "65536"), ("--port", "65535")])
def test_resp_bounds_are_inclusive(option, value):
    r = subprocess.run([sys.executable, "-m", *_RESP, option, value], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "configuration ok" in r.stdout, r.stderr


def test_an_address_out_of_range_is_refused_not_wrapped():
    # gRPC would dial 127.0.0.1:34463 for :99999.
    with pytest.raises(InvalidArgument, match="port 1-65535"):
        with KVClient("127.0.0.1:99999") as kv:
            kv.exists("k")
    with pytest.raises(ValueError, match="not an address"):
        ShardMap.parse("127.0.0.1:1,nohost")


def test_a_node_waiting_for_its_master_stops_on_sigterm():
    # Linking to an unreachable master waits up to 30 s; SIGTERM (or Ctrl-C) meanwhile
    # stopped the node only after that wait.
    import signal

    node = subprocess.Popen([sys.executable, "-m", "kvstore.tools.cli.services", "node",
                             "--master", "127.0.0.1:1", "--dram", "16MiB"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # The node catches SIGTERM from just before it links to its masters.
        wait_until(lambda: _catches(node.pid, signal.SIGTERM), timeout_s=60,
                   what="the node to handle SIGTERM")
        node.send_signal(signal.SIGTERM)
        # The link alone would wait 30 s: a node still up at 20 s did not obey at once.
        _, err = node.communicate(timeout=20)
    finally:
        node.kill()
    assert "stopped before a master answered" in err and "Traceback" not in err


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``sig`` (Linux: SigCgt)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (sig - 1) & 1)
