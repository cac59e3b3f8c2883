"""Build the virtual environment that runs kvstore's SGLang HiCache backend with SGLang's wheel.

    python3 tools/cluster/sglang_env.py VENV    # from a checkout, before kvstore is installed

SGLang ships no CPU build: its wheel's dependencies are CUDA builds (flashinfer,
sglang-kernel, nvidia-*, torch 2.14.1 from PyPI). What the HiCache storage
interface needs is a few pure modules of the wheel, so in VENV (made with
``python3 -m venv`` when absent):

1. ``pip install -c constraints.txt torch==2.13.0 <SGLANG_IMPORTS> -e CHECKOUT``:
   the CPU torch, the packages ``import sglang.srt.mem_cache.storage`` reaches
   (``sglang/__init__`` imports ``sglang.lang`` and ``sglang.srt.utils.common``:
   numpy, triton, PIL, starlette, msgspec, pydantic, pyzmq, IPython, aiohttp...)
   and this kvstore checkout, in one resolve.
2. ``pip install --no-deps sglang==SGLANG_VERSION``: the wheel alone.
3. Checks that torch is a CPU build, that SGLang's ``StorageBackendFactory``,
   ``HiCacheStorage`` and kvstore's backend import, and computes SGLang's page
   hash once (``sglang.srt.mem_cache.utils.get_hash_str``: a C++ extension
   SGLang compiles with torch's cpp_extension on first use, kept in torch's
   extension cache, so the tests do not pay the build).

What it leaves out, and so what the tests cannot build: SGLang's host pools
(``sglang.srt.mem_cache.pool_host``) import the model configs, which import
transformers and torchvision; PyPI's torchvision is built against its CUDA
torch and fails on the CPU one (``operator torchvision::nms does not exist``).
The tests give the backend a host pool of their own with the methods it uses.

A VENV that already holds this SGLang skips steps 1-2 but for kvstore, which is
reinstalled from CHECKOUT (seconds); ``--fresh`` deletes VENV first. The last
line printed is VENV's python: point ``KVSTORE_SGLANG_PYTHON`` at it to run
tests/with_sglang against it.

Standard library only: it runs before kvstore is installed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

SGLANG_VERSION = "0.5.23"
#: What ``import sglang.srt.mem_cache.storage.backend_factory`` and
#: ``sglang.srt.mem_cache.utils`` import at module level, beyond torch (found by
#: importing them in a venv of the wheel alone until nothing was missing).
SGLANG_IMPORTS = ("numpy", "orjson", "psutil", "pybase64", "requests", "triton", "packaging",
                  "pillow", "starlette", "msgspec", "pydantic", "pyzmq", "tqdm", "IPython",
                  "aiohttp", "ninja")
CHECK = ("import torch\n"
         "from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory\n"
         "from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig\n"
         "from sglang.srt.mem_cache.utils import get_hash_str\n"
         "import kvstore.client.integrations.sglang.backend\n"
         "import importlib.metadata as m\n"
         "assert torch.version.cuda is None, 'a CUDA torch: ' + torch.__version__\n"
         "assert len(get_hash_str(list(range(1, 11)), None, page_size=4)) == 3\n"
         "print('sglang', m.version('sglang'), 'torch', torch.__version__)\n")


def default_checkout() -> Path | None:
    """The checkout this file belongs to (it is tools/cluster/ of one), if it is one."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").exists() and (root / "constraints.txt").exists() \
        else None


def _say(line: str) -> None:
    print(f"sglang-env: {line}", file=sys.stderr, flush=True)


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
    have = _installed_version(python, "sglang")
    if have == SGLANG_VERSION:
        _say(f"sglang {have} already in {venv}: reinstalling kvstore only")
        _run(pip + ["-e", str(checkout)])
    else:
        _run(pip + ["torch==2.13.0", *SGLANG_IMPORTS, "-e", str(checkout)])
        _run([str(python), "-m", "pip", "install", "--no-deps", f"sglang=={SGLANG_VERSION}"])
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
