"""tools/cluster/sglang_env.py, the recipe of the SGLang environment (its real run is .ci/run's,
before the tests): it needs only the standard library, so it runs from a checkout
before kvstore is installed, and it never deletes a folder that is no venv."""

import subprocess
import sys
from pathlib import Path

from kvstore.tools.cluster import sglang_env

SCRIPT = Path(sglang_env.__file__)


def test_runs_with_the_standard_library_alone():
    # -S: no site-packages, so any import beyond the standard library fails
    out = subprocess.run([sys.executable, "-S", str(SCRIPT), "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--checkout" in out and "--fresh" in out


def test_finds_the_checkout_it_belongs_to():
    root = sglang_env.default_checkout()
    assert root is not None and (root / "tools" / "cluster" / "sglang_env.py").samefile(SCRIPT)


def test_fresh_refuses_a_folder_that_is_no_virtual_environment(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    assert sglang_env.main([str(tmp_path), "--fresh"]) == 2
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_without_a_checkout_it_says_so(tmp_path):
    proc = subprocess.run([sys.executable, "-S", str(SCRIPT), str(tmp_path / "v"),
                           "--checkout", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "--checkout" in proc.stderr
    assert not (tmp_path / "v").exists()
