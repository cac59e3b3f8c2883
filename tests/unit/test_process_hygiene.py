"""Process hygiene: busy ports fail loudly, a killed node's shm segment is reclaimed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvstore.master.server import create_server
from kvstore.store.tiers.dram import remove_orphan_segments
from kvstore.tools.cluster.processes import (ChildFailed, ProcessGroup, ephemeral_port_range,
                                             free_ports)
from kvstore.transfer.shm import SHM_DIR
from waits import wait_until


async def test_a_second_master_on_a_busy_port_fails():
    server, port, _ = await create_server("127.0.0.1", 0)
    try:
        # gRPC's default SO_REUSEPORT would let it bind and split the clients.
        with pytest.raises(OSError, match="Failed to bind"):   # one line at the CLI
            await create_server("127.0.0.1", port)
    finally:
        await server.stop(0)


def test_orphan_segments_of_dead_processes_are_removed():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = f"kvstore-{dead.pid}-deadbeef"
    live = f"kvstore-{os.getpid()}-cafef00d"
    for name in (orphan, live):
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x")
    try:
        removed = remove_orphan_segments()
        assert orphan in removed and live not in removed
        assert not os.path.exists(os.path.join(SHM_DIR, orphan))
        assert os.path.exists(os.path.join(SHM_DIR, live))
    finally:
        for name in (orphan, live):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass


@pytest.mark.parametrize("service, args", [("master", ["--port", "99999"]),
                                           ("node", ["--master", "a:1", "--port", "-1"])])
def test_services_refuse_ports_out_of_range(service, args, capsys):
    from kvstore.tools.cli.services import SERVICES

    with pytest.raises(SystemExit) as exc:
        SERVICES[service](args)
    assert exc.value.code == 2 and "is not a port" in capsys.readouterr().err


def test_ports_named_before_start_are_outside_the_ephemeral_range():
    # A master's port is in the shard map before it binds; an outgoing
    # connection made meanwhile must never be handed it (CI saw EADDRINUSE).
    low, high = ephemeral_port_range()
    ports = free_ports(16)
    assert len(set(ports)) == 16
    assert all(not low <= p <= high for p in ports)


def test_a_child_that_exits_before_ready_is_reported_as_exited(tmp_path):
    procs = ProcessGroup(log_dir=str(tmp_path))
    with pytest.raises(ChildFailed, match="exited with 3"):
        procs.start("quitter", ["-c", "raise SystemExit(3)"], timeout_s=30)
    procs.stop()


@pytest.mark.slow                   # starts a cluster, from a script fastlane.py cannot read
def test_a_cluster_stops_when_its_launcher_is_killed(tmp_path):
    # A launcher killed with SIGKILL (the OOM killer took kvstore bench so) used to
    # leave its master and node running, the node's segment with them.
    script = ("import os\n"
              "from kvstore.tools.cluster.launcher import start_store_cluster\n"
              f"c = start_store_cluster(1, 1, dram='16MiB', log_dir={str(tmp_path)!r})\n"
              "print(' '.join(str(ch.proc.pid) for ch in c.procs.children), flush=True)\n"
              "os.kill(os.getpid(), 9)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120).stdout
    pids = [int(p) for p in out.split()]
    assert len(pids) == 2
    wait_until(lambda: not any(_alive(p) for p in pids), timeout_s=15, interval_s=0.1,
               what="the cluster to stop with its launcher")
    logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
    assert logs.count("is gone: stopping") == 2


def _alive(pid: int) -> bool:
    """Running (a zombie, whose reaper is init now, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
