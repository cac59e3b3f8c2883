"""The SSD tier survives restarts; DRAM does not.

A real node demotes most of what it holds to its SSD, then stops and starts
again on the same ``--ssd-path`` (without ``--node-id``: the id recorded on
the SSD is used). It re-announces the SSD's objects in its registration, so
what was on SSD reads back exact and what was only in DRAM is NotFound --
for exists, list and get alike. A master that restarts learns the SSD's
objects the same way, from the node's inventory.
"""

from __future__ import annotations

import random
import signal

from kvstore.client import KVClient, NotFound
from kvstore.tools.cluster.processes import Child, ProcessGroup, free_port, service_args
from kvtest import node_args, wait_for

MiB = 1024 * 1024


def stop_child(procs: ProcessGroup, child: Child) -> None:
    child.proc.send_signal(signal.SIGTERM)
    assert child.proc.wait(10) == 0
    procs.children.remove(child)


def value(i: int) -> bytes:
    return random.Random(i).randbytes(MiB + i)


def write_and_place(kv: KVClient, n: int) -> dict[str, str]:
    """Write ``n`` objects through a 16 MiB DRAM; returns key -> tier once the index settled."""
    keys = [f"r/{i}" for i in range(n)]
    for k, i in zip(keys, range(n)):
        assert kv.put(k, value(i)) is True

    seen: list = [None]

    def placed():
        (node,) = kv.node_stats().values()
        dram, ssd = node["tiers"]
        where = kv.locate(keys)
        tiers = {k: w[0][1] for k, w in zip(keys, where) if not isinstance(w, NotFound)}
        # Settled: the index agrees with the node's own counts, and nothing moved
        # since the previous look (no demotion in flight, no event on its way),
        # so "DRAM" means only in DRAM.
        now = (node["counters"]["demotions"], tiers)
        ok = (len(tiers) == n and now == seen[0]
              and sum(t == "DRAM" for t in tiers.values()) == dram["num_objects"]
              and sum(t == "SSD" for t in tiers.values()) == ssd["num_objects"])
        seen[0] = now
        return tiers if ok else None
    return wait_for(placed, timeout_s=10, interval_s=0.3)


def test_ssd_contents_survive_a_node_restart(tmp_path):
    procs = ProcessGroup(log_dir=str(tmp_path / "logs"))
    try:
        master = procs.start("master", service_args("master")).address
        args = node_args(master, "n0", "16MiB", "default", "64MiB", str(tmp_path))
        node = procs.start("n0", args)
        with KVClient(master) as kv:
            tiers = write_and_place(kv, 40)                # 40 MiB through 16 MiB of DRAM
            on_ssd = sorted(k for k, t in tiers.items() if t == "SSD")
            in_dram = sorted(k for k, t in tiers.items() if t == "DRAM")
            assert len(on_ssd) >= 20 and in_dram
            stop_child(procs, node)
            restart = [a for a in args if a not in ("--node-id", "n0")]   # id from the SSD
            node = procs.start("n0-again", restart)
            assert node.info["node_id"] == "n0" and node.info["recovered"] >= len(on_ssd)

            def dram_forgotten() -> bool:
                return not any(kv.batch_exists(in_dram))
            wait_for(dram_forgotten, timeout_s=10)
            assert all(kv.batch_exists(on_ssd))
            assert sorted(m.key for m in kv.list("r/")) == on_ssd
            for k in on_ssd:
                assert kv.get(k) == value(int(k[2:])), k      # promoted from the SSD
            for k in in_dram:
                try:
                    kv.get(k)
                    raise AssertionError(f"{k} was only in DRAM and came back")
                except NotFound:
                    pass
            assert kv.stat()[0].counters["puts"] == 40
        procs.check()
    finally:
        procs.stop()


def test_a_new_master_learns_the_ssd_from_the_inventory(tmp_path):
    port = free_port()
    procs = ProcessGroup(log_dir=str(tmp_path / "logs"))
    try:
        master_args = service_args("master", "--port", str(port))
        master = procs.start("master", master_args)
        address = master.address
        procs.start("n0", node_args(address, "n0", "16MiB", "default", "64MiB", str(tmp_path)))
        with KVClient(address) as kv:
            tiers = write_and_place(kv, 30)
        on_ssd = sorted(k for k, t in tiers.items() if t == "SSD")
        stop_child(procs, master)
        procs.start("master-again", master_args)        # empty index, same address
        with KVClient(address) as kv:
            # The node's next heartbeat is unknown to the new master: it registers
            # again with its inventory, DRAM and SSD alike.
            wait_for(lambda: all(kv.batch_exists(sorted(tiers))), timeout_s=10)
            for k in on_ssd:
                assert kv.get(k) == value(int(k[2:]))
            assert kv.stat()[0].counters["reindexed"] == len(tiers)
            # New puts get ids above the re-indexed ones: no version is confused.
            assert kv.put("r/new", b"fresh") is True
            assert kv.get("r/new") == b"fresh"
        procs.check()
    finally:
        procs.stop()
