"""``kvstore partition``: cut real links while a writer and two readers run; count what breaks.

On the layout of :mod:`kvstore.tools.faults.partition.layout` (network namespaces,
``--auth`` on every server), with the load of :mod:`kvstore.tools.faults.partition.load`
on host e. Each cut is ``ip link set DEV down`` on one host's veth, mended
(``up``) after a while::

    t = 8 s    leader    the shard leader's host loses its only link (etcd, nodes,
                         clients): it must stop serving before a standby can win
                         its lease; the standby takes over; mended, it rejoins as
                         a standby
    t = 26 s   node      host c loses its control link: node c0 is cut off from its
                         master, clients still reach it; it must fence itself
                         (serve nothing) before its master may declare it dead
    t = 44 s   replica   host b loses its data link: clients are cut off from
                         replica b0 while its master still hears it; reads come
                         from another replica within read_timeout_s

Reported per cut: the times above, and ``recovery_s``: from the cut to the next
cut (or the end), the longest stretch without a successful put, or without a
successful get. Overall: acknowledged puts ``lost`` and removed keys
``resurrected`` at the end, ``wrong_reads`` and ``stale_reads`` (a removed key's
bytes read after its removal returned) during the run. All four must be 0,
every recovery under 10 s, and each ordering above must hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

from kvstore.tools.cluster.netns import NetHosts
from kvstore.tools.faults.partition.layout import (PartitionCluster, make_hosts,
                                                   start_partition_cluster)

MAX_RECOVERY_S = 10.0


@dataclass(slots=True)
class Cut:
    """One link cut: what, where, when (seconds after the load started), for how long."""

    name: str                 # leader | node | replica
    host: str                 # whose link ("" for leader: the leader's host at the time)
    network: str              # net (control) or data
    at_s: float
    for_s: float
    target: str = ""          # the master address or node id cut off
    t_cut: float = 0.0        # unix s
    t_mend: float = 0.0


def default_cuts() -> list[Cut]:
    return [Cut("leader", "", "net", 8.0, 10.0), Cut("node", "c", "net", 26.0, 10.0),
            Cut("replica", "b", "data", 44.0, 8.0)]


@dataclass(slots=True)
class PartitionReport:
    acked_puts: int
    removed: int
    lost: int
    resurrected: int
    wrong_reads: int
    stale_reads: int
    reads: int
    read_errors: int
    not_found_live: int       # live keys NotFound while every replica was cut off
    put_errors: int
    cuts: list[dict]
    failures: list[str] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict:
        return dict(asdict(self), passed=self.passed)


class _Child:
    """A helper process on a host: its ``READY`` time, its ``T`` lines, its JSON line."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.ready = threading.Event()
        self.t_ready = 0.0
        self.transitions: dict[str, list[tuple[float, str]]] = {}
        self.result: dict | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("READY "):
                self.t_ready = float(line.split()[1])
                self.ready.set()
            elif line.startswith("T "):
                _t, at, target, state = line.split()
                with self._lock:
                    self.transitions.setdefault(target, []).append((float(at), state))
            elif line.startswith("{"):
                self.result = json.loads(line)

    def current(self, target: str) -> str:
        with self._lock:
            hist = self.transitions.get(target, [])
            return hist[-1][1] if hist else ""

    def first(self, target: str, states: set[str], after: float) -> float | None:
        with self._lock:
            return next((t for t, s in self.transitions.get(target, []) if t >= after
                         and s in states), None)

    def finish(self, timeout_s: float) -> None:
        try:
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _spawn(hosts: NetHosts, host: str, argv: list[str], env: dict, log) -> _Child:
    proc = hosts.popen(host, [sys.executable, "-m", "kvstore.tools.faults.partition.load", *argv],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                       env=env, start_new_session=True)
    return _Child(proc)


