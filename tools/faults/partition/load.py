"""The partition run's load and probes, on the client host.

    python -m kvstore.tools.faults.partition.load load --master A|B --nodes b0=H:P,...
        --duration-s S
    python -m kvstore.tools.faults.partition.load watch --master ADDR --duration-s S

``load`` runs a writer and two readers and probes the cluster; it prints
``READY <unix s>`` once the load runs, ``T <unix s> <target> <state>`` at
each change a probe sees, and, once a line arrives on its stdin, stops the
load, checks, and prints one JSON object:

    writer    puts w-<i> (bytes derived from i), each retried until acknowledged;
              after every 8th, removes a random earlier live key
    readers   get random acknowledged keys (removed ones too), metadata cache on:
              wrong bytes, and bytes of a key whose removal had returned before
              the read began (stale), must never happen
    probes    every 50 ms: each master (leader / standby / warming / unreachable),
              each node's data port (serving / fenced / unreachable), the
              leader's view of the nodes (alive or not); each change printed
    end       every acknowledged key read back by a fresh client (no cache):
              live keys byte-exact, removed keys NotFound

``watch`` probes one master from its own host (its own address answers there
even while the host's links are down) and prints its ``T`` lines (when a
cut-off leader stopped serving) until a line arrives on its stdin. Times are
unix seconds (``time.time()``): every process runs on one machine, so they
compare.

Credentials: ``$KVSTORE_TOKEN`` (a client token) for the load,
``$KVSTORE_ADMIN_TOKEN`` for the probes of the leader's view and the watch;
TLS files from ``$KVSTORE_TLS_*``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

import grpc

from kvstore import rpc
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import (Fenced, IndexIncomplete, KVStoreError, NotFound, NotLeader,
                            Unavailable, from_rpc_error)
from kvstore.tls import TlsFiles, client_context
from kvstore.tools.faults.chaos import value_for
from kvstore.transfer.protocol import Op
from kvstore.transfer.tcp import NodeConnection

PROBE_S = 0.05
REMOVE_EVERY = 8
PROBE_KEY = "partition-probe"       # never stored: a serving node answers NotFound


class Transitions:
    """Each target's state changes, printed as ``T <unix s> <target> <state>`` lines."""

    def __init__(self):
        self._last: dict[str, str] = {}
        self._lock = threading.Lock()

    def note(self, target: str, state: str) -> None:
        with self._lock:
            if self._last.get(target) != state:
                self._last[target] = state
                print(f"T {time.time():.3f} {target} {state}", flush=True)


def master_state(stub, timeout_s: float = 0.5) -> str:
    """leader, warming (leader, index incomplete), standby or unreachable."""
    try:
        stub.Exists(pb.ExistsRequest(keys=[]), timeout=timeout_s)
        return "leader"
    except grpc.RpcError as exc:
        err = from_rpc_error(exc)
        if isinstance(err, NotLeader):
            return "standby"
        if isinstance(err, IndexIncomplete):
            return "warming"
        return "unreachable"


def watch_master(address: str, creds: rpc.ClientCredentials, stop: threading.Event,
                 seen: Transitions) -> None:
    with rpc.channel(address, creds) as ch:
        stub = pb_grpc.MasterStub(ch)
        while not stop.is_set():
            seen.note(address, master_state(stub))
            stop.wait(PROBE_S)


def watch_node(node: str, address: str, token: str | None, tls, stop: threading.Event,
               seen: Transitions) -> None:
    host, port = address.rsplit(":", 1)
    conn = None
    while not stop.is_set():
        try:
            if conn is None:
                conn = NodeConnection(host, int(port), timeout_s=0.5, token=token, tls=tls)
            conn.call(Op.GET, PROBE_KEY)
            state = "serving?"                     # a probe key that exists: not ours
        except NotFound:
            state = "serving"
        except Unavailable as exc:
            state = "fenced" if isinstance(exc, Fenced) else "unreachable"
            if state == "unreachable" and conn is not None:
                conn.close()
                conn = None
        except KVStoreError as exc:
            state = type(exc).__name__
        seen.note(node, state)
        stop.wait(PROBE_S)
    if conn is not None:
        conn.close()


