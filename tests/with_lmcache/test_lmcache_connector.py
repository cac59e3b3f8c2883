"""LMCache's own redis:// remote connector against ``kvstore resp`` (issue 16).

LMCache 0.5.6 installs and imports on this CPU machine, but only in an
environment of its own: it pins grpcio and protobuf below kvstore's and pulls
its CUDA wheels (cupy, cuda-python). So its connector runs in a process with
the interpreter named by $KVSTORE_LMCACHE_PYTHON (a virtual environment with
``lmcache==0.5.6``, as .ci/run builds), talking RESP to a front over the
test's real master and node; skipped when that is not set.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvstore.client import KVClient
from kvstore.tools.cluster.processes import ProcessGroup, service_args

PYTHON = os.environ.get("KVSTORE_LMCACHE_PYTHON")
if not PYTHON:
    pytest.skip("LMCache is not installed here: make a virtual environment with "
                "`pip install lmcache==0.5.6` and set KVSTORE_LMCACHE_PYTHON=VENV/bin/python",
                allow_module_level=True)
RUN = Path(__file__).with_name("lmcache_run.py")


def test_lmcache_redis_connector_stores_and_reads_kv_through_the_front(cluster, tmp_path):
    if not os.access(PYTHON, os.X_OK):
        pytest.fail(f"KVSTORE_LMCACHE_PYTHON={PYTHON} is not an executable")
    with ProcessGroup(str(tmp_path)) as procs:
        front = procs.start("resp", service_args("resp", "--master", cluster.master))
        out = subprocess.run([PYTHON, str(RUN), f"redis://127.0.0.1:{front.info['port']}", "6"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        result = json.loads(out.stdout.strip().splitlines()[-1])
        procs.check()
    assert result == {"chunks": 6, "exists_before": 0, "exists_after": 6, "equal": 6,
                      "missing": 0}
    # The chunks are kvstore objects: LMCache's two keys per chunk, in the store.
    with KVClient(cluster.master) as kv:
        names = [m.key for m in kv.list()]
    assert sum(name.endswith("kv_bytes") for name in names) >= 6
    assert sum(name.endswith("metadata") for name in names) >= 6
