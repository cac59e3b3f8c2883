"""kvstore's command list: the tools' commands, registered only when needed (a service
runs without them), keep their place in ``kvstore --help``."""

from __future__ import annotations

import subprocess
import sys

import typer.main

SERVICES = ["master", "node", "prefill", "decode", "conductor", "http", "resp"]


def test_the_tools_commands_keep_their_place():
    from kvstore.tools.cli.cli import app        # the whole app: the tools' commands included

    names = list(typer.main.get_command(app).commands)
    assert names[:4] == ["demo", "up", "chaos", "bench"]
    assert names[names.index("profile") + 1:] == ["vllm-config", "vllm-env", *SERVICES]
    assert len(names) == len(set(names)) == 3 + 13 + 2 + len(SERVICES)


def test_importing_the_cli_loads_no_tool_and_no_torch():
    code = ("import sys, kvstore.tools.cli.cli\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith("
            "('kvstore.tools.bench', 'kvstore.tools.sim', 'kvstore.tools.demo', "
            "'kvstore.engines'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