def watch_view(kv, stop: threading.Event, seen: Transitions) -> None:
    """The leader's view of the nodes (alive or dead), from ``kv.stat()``."""
    while not stop.is_set():
        try:
            for shard in kv.stat():
                for n in shard.nodes:
                    seen.note(f"view:{n.address.node_id}", "alive" if n.alive else "dead")
        except KVStoreError:
            pass
        stop.wait(0.2)


class Load:
    """The writer and the readers; what they saw."""

    def __init__(self, master: str, value_bytes: int, read_timeout_s: float):
        self.master = master
        self.value_bytes = value_bytes
        self.read_timeout_s = read_timeout_s
        self.acked: list[int] = []             # appended by the writer only
        self.removed_at: dict[int, float] = {}  # removal returned at (unix s)
        self.unsure: set[int] = set()          # a removal that failed: maybe removed
        self.puts_ok: list[float] = []
        self.gets_ok: list[tuple[float, float]] = []   # (start, seconds) of good reads
        self.counts = dict(wrong_reads=0, stale_reads=0, reads=0, read_errors=0,
                           not_found_live=0, put_errors=0, remove_errors=0)
        self.stale: list[str] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()

    def client(self, cache: bool = True):
        from kvstore.client.client import KVClient

        return KVClient(self.master, replica_num=2, timeout_s=5.0,
                        read_timeout_s=self.read_timeout_s, failover_wait_s=15.0,
                        meta_cache_entries=65536 if cache else 0, prefer_shm=False)

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def writer(self, seed: int) -> None:
        rng = random.Random(seed)
        with self.client() as kv:
            i = 0
            while not self.stop.is_set():
                try:
                    kv.put(f"w-{i}", value_for(i, self.value_bytes))
                except KVStoreError:
                    self.count("put_errors")
                    time.sleep(0.05)
                    continue                       # the same key again: puts are idempotent
                self.acked.append(i)
                self.puts_ok.append(time.time())
                if i % REMOVE_EVERY == REMOVE_EVERY - 1:
                    self._remove_one(kv, rng)
                i += 1
                time.sleep(0.005)

    def _remove_one(self, kv, rng: random.Random) -> None:
        live = [j for j in self.acked[-2000:]
                if j not in self.removed_at and j not in self.unsure]
        j = rng.choice(live)
        try:
            kv.remove(f"w-{j}")
            self.removed_at[j] = time.time()
        except NotFound:
            pass                  # invisible now (its replicas cut off): still live
        except KVStoreError:
            self.count("remove_errors")
            self.unsure.add(j)

    def reader(self, seed: int) -> None:
        rng = random.Random(seed)
        with self.client() as kv:
            while not self.stop.is_set():
                if not self.acked:
                    time.sleep(0.01)
                    continue
                i = self.acked[rng.randrange(len(self.acked))]
                gone_at = self.removed_at.get(i)
                t0 = time.time()
                try:
                    got = kv.get(f"w-{i}")
                except NotFound:
                    if gone_at is None and i not in self.unsure:
                        self.count("not_found_live")
                    continue
                except KVStoreError:
                    self.count("read_errors")
                    time.sleep(0.02)
                    continue
                took = time.time() - t0
                self.count("reads")
                if bytes(got) != value_for(i, self.value_bytes):
                    self.count("wrong_reads")
                elif gone_at is not None and gone_at < t0:
                    self.count("stale_reads")
                    self.stale.append(f"w-{i}: read at {t0:.3f}, removed at {gone_at:.3f}")
                else:
                    with self._lock:
                        self.gets_ok.append((t0, took))
                time.sleep(0.002)

    def verify(self) -> dict:
        """Every acknowledged key read back with a fresh client (no metadata cache)."""
        lost, resurrected = [], []
        with self.client(cache=False) as kv:
            acked = list(self.acked)
            for start in range(0, len(acked), 256):
                part = acked[start:start + 256]
                for i, got in zip(part, kv.batch_get([f"w-{i}" for i in part])):
                    if i in self.unsure:
                        continue
                    if i in self.removed_at:
                        if not isinstance(got, NotFound):
                            resurrected.append(f"w-{i}")
                    elif isinstance(got, KVStoreError) or bytes(got) != value_for(
                            i, self.value_bytes):
                        lost.append(f"w-{i}")
        return dict(acked_puts=len(acked), removed=len(self.removed_at), lost=len(lost),
                    resurrected=len(resurrected), examples=(lost + resurrected)[:10])