def longest_gap(times: list[float], start: float, end: float) -> float:
    """The longest stretch in [start, end] without one of ``times`` (sorted)."""
    worst, prev = 0.0, start
    for t in times:
        if t < start:
            continue
        if t > end:
            break
        worst, prev = max(worst, t - prev), t
    return max(worst, end - prev)


def run_partition(folder: str | None = None, *, cuts: list[Cut] | None = None,
                  duration_s: float = 60.0, tls: bool = False, read_timeout_s: float = 2.0,
                  on_step=None) -> PartitionReport:
    """Make the hosts, start the layout and the load, cut and mend, and report.

    Raises:
        NetnsError: the hosts could not be made (needs root).
        ChildFailed: a process of the layout did not come up.
    """
    say = on_step or (lambda line: None)
    cuts = cuts or default_cuts()
    folder = folder or tempfile.mkdtemp(prefix="kvstore-partition-")
    with make_hosts() as hosts:
        pc = start_partition_cluster(hosts, folder, tls=tls, on_step=say)
        try:
            return _run(hosts, pc, folder, cuts, duration_s, read_timeout_s, say)
        finally:
            pc.stop()


def _run(hosts: NetHosts, pc: PartitionCluster, folder: str, cuts: list[Cut],
         duration_s: float, read_timeout_s: float, say) -> PartitionReport:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_T", "KVSTORE_A"))}
    env = dict(base, **pc.creds.client_env("client"), KVSTORE_ADMIN_TOKEN=pc.creds.tokens["admin"])
    log = open(os.path.join(folder, "logs", "load.log"), "a")
    watchers = {h: _spawn(hosts, h, ["watch", "--master", m.address], env, log)
                for h, m in pc.masters.items()}
    nodes = ",".join(f"{n}={c.address}" for n, c in pc.nodes.items())
    load = _spawn(hosts, "e", ["load", "--master", pc.seed, "--nodes", nodes,
                               "--read-timeout-s", str(read_timeout_s)], env, log)
    try:
        if not load.ready.wait(120):
            raise RuntimeError(f"the load did not start (see {log.name})")
        t0 = load.t_ready
        say(f"load running on host e (writer, 2 readers); {len(cuts)} cuts in {duration_s:.0f} s")
        for cut in sorted(cuts, key=lambda c: c.at_s):
            time.sleep(max(0.0, t0 + cut.at_s - time.time()))
            if cut.name == "leader":
                cut.target = next((a for a in pc.seed.split("|")
                                   if load.current(a) == "leader"), pc.seed.split("|")[0])
                cut.host = pc.master_host(cut.target)
            else:
                cut.target = next(n for n, c in pc.nodes.items()
                                  if c.address.startswith(hosts.on(cut.host, "data").address + ":"))
            hosts.cut(cut.host, cut.network)
            cut.t_cut = time.time()
            say(f"t={cut.t_cut - t0:5.1f}s  cut {cut.name}: host {cut.host}'s {cut.network} link "
                f"down ({cut.target})")
            time.sleep(max(0.0, cut.t_cut + cut.for_s - time.time()))
            hosts.mend(cut.host, cut.network)
            cut.t_mend = time.time()
            say(f"t={cut.t_mend - t0:5.1f}s  mended {cut.name}")
        time.sleep(max(0.0, t0 + duration_s - time.time()))
        t_end = time.time()
        say("load stopped; reading every acknowledged key back")
        load.finish(timeout_s=300)
    finally:
        for w in watchers.values():
            w.finish(timeout_s=10)
        if load.proc.poll() is None:
            load.proc.kill()
        log.close()
    if load.result is None:
        raise RuntimeError(f"the load ended without a report (see {log.name})")
    with open(os.path.join(folder, "load.json"), "w") as f:     # every timestamp, for plots
        json.dump(dict(load.result, t_ready=load.t_ready, transitions=load.transitions,
                       cuts=[asdict(c) for c in cuts]), f)
    return _report(load, watchers, pc, cuts, t_end, read_timeout_s)


