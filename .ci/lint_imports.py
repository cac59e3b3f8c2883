"""Check the import contract (pyproject's [tool.importlinter]) on the installed layout.

The folders client/, conductor/, engines/ and tools/ install as subpackages
of kvstore (pyproject's package-dir), but on disk they sit beside kvstore/,
where import-linter's graph builder (grimp, which walks the root package's
folder) cannot see them. This script assembles the layout a wheel installs
-- every .py file of every package at its installed path -- in a temporary
folder and runs ``lint-imports`` there, so the contract is checked on the
modules users import.

    python3 .ci/lint_imports.py            # exit status of lint-imports
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def package_dirs(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Installed package name -> its source folder, from pyproject.toml."""
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = cfg.get("package-dir", {})
    out = {}
    for pkg in cfg["packages"]:
        base = max((p for p in mapping if pkg == p or pkg.startswith(p + ".")), key=len,
                   default=None)
        rel = (mapping[base] + pkg[len(base):].replace(".", "/")) if base else pkg.replace(".", "/")
        out[pkg] = root / rel
    return out


def assemble(dst: pathlib.Path, root: pathlib.Path = ROOT) -> pathlib.Path:
    """Copy every package's .py files to ``dst/<installed path>``; returns ``dst``."""
    for pkg, src in package_dirs(root).items():
        target = dst.joinpath(*pkg.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for f in src.glob("*.py"):
            shutil.copy2(f, target / f.name)
    return dst


def lint(tree: pathlib.Path, root: pathlib.Path = ROOT) -> subprocess.CompletedProcess:
    """Run lint-imports with ``root``'s contract over an assembled ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    code = "import sys; from importlinter.cli import lint_imports_command; lint_imports_command()"
    return subprocess.run([sys.executable, "-c", code, "--no-cache", str(root / "pyproject.toml")],
                          cwd=tree, env=env, capture_output=True, text=True)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="kvstore-layout-") as tmp:
        result = lint(assemble(pathlib.Path(tmp)))
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
