"""tools/cluster/venv_steps.py, the steps vllm_env.py and sglang_env.py share (their real runs
are .ci/run's, before the tests): the scripts need only the standard library, so they run
from a checkout before kvstore is installed; they never delete a folder that is no venv;
and a kept venv gets kvstore (and grpcio) again, not the engine.

The command-line tests run for both scripts. The build tests record the commands instead of
running pip (the real ones download GB): ``run`` is swapped for a list.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.tools.cluster import sglang_env, venv_steps, vllm_env

SCRIPTS = [vllm_env, sglang_env]


@pytest.fixture(params=SCRIPTS, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def script(request):
    """One env script's module."""
    return request.param


def test_scripts_run_with_the_standard_library_alone(script):
    # -S: no site-packages, so any import beyond the standard library fails; run as a
    # file, the script finds venv_steps beside it (no package to import it from)
    out = subprocess.run([sys.executable, "-S", script.__file__, "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--checkout" in out and "--fresh" in out
    assert script.__doc__.split("\n\n")[0].split()[0] in out      # the script's own help


def test_finds_the_checkout_it_belongs_to(script):
    root = venv_steps.default_checkout()
    assert root is not None and (root / "tools" / "cluster" / "venv_steps.py").samefile(
        venv_steps.__file__)
    assert script.default_checkout() == root
    assert script.venv_steps is venv_steps      # installed: the package's module, no second copy


def test_fresh_refuses_a_folder_that_is_no_virtual_environment(script, tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    assert script.main([str(tmp_path), "--fresh"]) == 2
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_without_a_checkout_it_says_so(script, tmp_path):
    proc = subprocess.run([sys.executable, "-S", script.__file__, str(tmp_path / "v"),
                           "--checkout", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "--checkout" in proc.stderr
    assert not (tmp_path / "v").exists()


def test_installed_version_of_a_python():
    assert venv_steps.installed_version(Path(sys.executable), "pytest") == pytest.__version__
    assert venv_steps.installed_version(Path(sys.executable), "no-such-dist-here") is None


# --- build, with the commands recorded ---

def _install(python: Path, checkout: Path) -> list[list[str]]:
    return [venv_steps.pip_install(python, checkout) + ["engine==1.0", "-e", str(checkout)]]


def _after(python: Path, _checkout: Path) -> list[list[str]]:
    return [[str(python), "-m", "pip", "uninstall", "-y", "extra"]]


#: A recipe whose "engine" is pytest: the test's own python has it, at pytest.__version__.
RECIPE = venv_steps.Recipe(name="test-env", dist="pytest", version=pytest.__version__,
                           install=_install, check="print('ok')", doc="test-env",
                           after=_after)


def _shim(venv: Path, *flags: str) -> Path:
    """Make ``venv`` a folder whose bin/python is this test's python (with ``flags``)."""
    (venv / "bin").mkdir(parents=True)
    (venv / "pyvenv.cfg").write_text("home = /nowhere\n")
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" {" ".join(flags)} "$@"\n')
    python.chmod(0o755)
    return venv


def _kept_venv(tmp_path: Path) -> Path:
    """A venv that has the recipe's "engine": this test's python, which has pytest."""
    return _shim(tmp_path / "venv")


@pytest.fixture
def commands(monkeypatch) -> list[list[str]]:
    """The commands build runs, in order (recorded, not run; ``python -m venv`` makes a
    venv whose python has nothing installed: this test's python with -S)."""
    ran: list[list[str]] = []

    def record(_name: str, args: list[str]) -> None:
        ran.append(list(args))
        if args[1:3] == ["-m", "venv"]:
            _shim(Path(args[3]), "-S")

    monkeypatch.setattr(venv_steps, "run", record)
    return ran


def test_a_kept_venv_reinstalls_kvstore_and_upgrades_grpcio(commands, tmp_path, capsys):
    venv, checkout = _kept_venv(tmp_path), tmp_path / "checkout"
    python = RECIPE.build(venv, checkout)
    assert python == venv / "bin" / "python"
    assert commands == [
        [str(python), "-m", "pip", "install", "-c", str(checkout / "constraints.txt"),
         "-U", "grpcio", "-e", str(checkout)],
        [str(python), "-m", "pip", "uninstall", "-y", "extra"],
        [str(python), "-c", "print('ok')"]]
    err = capsys.readouterr().err
    assert f"test-env: pytest {pytest.__version__} already in {venv}" in err
    assert "test-env: ready in" in err


def test_another_version_runs_the_recipes_install(commands, tmp_path):
    venv, checkout = _kept_venv(tmp_path), tmp_path / "checkout"
    recipe = venv_steps.Recipe(name="test-env", dist="pytest", version="0.0.0-not-this",
                               install=_install, check="pass", doc="test-env")
    python = recipe.build(venv, checkout)
    assert commands == [_install(python, checkout)[0], [str(python), "-c", "pass"]]


def test_no_venv_is_made_first(commands, tmp_path):
    venv, checkout = tmp_path / "new", tmp_path / "checkout"
    python = RECIPE.build(venv, checkout)
    assert commands == [[sys.executable, "-m", "venv", str(venv)], *_install(python, checkout),
                        *_after(python, checkout), [str(python), "-c", "print('ok')"]]


def test_fresh_deletes_a_venv_then_makes_it_again(commands, tmp_path):
    venv = _kept_venv(tmp_path)
    (venv / "old.txt").write_text("gone")
    python = RECIPE.build(venv, tmp_path / "checkout", fresh=True)
    assert not (venv / "old.txt").exists()
    assert commands[:2] == [[sys.executable, "-m", "venv", str(venv)],
                            *_install(python, tmp_path / "checkout")]


def test_a_failed_step_exits_1_and_says_which(tmp_path, capsys):
    """Run for real: the check fails in the venv's python; no python is printed."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "constraints.txt").write_text("")
    recipe = venv_steps.Recipe(name="test-env", dist="no-such-dist-here", version="1",
                               install=lambda _p, _c: [], check="raise SystemExit(3)",
                               doc="test-env")
    venv = _kept_venv(tmp_path)
    assert recipe.main([str(venv), "--checkout", str(checkout)]) == 1
    out = capsys.readouterr()
    assert "test-env: failed:" in out.err and "exited 3" in out.err
    assert out.out == ""