def _report(load: _Child, watchers: dict[str, _Child], pc: PartitionCluster, cuts: list[Cut],
            t_end: float, read_timeout_s: float) -> PartitionReport:
    r = load.result
    puts = sorted(r["puts_ok"])
    gets = sorted(t for t, _took in r["gets_ok"])
    failures = [f"{r[k]} {k.replace('_', ' ')}" for k in
                ("lost", "resurrected", "wrong_reads", "stale_reads") if r[k]]
    rows = []
    ordered = sorted(cuts, key=lambda c: c.at_s)
    for k, cut in enumerate(ordered):
        until = ordered[k + 1].t_cut if k + 1 < len(ordered) else t_end
        row = dict(cut=cut.name, host=cut.host, network=cut.network, target=cut.target,
                   at_s=round(cut.t_cut - load.t_ready, 1), for_s=round(cut.t_mend - cut.t_cut, 1),
                   recovery_s=round(max(longest_gap(puts, cut.t_cut, until),
                                        longest_gap(gets, cut.t_cut, until)), 2))

        def since(t, ref):
            return round(t - ref, 2) if t is not None else None

        if cut.name == "leader":
            other = next(a for a in pc.seed.split("|") if a != cut.target)
            row.update(
                stepdown_s=since(watchers[cut.host].first(cut.target, {"standby", "unreachable"},
                                                          cut.t_cut), cut.t_cut),
                takeover_s=since(load.first(other, {"warming", "leader"}, cut.t_cut), cut.t_cut),
                serving_s=since(load.first(other, {"leader"}, cut.t_cut), cut.t_cut),
                rejoin_s=since(load.first(cut.target, {"standby"}, cut.t_mend), cut.t_mend))
            if None in (row["stepdown_s"], row["takeover_s"]) or \
                    row["stepdown_s"] >= row["takeover_s"]:
                failures.append(f"leader cut: stepped down at {row['stepdown_s']} s, standby "
                                f"took over at {row['takeover_s']} s")
        elif cut.name == "node":
            n = cut.target
            back = [load.first(f"view:{n}", {"alive"}, cut.t_mend),
                    load.first(n, {"serving"}, cut.t_mend)]
            row.update(fenced_s=since(load.first(n, {"fenced"}, cut.t_cut), cut.t_cut),
                       dead_s=since(load.first(f"view:{n}", {"dead"}, cut.t_cut), cut.t_cut),
                       rejoin_s=since(max(back), cut.t_mend) if None not in back else None)
            if None in (row["fenced_s"], row["dead_s"]) or row["fenced_s"] > row["dead_s"]:
                failures.append(f"node cut: {n} fenced at {row['fenced_s']} s, declared dead "
                                f"at {row['dead_s']} s")
        else:
            took = [s for t, s in r["gets_ok"] if cut.t_cut <= t <= cut.t_mend]
            row.update(max_read_s=round(max(took, default=0.0), 2), reads_during=len(took),
                       rejoin_s=since(load.first(cut.target, {"serving"}, cut.t_mend),
                                      cut.t_mend))
            if not took or row["max_read_s"] > read_timeout_s + 1.0:
                failures.append(f"replica cut: {len(took)} reads, the slowest "
                                f"{row['max_read_s']} s (read_timeout_s {read_timeout_s})")
        if row["recovery_s"] >= MAX_RECOVERY_S:
            failures.append(f"{cut.name} cut: recovery took {row['recovery_s']} s")
        if row.get("rejoin_s") is None:
            failures.append(f"{cut.name} cut: {cut.target} did not rejoin after the mend")
        rows.append(row)
    return PartitionReport(
        acked_puts=r["acked_puts"], removed=r["removed"], lost=r["lost"],
        resurrected=r["resurrected"], wrong_reads=r["wrong_reads"],
        stale_reads=r["stale_reads"], reads=r["reads"], read_errors=r["read_errors"],
        not_found_live=r["not_found_live"], put_errors=r["put_errors"], cuts=rows,
        failures=failures, examples=r["examples"] + r["stale"])
