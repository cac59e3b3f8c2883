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
reinstalled from CHECKOUT (seconds; with grpcio upgraded, so that the protobuf
stubs it generates import); ``--fresh`` deletes VENV first. The last
line printed is VENV's python: point ``KVSTORE_SGLANG_PYTHON`` at it to run
tests/with_sglang against it.

Standard library only: it runs before kvstore is installed. The steps are
venv_steps.py's (shared with vllm_env.py); this file is SGLang's recipe.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:                        # installed: kvstore.tools.cluster.sglang_env
    from . import venv_steps
except ImportError:         # python3 tools/cluster/sglang_env.py: its folder is sys.path[0]
    import venv_steps       # type: ignore[no-redef]

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


def _install(python: Path, checkout: Path) -> list[list[str]]:
    return [venv_steps.pip_install(python, checkout)
            + ["torch==2.13.0", *SGLANG_IMPORTS, "-e", str(checkout)],
            [str(python), "-m", "pip", "install", "--no-deps", f"sglang=={SGLANG_VERSION}"]]


RECIPE = venv_steps.Recipe(name="sglang-env", dist="sglang", version=SGLANG_VERSION,
                           install=_install, check=CHECK, doc=__doc__)
#: ``main(argv=None)``: the command line (0 built, 1 a step failed, 2 a bad call);
#: ``build(venv, checkout, fresh=False)``: the module doc's steps, returning VENV's python
#: (venv_steps.build says what it raises).
default_checkout, build, main = venv_steps.default_checkout, RECIPE.build, RECIPE.main


if __name__ == "__main__":
    sys.exit(main())
