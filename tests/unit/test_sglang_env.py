"""tools/cluster/sglang_env.py, SGLang's recipe on tools/cluster/venv_steps.py (whose tests,
tests/unit/test_venv_steps.py, run the command line of both env scripts): the CPU torch, the
pure packages SGLang's storage modules import and this checkout in one resolve, then
SGLang's wheel without its (CUDA) dependencies."""

from pathlib import Path

from kvstore.tools.cluster import sglang_env, venv_steps

PYTHON, CHECKOUT = Path("/v/bin/python"), Path("/c")


def test_the_full_install_is_the_cpu_torch_and_then_the_wheel_alone():
    deps, wheel = sglang_env.RECIPE.install(PYTHON, CHECKOUT)
    assert deps == venv_steps.pip_install(PYTHON, CHECKOUT) + [
        "torch==2.13.0", *sglang_env.SGLANG_IMPORTS, "-e", str(CHECKOUT)]
    assert wheel == [str(PYTHON), "-m", "pip", "install", "--no-deps",
                     f"sglang=={sglang_env.SGLANG_VERSION}"]
    assert (sglang_env.RECIPE.dist, sglang_env.RECIPE.version) == (
        "sglang", sglang_env.SGLANG_VERSION)
    assert sglang_env.RECIPE.after(PYTHON, CHECKOUT) == []


def test_the_check_imports_the_backend_on_a_cpu_torch():
    assert "kvstore.client.integrations.sglang.backend" in sglang_env.RECIPE.check
    assert "torch.version.cuda is None" in sglang_env.RECIPE.check
    compile(sglang_env.RECIPE.check, "check", "exec")
    assert sglang_env.RECIPE.name == "sglang-env"       # .ci/run greps "^sglang-env: ready"
