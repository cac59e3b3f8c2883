"""``kvstore chaos``: kill things on a fresh local cluster and count what breaks.

    etcd   shard 0: leader + standby   shard 1: leader + standby
           nodes n0 n1 n2 (replica_num=2)
    writer: puts w-<i> (bytes derived from i), retrying each until acknowledged
    readers x2: read random acknowledged keys, compare bytes with the expected ones
    t = kill_node_at_s:   kill -9 node n0
    t = kill_leader_at_s: kill -9 the leader of shard 0 (its standby takes over)
    end: every acknowledged key read back with a fresh client

Reported: ``acked_puts``; ``lost`` (acknowledged, then unreadable or wrong at
the end); ``wrong_reads`` (a read that returned bytes other than the ones
put: must be 0, always); ``max_recovery_s`` (after each kill, the longest
time puts or reads went without one success); ``failover_s`` (leader kill
to the standby serving); ``repairs`` (-1: not an admin's credentials).

``--attach FILE`` runs the same load and kills on a cluster that is already
running (e.g. ``kvstore hosts``'s, across network namespaces), described by
a JSON file (:meth:`ChaosTarget.attach`).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

import grpc

from kvstore import rpc
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import KVStoreError, PermissionDenied

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ChaosReport:
    acked_puts: int
    lost: int
    wrong_reads: int
    max_recovery_s: float
    failover_s: float
    reads: int
    read_errors: int
    put_errors: int
    repairs: int

    def to_dict(self) -> dict:
        return asdict(self)


def value_for(i: int, size_bytes: int) -> bytes:
    """The deterministic value of key ``w-<i>``."""
    return random.Random(i).randbytes(size_bytes)


@dataclass
class ChaosTarget:
    """The cluster chaos works on: where clients start, each shard's masters, the nodes,
    and how to kill each (``kill -9``)."""

    seed: str                                              # clients' --master
    shards: list[list[tuple[str, Callable[[], None]]]]     # per shard: (address, kill)
    nodes: dict[str, Callable[[], None]]                   # node id -> kill
    creds: rpc.ClientCredentials | None = None             # a client token, TLS files

    @staticmethod
    def of_cluster(cluster) -> "ChaosTarget":
        """The target of a :class:`~kvstore.tools.cluster.launcher.StoreCluster` started here."""
        return ChaosTarget(
            cluster.master,
            [[(m.address, m.proc.kill) for m in shard] for shard in cluster.shards],
            {name: child.proc.kill for name, child in cluster.nodes.items()})

    @staticmethod
    def attach(path: str, creds: rpc.ClientCredentials | None = None) -> "ChaosTarget":
        """A running cluster described by a JSON file (``kvstore hosts`` writes one)::

            {"seed": "a|b", "shards": [[{"address": "h:p", "pid": 12}, ...], ...],
             "nodes": {"b0": {"pid": 34}, ...}}

        Kills are ``kill -9 PID``: the processes must run on this machine (any
        network namespace).

        Raises:
            OSError, ValueError, KeyError: the file cannot be read or is malformed.
        """
        with open(path, encoding="utf-8") as f:
            desc = json.load(f)

        def killer(pid: int) -> Callable[[], None]:
            return lambda: os.kill(int(pid), signal.SIGKILL)

        return ChaosTarget(
            str(desc["seed"]),
            [[(str(m["address"]), killer(m["pid"])) for m in shard] for shard in desc["shards"]],
            {str(name): killer(n["pid"]) for name, n in desc["nodes"].items()}, creds)


def serving(address: str, creds: rpc.ClientCredentials | None = None) -> bool:
    """Whether the master at ``address`` serves client RPCs (is its shard's leader)."""
    with rpc.channel(address, creds) as ch:
        try:
            pb_grpc.MasterStub(ch).Exists(pb.ExistsRequest(keys=[]), timeout=1.0)
            return True
        except grpc.RpcError:
            return False


class _Load:
    """The writer and readers, with success timestamps per kind of operation."""

    def __init__(self, seed: str, value_bytes: int, creds: rpc.ClientCredentials | None = None):
        self.seed = seed
        self.creds = creds
        self.value_bytes = value_bytes
        self.acked: list[int] = []          # appended by the writer only
        self.ok_times: dict[str, list[float]] = {"put": [], "get": []}
        self.wrong_reads = 0
        self.reads = 0
        self.read_errors = 0
        self.put_errors = 0
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def _client(self):
        from kvstore.client.client import KVClient

        creds = self.creds or rpc.ClientCredentials()
        return KVClient(self.seed, replica_num=2, timeout_s=5.0, read_timeout_s=2.0,
                        failover_wait_s=15.0, meta_cache_entries=0, token=creds.token,
                        tls=creds.tls)

    def writer(self) -> None:
        kv = self._client()
        i = 0
        try:
            while not self.stop.is_set():
                try:
                    kv.put(f"w-{i}", value_for(i, self.value_bytes))
                except KVStoreError as exc:
                    self.put_errors += 1
                    log.debug("put w-%d: %s", i, exc)
                    time.sleep(0.05)
                    continue                 # the same key again: puts are idempotent
                self.acked.append(i)
                with self._lock:
                    self.ok_times["put"].append(time.monotonic())
                i += 1
                time.sleep(0.005)
        finally:
            kv.close()

    def reader(self, seed: int) -> None:
        kv = self._client()
        rng = random.Random(seed)
        try:
            while not self.stop.is_set():
                if not self.acked:
                    time.sleep(0.01)
                    continue
                i = self.acked[rng.randrange(len(self.acked))]
                try:
                    got = kv.get(f"w-{i}")
                except KVStoreError as exc:
                    self.read_errors += 1
                    log.debug("get w-%d: %s", i, exc)
                    time.sleep(0.05)
                    continue
                self.reads += 1
                if bytes(got) != value_for(i, self.value_bytes):
                    self.wrong_reads += 1
                    log.error("wrong bytes for w-%d", i)
                with self._lock:
                    self.ok_times["get"].append(time.monotonic())
                time.sleep(0.002)
        finally:
            kv.close()

    def longest_gap(self, start: float, end: float) -> float:
        """Longest stretch in [start, end] with no successful put, or no successful get."""
        worst = 0.0
        with self._lock:
            for times in self.ok_times.values():
                prev = start
                for t in times:
                    if t < start:
                        continue
                    if t > end:
                        break
                    worst = max(worst, t - prev)
                    prev = t
                if prev < end:
                    worst = max(worst, end - prev)
        return worst


def run_chaos(*, duration_s: float = 30.0, kill_node_at_s: float = 8.0,
              kill_leader_at_s: float = 18.0, value_bytes: int = 4096, etcd: str = "local",
              log_dir: str | None = None, on_step=None, attach: str | None = None,
              kill_node: str = "", creds: rpc.ClientCredentials | None = None) -> ChaosReport:
    """Start a cluster (or attach to one), run the load, kill a node and a shard
    leader; see the module doc.

    Args:
        etcd: etcd URL, or ``"local"`` to start a throwaway one (needs ``etcd`` on PATH).
        attach: a running cluster's description (:meth:`ChaosTarget.attach`)
            instead of a fresh local cluster; it is not stopped at the end.
        kill_node: the node to kill (default: n0, or an attached cluster's first).
        creds: the clients' credentials (default: the environment's).
    """
    from kvstore.tools.cluster.launcher import start_store_cluster

    say = on_step or (lambda line: None)
    creds = creds or rpc.ClientCredentials.resolve()
    if attach:
        target, cluster = ChaosTarget.attach(attach, creds), None
        say(f"attached to {target.seed}: {len(target.shards)} shards, {len(target.nodes)} nodes")
    else:
        log_dir = log_dir or tempfile.mkdtemp(prefix="kvstore-chaos-")
        cluster = start_store_cluster(masters=2, nodes=3, standbys=1, etcd=etcd,
                                      node_ttl_ms=2000, log_dir=log_dir, on_step=say)
        target = ChaosTarget.of_cluster(cluster)
        target.creds = creds
    try:
        return _run(target, kill_node or next(iter(target.nodes)), duration_s, kill_node_at_s,
                    kill_leader_at_s, value_bytes, say)
    finally:
        if cluster is not None:
            cluster.stop()


def _run(target: ChaosTarget, kill_node: str, duration_s: float, kill_node_at_s: float,
         kill_leader_at_s: float, value_bytes: int, say) -> ChaosReport:
    from kvstore.client.client import KVClient

    creds = target.creds

    def leader_of(shard) -> bool:
        return any(serving(address, creds) for address, _kill in shard)

    # Wait until each shard has a leader before loading it.
    deadline = time.monotonic() + 15
    while not all(leader_of(shard) for shard in target.shards):
        if time.monotonic() > deadline:
            raise RuntimeError("no shard leader elected within 15 s")
        time.sleep(0.1)
    load = _Load(target.seed, value_bytes, creds)
    threads = [threading.Thread(target=load.writer, daemon=True)]
    threads += [threading.Thread(target=load.reader, args=(s,), daemon=True) for s in (1, 2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    say("load running")

    time.sleep(max(0.0, t0 + kill_node_at_s - time.monotonic()))
    target.nodes[kill_node]()
    t_node = time.monotonic()
    say(f"t={t_node - t0:.1f}s: kill -9 node {kill_node}")

    time.sleep(max(0.0, t0 + kill_leader_at_s - time.monotonic()))
    shard = target.shards[0]
    leader = next((m for m in shard if serving(m[0], creds)), shard[0])
    leader[1]()
    t_leader = time.monotonic()
    say(f"t={t_leader - t0:.1f}s: kill -9 shard 0 leader {leader[0]}")
    failover_s = -1.0
    while time.monotonic() - t_leader < 30:
        if any(serving(address, creds) for address, _kill in shard if address != leader[0]):
            failover_s = time.monotonic() - t_leader
            break
        time.sleep(0.05)
    say(f"shard 0 failover: {failover_s:.2f} s")

    time.sleep(max(0.0, t0 + duration_s - time.monotonic()))
    load.stop.set()
    for t in threads:
        t.join(timeout=30)
    t_end = time.monotonic()
    max_recovery = max(load.longest_gap(t_node, min(t_leader, t_end)),
                       load.longest_gap(t_leader, t_end))

    lost = 0
    creds = creds or rpc.ClientCredentials()
    with KVClient(target.seed, prefer_shm=False, meta_cache_entries=0, failover_wait_s=15.0,
                  token=creds.token, tls=creds.tls) as kv:
        acked = list(load.acked)
        for start in range(0, len(acked), 256):
            part = acked[start:start + 256]
            for i, got in zip(part, kv.batch_get([f"w-{i}" for i in part])):
                if isinstance(got, KVStoreError) or bytes(got) != value_for(i, value_bytes):
                    lost += 1
                    log.error("acknowledged w-%d unreadable at the end: %s", i,
                              got if isinstance(got, KVStoreError) else "wrong bytes")
        try:
            repairs = sum(s.counters["repairs"] for s in kv.stat())
        except PermissionDenied:           # shard stats are an admin's
            repairs = -1
    return ChaosReport(acked_puts=len(acked), lost=lost, wrong_reads=load.wrong_reads,
                       max_recovery_s=round(max_recovery, 2), failover_s=round(failover_s, 2),
                       reads=load.reads, read_errors=load.read_errors,
                       put_errors=load.put_errors, repairs=repairs)