def _creds(token_env: str) -> rpc.ClientCredentials:
    return rpc.ClientCredentials(token=os.environ.get(token_env) or None,
                                 tls=TlsFiles.client_from_env())


def run_load(args) -> dict:
    from kvstore.client.client import KVClient

    load = Load(args.master, args.value_bytes, args.read_timeout_s)
    done = threading.Event()               # the probes outlast the load and its check
    seen = Transitions()
    admin = _creds("KVSTORE_ADMIN_TOKEN")
    files = TlsFiles.client_from_env()
    tls = client_context(files) if files else None
    view = KVClient(args.master, timeout_s=1.0, failover_wait_s=0.5, token=admin.token,
                    tls=admin.tls)
    probes = [threading.Thread(target=watch_master, args=(a, admin, done, seen), daemon=True)
              for a in args.master.split("|")]
    probes += [threading.Thread(target=watch_node, args=(n, a, os.environ.get("KVSTORE_TOKEN"),
                                                         tls, done, seen), daemon=True)
               for n, a in (p.split("=", 1) for p in args.nodes.split(","))]
    probes.append(threading.Thread(target=watch_view, args=(view, done, seen), daemon=True))
    workers = [threading.Thread(target=load.writer, args=(args.seed,), daemon=True)]
    workers += [threading.Thread(target=load.reader, args=(args.seed + k,), daemon=True)
                for k in (1, 2)]
    for t in probes + workers:
        t.start()
    while not load.acked:
        time.sleep(0.05)
    print(f"READY {time.time():.3f}", flush=True)
    sys.stdin.readline()                  # the caller says when: after its last mend
    load.stop.set()
    for t in workers:
        t.join(timeout=30)
    result = load.verify()
    done.set()
    for t in probes:
        t.join(timeout=10)
    view.close()
    return dict(result, **load.counts, stale=load.stale[:10], puts_ok=load.puts_ok,
                gets_ok=load.gets_ok)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvstore.tools.faults.partition.load")
    sub = p.add_subparsers(dest="mode", required=True)
    lp = sub.add_parser("load")
    lp.add_argument("--master", required=True)
    lp.add_argument("--nodes", required=True, help="node=host:port,...")
    lp.add_argument("--value-bytes", type=int, default=4096)
    lp.add_argument("--read-timeout-s", type=float, default=2.0)
    lp.add_argument("--seed", type=int, default=1)
    wp = sub.add_parser("watch")
    wp.add_argument("--master", required=True)
    args = p.parse_args(argv)
    if args.mode == "load":
        print(json.dumps(run_load(args)), flush=True)
        return
    stop = threading.Event()
    watcher = threading.Thread(target=watch_master, daemon=True, args=(
        args.master, _creds("KVSTORE_ADMIN_TOKEN"), stop, Transitions()))
    watcher.start()
    print(f"READY {time.time():.3f}", flush=True)
    sys.stdin.readline()
    stop.set()
    watcher.join(timeout=5)


if __name__ == "__main__":
    main()
