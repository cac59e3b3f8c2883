"""``kvstore master --check-config`` refuses what ``serve`` would refuse about the
shard: a ``--shard-id`` the shard map does not name, and a shard of several
masters without the ``--port`` that says which one this process is."""

from __future__ import annotations

import pytest

from kvstore.tools.cli.services import run

MAP = "a.example:7000|b.example:7000,c.example:7000|d.example:7000"


@pytest.mark.parametrize("args", [
    ["--shard-map", MAP, "--shard-id", "1", "--port", "7000"],
    ["--shard-map", "a.example:7000", "--shard-id", "0"],      # one master: its port
    [],                                                        # no map: the only shard
])
def test_usable_shard_is_ok(args, capsys):
    assert run("master", args + ["--check-config"]) == 0
    assert "configuration ok" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--shard-map", MAP, "--shard-id", "2", "--port", "7000"], "shard 2 is not in the shard map"),
    (["--shard-map", MAP, "--shard-id", "0"], "pick one with --port"),
])
def test_unusable_shard_is_refused(args, message, capsys):
    assert run("master", args + ["--check-config"]) == 2
    assert message in capsys.readouterr().err
