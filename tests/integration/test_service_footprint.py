"""An idle master and store node hold what they run, not torch (issue 31, bug 8).

Both are started as real processes the two ways they are started: by the
``kvstore`` command (``python -m kvstore.tools.cli.cli``, which the console script
runs) and by the launchers (``python -m kvstore.tools.cli.services``). Once READY
(the node registered), neither may have torch mapped: only the engines run a
model. Their own memory (RssAnon + RssFile from /proc/PID/status) stays under
100 MiB; the node's DRAM tier is shared memory (RssShmem) and is left out: it is
taken at its first write here (``--no-prefault``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstore.tools.cluster.processes import ProcessGroup

# Starts a master and a node through `kvstore up` or the launcher's command line.
pytestmark = [pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc"),
              pytest.mark.slow]

#: How each entry point is run: ``python ARGS``.
ENTRIES = {"kvstore": ("-m", "kvstore.tools.cli.cli"),
           "launcher": ("-m", "kvstore.tools.cli.services")}
OWN_MEMORY_LIMIT_MIB = 100


def _memory_mib(pid: int) -> dict[str, float]:
    """RssAnon, RssFile and RssShmem of ``pid`` in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("RssAnon", "RssFile", "RssShmem"):
            out[name] = int(value.split()[0]) / 1024       # kB
    return out


def _torch_files(pid: int) -> set[str]:
    """The files of torch's package mapped into ``pid`` (its native libraries and _C)."""
    files = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)       # address perms offset dev inode [path]
        if len(fields) == 6 and "/torch/" in fields[5]:
            files.add(fields[5])
    return files


@pytest.mark.parametrize("entry", sorted(ENTRIES))
def test_idle_master_and_node_load_no_torch(entry, tmp_path):
    with ProcessGroup(str(tmp_path)) as group:
        master = group.start("master", [*ENTRIES[entry], "master", "--port", "0"])
        node = group.start("node", [*ENTRIES[entry], "node", "--master", master.address,
                                    "--dram", "64MiB", "--no-prefault"])
        for child in (master, node):
            pid = child.proc.pid
            mem = _memory_mib(pid)
            own = mem["RssAnon"] + mem["RssFile"]
            print(f"{entry} {child.name}: RssAnon {mem['RssAnon']:.1f} + RssFile "
                  f"{mem['RssFile']:.1f} = {own:.1f} MiB, RssShmem {mem['RssShmem']:.1f} MiB")
            assert not _torch_files(pid), f"{child.name} loaded torch"
            assert own < OWN_MEMORY_LIMIT_MIB, (child.name, mem)
