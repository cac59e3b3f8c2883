"""The house's structure: one package list, the import contract, no cycles, small rooms.

The contract and the import graph are checked on the layout a wheel
installs (``.ci/lint_imports.py`` assembles it in a temporary folder), since
client/, conductor/, engines/ and tools/ live beside kvstore/ on disk.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lint_imports", ROOT / ".ci" / "lint_imports.py")
lint_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lint_imports)

MAX_LINES = 600
GENERATED = ("_proto",)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> pathlib.Path:
    """The installed layout: kvstore/, kvstore/client/, ... (.py files only)."""
    return lint_imports.assemble(tmp_path_factory.mktemp("layout"))


def test_the_package_list_names_every_package_on_disk():
    dirs = lint_imports.package_dirs()
    for pkg, folder in dirs.items():
        assert (folder / "__init__.py").is_file() or pkg.endswith("._proto"), pkg
    listed = {folder.resolve() for folder in dirs.values()}
    on_disk = set()
    for top in {folder for pkg, folder in dirs.items() if pkg.count(".") <= 1}:
        for init in top.rglob("__init__.py"):
            if "__pycache__" not in init.parts:
                on_disk.add(init.parent.resolve())
    assert on_disk <= listed, sorted(map(str, on_disk - listed))


def test_console_scripts_and_the_services_module_live_in_tools():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert all(target.startswith("kvstore.tools.") for target in project["scripts"].values())


def test_the_import_contract_holds(tree):
    result = lint_imports.lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "BROKEN" not in result.stdout


@pytest.mark.parametrize("module, bad_import, contract", [
    ("kvstore/store/node.py", "import kvstore.engines.model", "Layers point down"),
    ("kvstore/keys.py", "from kvstore.client import KVClient", "Layers point down"),
    ("kvstore/conductor/scheduler.py", "import kvstore.store.node", "only through the SDK"),
    ("kvstore/client/reads.py", "from kvstore.master import index", "wire protocol"),
    ("kvstore/client/reads.py", "import kvstore.client.integrations.resp.server",
     "never import an adapter"),
    ("kvstore/store/node.py", "from kvstore.client.integrations.vllm import keys",
     "never import an adapter"),
    ("kvstore/client/integrations/resp/table.py", "import kvstore.store.node",
     "Adapters (vLLM connector, Redis front) are clients"),
])
def test_a_wrong_import_breaks_the_contract(tmp_path, module, bad_import, contract):
    tree = lint_imports.assemble(tmp_path)
    path = tree / module
    if not path.exists():       # a module of this list may have moved: use the package
        path = path.parent / "__init__.py"
    path.write_text(path.read_text() + f"\n{bad_import}  # planted by the test\n")
    result = lint_imports.lint(tree)
    assert result.returncode != 0, result.stdout
    broken = result.stdout[result.stdout.index("Broken contracts"):]
    assert contract in broken


_CYCLES = r'''
import sys
import grimp

graph = grimp.build_graph("kvstore", exclude_type_checking_imports=False, cache_dir=None)
index, low, stack, on, cycles = {}, {}, [], set(), []
sys.setrecursionlimit(10000)


def visit(v):          # Tarjan's strongly connected components
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph.find_modules_directly_imported_by(v):
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        comp = []
        while True:
            w = stack.pop()
            on.discard(w)
            comp.append(w)
            if w == v:
                break
        if len(comp) > 1 or v in graph.find_modules_directly_imported_by(v):
            cycles.append(sorted(comp))


for m in sorted(graph.modules):
    if m not in index:
        visit(m)
print(len(graph.modules))
for c in cycles:
    print(" <-> ".join(c))
'''


def test_no_import_cycles(tree):
    """Every import counts: module level, inside functions, under TYPE_CHECKING."""
    out = subprocess.run([sys.executable, "-c", _CYCLES], cwd=tree, capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=str(tree)), check=True)
    num_modules, *cycles = out.stdout.splitlines()
    assert int(num_modules) > 80
    assert cycles == []


def test_no_source_file_passes_the_size_limit():
    big = []
    for pkg, folder in lint_imports.package_dirs().items():
        if pkg.rsplit(".", 1)[-1] in GENERATED:
            continue
        for f in folder.glob("*.py"):
            n = len(f.read_text().splitlines())
            if n > MAX_LINES:
                big.append(f"{f.relative_to(ROOT)}: {n} lines")
    assert big == []


def test_no_two_test_files_share_a_name():
    # tests/ has no __init__.py: pytest imports test files by basename, and a
    # second file of the same name stops the whole run at collection.
    seen: dict[str, pathlib.Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        other = seen.setdefault(path.name, path)
        assert other == path, f"{path} and {other} share a name"
