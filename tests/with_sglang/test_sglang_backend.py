"""KVStoreHiCacheStorage built by SGLang's own StorageBackendFactory ("dynamic"),
in SGLang's interpreter, against a real kvstore master and node.

Each SGLang side is its own process (tests/with_sglang/sglang_run.py, run by
the python of $KVSTORE_SGLANG_PYTHON: a virtual environment made by
``tools/cluster/sglang_env.py``, as .ci/run builds it); skipped when it is not
set. This process needs no SGLang: it runs the store and checks the reports.
"""

import hashlib
import json
import os
import struct
import subprocess
import time
from pathlib import Path

import pytest

from kvstore.tools.cluster.launcher import start_store_cluster


def _sglang_python() -> str:
    named = os.environ.get("KVSTORE_SGLANG_PYTHON")
    if not named:
        pytest.skip("no SGLang environment: build it with `python3 tools/cluster/sglang_env.py "
                    "VENV` and set KVSTORE_SGLANG_PYTHON=VENV/bin/python",
                    allow_module_level=True)
    if not os.access(named, os.X_OK):
        pytest.fail(f"KVSTORE_SGLANG_PYTHON={named} is not an executable")
    return named


PYTHON = _sglang_python()
RUN = Path(__file__).with_name("sglang_run.py")
SET_PAGES, ALL_PAGES = 8, 12             # sglang_run.py's SET_PAGES and TOKENS' pages
RANKS = ("mha0", "mha1", "mla0", "mla1")


def _run(tmp: Path, mode: str, master: str) -> dict:
    out = tmp / f"{mode}.json"
    t0 = time.monotonic()
    proc = subprocess.run([PYTHON, str(RUN), mode, master, str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert proc.returncode == 0, proc.stderr[-4000:]
    print(f"sglang_run.py {mode}: {time.monotonic() - t0:.1f} s")
    return json.loads(out.read_text())


def _sha256_chain(tokens: list[int], page: int) -> list[str]:
    """SGLang's page hashes as the issue describes them: SHA-256 chained over each
    page's 4-byte little-endian token ids (a last partial page gets one too)."""
    prev, out = b"", []
    for i in range(0, len(tokens), page):
        prev = hashlib.sha256(prev + struct.pack(f"<{len(tokens[i:i + page])}I",
                                                 *tokens[i:i + page])).digest()
        out.append(prev.hex())
    return out


def _keys_agree(*reports: dict) -> None:
    """SGLang's own key vectors (tokens 1..10, page 4, computed by its wheel's
    get_hash_str) and their kvstore keys are the same in every process."""
    for r in reports:
        assert r["hashes"] == _sha256_chain(list(range(1, 11)), 4)
        assert r["keys"] == reports[0]["keys"]
    keys = reports[0]["keys"]
    assert len(keys["mha0"]) == 2 * 3 and len(keys["mla0"]) == 3
    assert not set(keys["mha0"]) & set(keys["mha1"])          # MHA: a copy per rank
    assert keys["mla0"] == keys["mla1"]                       # MLA: one copy for all ranks
    assert not set(keys["mha0"]) & set(keys["mla0"])          # two models share nothing


def test_pages_set_in_one_process_are_read_byte_exact_in_another_and_a_dead_node_misses(
        tmp_path):
    with start_store_cluster(1, 1, node_ttl_ms=30_000, log_dir=str(tmp_path)) as cluster:
        put = _run(tmp_path, "set", cluster.master)
        got = _run(tmp_path, "get", cluster.master)
        _keys_agree(put, got)
        for name in RANKS:
            assert put[name]["results"] == [True] * SET_PAGES, put[name]
            assert put[name]["again"] == [True] * SET_PAGES, put[name]
            assert put[name]["legacy"] is True
        # Writes: every MHA rank its own pages, the MLA writer (rank 0) once, rank 1 none.
        assert put["mha1"]["stats"]["pages_written"] == SET_PAGES
        assert put["mla0"]["stats"]["pages_written"] == SET_PAGES
        assert put["mla1"]["stats"]["pages_written"] == 0
        # The second set found every page stored and wrote nothing.
        assert put["mha0"]["stats"]["pages_present"] == SET_PAGES
        assert put["mha0"]["stats"]["pages_written"] == SET_PAGES
        for name in RANKS:
            g = got[name]
            # batch_exists counts the stored prefix of the 12 pages asked.
            assert g["exists"] == SET_PAGES, (name, g)
            assert g["read"] == [True] * SET_PAGES, (name, g)
            assert g["exact"] == [True] * SET_PAGES, (name, g)      # rank 1 of MLA: rank 0's
            assert g["stats"]["errors"] == 0 and g["metrics_pgs"] == [SET_PAGES]
            # The legacy (copying) interface: flat pages, MLA rank 1 reading rank 0's.
            assert g["legacy_exact"] == [True, True] and g["legacy_fresh"] is True, (name, g)
            assert g["exists_one"] == [True, False]

        clear = _run(tmp_path, "clear", cluster.master)
        cleared = clear["mha0"]
        assert cleared == {"other_before": 1, "first_tenant": 0, "cleared": True,
                           "other_after": 0, "first_tenant_kept": SET_PAGES}

        # The node dies; the master still lists its objects for its TTL.
        node = cluster.nodes["n0"].proc
        node.kill()
        node.wait()
        for segment in Path("/dev/shm").glob(f"kvstore-{node.pid}-*"):
            segment.unlink(missing_ok=True)   # a SIGKILLed node cannot unlink its own
        dead = _run(tmp_path, "dead", cluster.master)
    _keys_agree(put, got, clear, dead)                   # four processes, one mapping
    for name in RANKS:
        d = dead[name]
        assert d["read"] == [False] * SET_PAGES, (name, d)        # misses, no exception
        assert d["exists"] in (0, SET_PAGES), (name, d)
    for name in ("mha0", "mha1", "mla0"):                          # the writers
        assert dead[name]["written"] == [False] * (ALL_PAGES - SET_PAGES), dead[name]
        assert dead[name]["stats"]["errors"] >= 1
    assert dead["mla1"]["written"] == [True] * (ALL_PAGES - SET_PAGES)   # writes nothing
    # A master that is not there: the backend is made (SGLang starts) and answers misses.
    down = dead["down"]
    assert (down["exists"], down["read"], down["written"]) == (0, [False] * 2, [False] * 2)
    assert down["stats"]["errors"] == 3
