"""Bad input to the command lines ends in one line on stderr and status 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvstore.client import KVClient
from kvstore.errors import InvalidArgument
from kvstore.shardmap import ShardMap

CASES = [
    # (argv after python -m, what the line says)
    (["kvstore.tools.cli", "certs", "/proc/no-such-folder", "--host", "10.0.0.1"],
     "No such file or directory"),
    (["kvstore.tools.cli", "demo", "--block-tokens", "0", "--requests", "1"], "--block-tokens"),
    (["kvstore.tools.cli", "demo", "--node-dram", "banana", "--requests", "1"], "not a byte size"),
    (["kvstore.tools.services", "node", "--master", "127.0.0.1:99999"], "port 1-65535"),
    (["kvstore.tools.services", "node", "--master", "127.0.0.1", "--check-config"],
     "not an address"),
    (["kvstore.tools.services", "master", "--shard-map", "garbage"], "not an address"),
    (["kvstore.tools.services", "master", "--node-ttl-ms", "-5", "--check-config"],
     "--node-ttl-ms"),
    (["kvstore.tools.services", "master", "--shard-id", "5", "--check-config"], "--shard-id"),
    (["kvstore.tools.services", "node", "--master", "127.0.0.1:1", "--dram", "99999999GiB",
      "--check-config"], "shared memory has"),
]


@pytest.mark.parametrize("argv,says", CASES, ids=[" ".join(c[0][1:3]) for c in CASES])
def test_bad_input_is_one_line_and_status_2(argv, says):
    r = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_an_address_out_of_range_is_refused_not_wrapped():
    # gRPC would dial 127.0.0.1:34463 for :99999.
    with pytest.raises(InvalidArgument, match="port 1-65535"):
        with KVClient("127.0.0.1:99999") as kv:
            kv.exists("k")
    with pytest.raises(ValueError, match="not an address"):
        ShardMap.parse("127.0.0.1:1,nohost")
