"""kvctl events: where --from starts each shard, and what it refuses."""

from __future__ import annotations

import pytest
import typer

from kvstore.client.events import Cursor
from kvstore.tools.cli.events import parse_from


def test_from_values():
    assert parse_from([]) == ({}, None, False)
    assert parse_from(["oldest"]) == ({}, None, True)
    assert parse_from(["now"]) == ({}, None, False)
    assert parse_from(["17"]) == ({}, 17, False)
    assert parse_from(["0:5", "1:99:7"]) == ({0: Cursor(0, 5), 1: Cursor(99, 7)}, None, False)


@pytest.mark.parametrize("bad", ["x", "1:2:3:4", "0", "0:0", "a:1", str(2**64), "0:-1:1",
                                 f"0:1:{2**64}", f"0:{2**64}:1"])
def test_bad_from_values_are_refused(bad):
    with pytest.raises(typer.BadParameter):
        parse_from([bad])
