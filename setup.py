"""Build hooks: generate the gRPC stubs from proto/ into kvstore/_proto, and
compile the native core (kvstore/native/*.cpp) into the extension kvstore._native.

The stubs are never committed (STYLE rule 15). They are generated into the
git-ignored package ``kvstore/_proto`` on every build, for both regular and
editable installs, and import-checked before the build goes on.

The native core is C++17 built with pybind11 (a build requirement from PyPI)
by the machine's compiler on every install: nothing prebuilt is downloaded.
``KVSTORE_NATIVE_CFLAGS`` adds compiler flags (the sanitizer build in .ci/run).
"""

import os
import pathlib
import re
import shlex
import subprocess
import sys

from pybind11.setup_helpers import Pybind11Extension, ParallelCompile
from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "kvstore" / "_proto"


def generate_stubs() -> None:
    from grpc_tools import protoc  # build-time dependency (pyproject.toml)
    import grpc_tools

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    protos = sorted(PROTO_DIR.glob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["grpc_tools.protoc", f"-I{PROTO_DIR}", f"-I{include}",
            f"--python_out={OUT_DIR}", f"--pyi_out={OUT_DIR}",
            f"--grpc_python_out={OUT_DIR}"] + [str(p) for p in protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + ", ".join(p.name for p in protos))
    # protoc writes absolute imports (`import master_pb2`); make them package-relative.
    for path in OUT_DIR.glob("*_pb2*.py"):
        text = path.read_text()
        text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
        path.write_text(text)
    (OUT_DIR / "__init__.py").write_text('"""Generated gRPC stubs (git-ignored; see setup.py)."""\n')
    # Import check: fail the build here rather than at first use.
    mods = [p.stem for p in OUT_DIR.glob("*_pb2*.py")]
    code = "import importlib; [importlib.import_module('kvstore._proto.' + m) for m in %r]" % mods
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def ensure_package() -> None:
    """Make kvstore/_proto a package before setuptools looks at the package list.

    pyproject lists ``kvstore._proto`` explicitly; on a fresh clone the folder
    does not exist until the stubs are generated (in build_py), and egg_info,
    which runs first, refuses a listed package without a folder.
    """
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    init = OUT_DIR / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC stubs (git-ignored; see setup.py)."""\n')


class BuildPyWithProto(build_py):
    def run(self):
        generate_stubs()
        super().run()


def native_extension() -> Pybind11Extension:
    """kvstore._native from every .cpp in kvstore/native/ (fuzz/ and tests/ excluded)."""
    native = ROOT / "kvstore" / "native"
    sources = sorted(str(p.relative_to(ROOT)) for p in native.glob("*.cpp"))
    extra = shlex.split(os.environ.get("KVSTORE_NATIVE_CFLAGS", ""))
    return Pybind11Extension(
        "kvstore._native", sources, cxx_std=17, include_dirs=[str(native)],
        extra_compile_args=["-O3", "-fvisibility=hidden", *extra],
        extra_link_args=[f for f in extra if f.startswith("-fsanitize")])


ensure_package()
ParallelCompile("KVSTORE_BUILD_JOBS", default=0).install()
setup(cmdclass={"build_py": BuildPyWithProto}, ext_modules=[native_extension()])
