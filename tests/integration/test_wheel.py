"""The built wheel: one top-level package, and only kvstore.* importable from it.

The wheel is built with ``pip wheel --no-deps .`` and installed into a fresh
virtualenv whose only view of the machine's packages is a path entry to
the dependencies (so this checkout's editable install, a ``.pth`` finder,
is not active there). A subprocess started outside the repository imports
every module of the installed package and checks that no top-level
``client``, ``tools``, ``engines`` or ``conductor`` exists.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest

# Builds a wheel and installs it in a fresh environment: tens of seconds.
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    # Built from a copy of the sources: setuptools leaves build/ in the tree it builds.
    src = tmp_path_factory.mktemp("src") / "kvstore"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", "_proto", ".pytest_cache"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w",
                    str(out)], check=True, capture_output=True, timeout=600)
    (whl,) = out.glob("kvstore-*.whl")
    return whl


@pytest.fixture(scope="module")
def env_python(wheel, tmp_path_factory) -> pathlib.Path:
    """A fresh virtualenv holding the wheel; dependencies reached by a path entry."""
    root = tmp_path_factory.mktemp("venv")
    venv.EnvBuilder(with_pip=False).create(root)
    python = root / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", site,
                    str(wheel)], check=True, capture_output=True, timeout=300)
    # Every site-packages this interpreter sees (a venv made with
    # --system-site-packages sees the system's too).
    deps = [p for p in sys.path if p.endswith("-packages") and os.path.isdir(p)]
    pathlib.Path(site, "deps.pth").write_text("".join(d + "\n" for d in deps))
    return python


def test_the_wheel_has_one_top_level_package(wheel):
    with zipfile.ZipFile(wheel) as z:
        tops = {name.split("/", 1)[0] for name in z.namelist()}
        names = set(z.namelist())
    assert tops == {"kvstore", next(t for t in tops if t.endswith(".dist-info"))}
    # The folders beside kvstore/ are inside it, with their data.
    for path in ("kvstore/client/__init__.py", "kvstore/engines/model.py",
                 "kvstore/conductor/scheduler.py", "kvstore/tools/cli/cli.py",
                 "kvstore/_proto/kvstore_pb2.py", "kvstore/tools/data/conversation_trace.jsonl",
                 "kvstore/conductor/data/cost_models/tiny-cpu.json"):
        assert path in names, path


_CHECK = r'''
import importlib, importlib.util, pkgutil, sys
import kvstore, kvstore.client, kvstore.engines, kvstore.conductor, kvstore.tools
assert kvstore.__file__.startswith(sys.argv[1]), kvstore.__file__
for name in ("client", "tools", "engines", "conductor"):
    assert importlib.util.find_spec(name) is None, name
# Modules that exist to plug into an optional outside package import it; they are
# imported too where it is installed.
OPTIONAL = {"kvstore.client.integrations.vllm.connector": "vllm",
            "kvstore.client.integrations.vllm.kv_events": "vllm",
            "kvstore.client.integrations.vllm.offload_tier": "vllm",
            "kvstore.client.integrations.sglang.backend": "sglang"}
mods = [m.name for m in pkgutil.walk_packages(kvstore.__path__, "kvstore.")
        if not m.name.endswith(".__main__")]       # scripts: they run when imported
assert set(OPTIONAL) <= set(mods), set(OPTIONAL) - set(mods)
for m in mods:
    if m in OPTIONAL and importlib.util.find_spec(OPTIONAL[m]) is None:
        continue
    importlib.import_module(m)
for name in ("client", "tools", "engines", "conductor"):
    assert name not in sys.modules, name
print(len(mods))
'''


def test_only_kvstore_names_import_from_the_installed_wheel(env_python, tmp_path):
    site = str(env_python.parent.parent)
    out = subprocess.run([str(env_python), "-c", _CHECK, site], cwd=tmp_path, check=True,
                         capture_output=True, text=True, timeout=300)
    assert int(out.stdout.split()[-1]) > 80       # every module imported, none left behind
    scripts = subprocess.run([str(env_python), "-c",
                              "from importlib.metadata import entry_points as e; "
                              "print(sorted(x.value for x in e(group='console_scripts') "
                              "if x.dist.name == 'kvstore'))"],
                             cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    assert "kvstore.tools.cli.cli:main" in scripts and "kvstore.tools.cli.kvctl:main" in scripts
