"""The store-wide event log on real processes: two master shards with ``--auth``,
two small nodes that evict, ``kvctl events`` as a process a router would run.

    put / remove / admin evict / node pressure   each an event, counted by the masters
    kvctl events killed mid-stream, resumed      no gap, no repeated sequence
    a resume of a gone seq, a master restart     EventsLost (exit 3), or a 'lost' line
    a client token, no token                     refused
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import shlex
import signal
import subprocess
import sys
import threading
from collections import Counter, defaultdict

import grpc
import pytest

from kvstore.client import KVClient
from kvstore.client.events import EventWatcher
from kvstore.errors import PermissionDenied, Unauthenticated
from kvstore.rpc import ClientCredentials
from kvstore.tools.cluster.launcher import start_store_cluster
from kvtest import wait_for

KiB = 1024
TOKENS = {role: f"{role}-{secrets.token_hex(16)}" for role in ("admin", "client", "node",
                                                                 "metrics")}
RING = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("events")
    auth = tmp / "tokens"
    auth.write_text("".join(f"{role} {tok}\n" for role, tok in TOKENS.items()))
    c = start_store_cluster(masters=2, nodes=2, dram="4MiB", eviction_policy="default",
                            log_dir=str(tmp), master_args=("--auth", str(auth), "--event-log",
                                                           str(RING)),
                            node_args=("--auth", str(auth)), env={"KVSTORE_TOKEN": TOKENS["node"]})
    try:
        yield c
    finally:
        c.stop()


def creds(role: str) -> ClientCredentials:
    return ClientCredentials(token=TOKENS[role])


def kvctl(master: str, role: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvstore.tools.cli.kvctl", "--master", master, "events",
            "--json", *args]


def env_of(role: str) -> dict:
    return {**os.environ, "KVSTORE_TOKEN": TOKENS[role]}


def counters(kv) -> Counter:
    total: Counter = Counter()
    for st in kv.stat():
        total.update(st.counters)
    return total


def test_client_and_anonymous_callers_are_refused(cluster):
    with EventWatcher(cluster.master, creds=creds("client")) as w:
        with pytest.raises(PermissionDenied):
            next(w.events(timeout_s=10))
    with pytest.raises(Unauthenticated):
        EventWatcher(cluster.master, creds=ClientCredentials(token=None))
    out = subprocess.run(kvctl(cluster.master, "client", "--idle", "1"), env=env_of("client"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "PermissionDenied" in out.stderr, out.stderr


def test_every_put_remove_and_eviction_is_one_event(cluster):
    with KVClient(cluster.master, token=TOKENS["admin"], prefer_shm=False) as admin, \
            EventWatcher(cluster.master, creds=creds("metrics")) as w:
        w.wait_ready()
        before = counters(admin)
        with KVClient(cluster.master, token=TOKENS["client"], prefer_shm=False) as kv:
            for i in range(8):
                assert kv.put(f"small/{i}", os.urandom(1000 + i))
            kv.remove("small/0")
            kv.remove("small/1")
            admin.remove("small/2", reason="evict")
            for i in range(48):                  # 12 MiB into 8 MiB of DRAM: evictions
                kv.put(f"big/{i}", os.urandom(256 * KiB))
        got: Counter = Counter()
        seqs: dict[int, list[int]] = defaultdict(list)

        def caught_up() -> bool:
            for ev in w.events(timeout_s=0.2):
                got[ev.kind] += 1
                seqs[ev.shard_id].append(ev.seq)
            now = counters(admin)
            want = {"STORED": now["puts"] - before["puts"],
                    "REMOVED": now["removes"] - before["removes"],
                    "EVICTED": (now["evicts"] - before["evicts"]
                                + now["replicas_evicted"] - before["replicas_evicted"])}
            return dict(got) == want and want["EVICTED"] > 1

        wait_for(caught_up, timeout_s=30, what="events equal to the masters' counters")
        assert got["STORED"] == 56 and got["REMOVED"] == 2
        for shard, s in seqs.items():              # per shard: consecutive, no repeat
            assert s == list(range(s[0], s[0] + len(s))), shard


class Lines:
    """The stdout lines of a process, read by a thread (a test waits with a deadline)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.queue.put(line)

    def take(self, n: int, timeout_s: float = 30.0) -> list[dict]:
        """``n`` JSON lines (fails the test past ``timeout_s`` for one)."""
        try:
            return [json.loads(self.queue.get(timeout=timeout_s)) for _ in range(n)]
        except queue.Empty:
            raise AssertionError(f"no event line within {timeout_s} s") from None


def test_kvctl_resumes_after_a_disconnect_with_no_gap_and_no_repeat(cluster):
    with KVClient(cluster.master, token=TOKENS["client"], prefer_shm=False) as kv:
        kv.put("resume/probe", b"p")
        follower = subprocess.Popen(kvctl(cluster.master, "metrics", "--namespace", "resume/",
                                          "--from", "oldest"),
                                    env=env_of("metrics"), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
        lines = Lines(follower)
        try:
            first = lines.take(1)
            assert first[0]["key"] == "resume/probe" and first[0]["kind"] == "STORED"
            for i in range(20):
                kv.put(f"resume/{i}", os.urandom(100))
            first += lines.take(10)
        finally:
            follower.send_signal(signal.SIGKILL)        # the disconnect: mid-stream
            follower.wait()
        for i in range(20, 40):                          # while nobody listens
            kv.put(f"resume/{i}", os.urandom(100))
        for i in range(0, 40, 4):
            kv.remove(f"resume/{i}")
    last: dict[int, dict] = {}
    for ev in first:
        last[ev["shard"]] = ev
    resume = [f"{s}:{ev['epoch']}:{ev['seq'] + 1}" for s, ev in last.items()]
    args = [a for r in resume for a in ("--from", r)]
    out = subprocess.run(kvctl(cluster.master, "metrics", *args, "--namespace", "resume/",
                               "--idle", "3"),
                         env=env_of("metrics"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    second = [json.loads(line) for line in out.stdout.splitlines()]
    if len(last) < 2:                                   # a shard silent in the first run
        pytest.skip("every resume key fell on one shard")
    keys = Counter()
    by_shard: dict[int, list[int]] = defaultdict(list)
    for ev in first + second:
        by_shard[ev["shard"]].append(ev["seq"])
        keys[(ev["kind"], ev["key"])] += 1
    for shard, s in by_shard.items():
        assert len(s) == len(set(s)), f"shard {shard} repeated a seq"
        assert all(b > a for a, b in zip(s, s[1:])), f"shard {shard} out of order"
    # Every put and remove of the test is there exactly once, across the disconnect.
    assert {k for (kind, k) in keys if kind == "STORED"} == (
        {"resume/probe"} | {f"resume/{i}" for i in range(40)})
    assert {k for (kind, k) in keys if kind == "REMOVED"} == {f"resume/{i}"
                                                              for i in range(0, 40, 4)}
    assert max(keys.values()) == 1


def test_a_sequence_out_of_the_ring_or_of_another_epoch_is_lost_not_silent(cluster):
    with KVClient(cluster.master, token=TOKENS["client"], prefer_shm=False) as kv:
        for i in range(2 * RING + 50):                  # both shards' rings go round
            kv.put(f"ring/{i}", b"x")
    out = subprocess.run(kvctl(cluster.master, "metrics", "--from", "1", "--idle", "2"),
                         env=env_of("metrics"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "no longer in the event log" in out.stderr, out.stderr
    # A master restart starts a new log, under a larger epoch.
    with EventWatcher(cluster.master, creds=creds("metrics"), oldest=True) as w:
        w.wait_ready()
        old = dict(w.cursors)
    cluster.shards[0][0].proc.kill()                    # SIGKILL: its log is gone
    cluster.shards[0][0].proc.wait()
    cluster.restart_master(0)
    out = subprocess.run(kvctl(cluster.master, "metrics", "--from",
                               f"0:{old[0].epoch}:{old[0].next_seq}", "--idle", "2"),
                         env=env_of("metrics"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 3 and "epoch" in out.stderr, out.stderr
    with KVClient(cluster.master, token=TOKENS["client"], prefer_shm=False) as kv:
        for i in range(8):                               # some land on shard 0
            kv.put(f"after-restart/{i}", b"y")
    out = subprocess.run(kvctl(cluster.master, "metrics", "--from",
                               f"0:{old[0].epoch}:{old[0].next_seq}", "--resume-after-loss",
                               "--idle", "3"),
                         env=env_of("metrics"), capture_output=True, text=True, timeout=60)
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert "lost" in lines[0] and lines[0]["shard"] == 0, out.stdout
    after = [ev for ev in lines[1:] if ev.get("shard") == 0]
    assert after and after[0]["epoch"] > old[0].epoch and after[0]["seq"] == 1


def test_a_stopping_master_ends_its_watches_at_once(cluster):
    """SIGTERM: the watch streams end first (UNAVAILABLE), not after the drain's grace."""
    import time

    from kvstore._proto import kvstore_pb2 as pb
    from kvstore._proto import kvstore_pb2_grpc as pb_grpc
    from kvstore.rpc import channel

    shard1 = cluster.shards[1][0]
    with channel(shard1.address, creds("metrics")) as ch:
        stream = pb_grpc.MasterStub(ch).WatchEvents(pb.WatchEventsRequest())
        assert next(stream).events == []                       # the header
        t0 = time.monotonic()
        shard1.proc.terminate()
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                pass
        ended_s = time.monotonic() - t0
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
    assert "stopping" in info.value.details()
    shard1.proc.wait()
    cluster.restart_master(1)
    print(f"watch ended {ended_s:.2f} s after SIGTERM")


def test_a_reader_that_goes_away_ends_kvctl_quietly(cluster):
    """`kvctl events | head -1`: a closed pipe ends the stream with exit 0, no error
    (it was reported as an unreadable token file)."""
    with KVClient(cluster.master, token=TOKENS["client"]) as kv:
        for i in range(3):
            kv.put(f"pipe/{i}", b"x" * 100)
    out = subprocess.run(" ".join(shlex.quote(a) for a in kvctl(cluster.master, "metrics",
                                                                "--from", "oldest", "--idle", "5"))
                         + " | head -1", shell=True, env=env_of("metrics"), capture_output=True,
                         text=True, timeout=60)
    assert len(out.stdout.splitlines()) == 1 and "error" not in out.stderr, out.stderr


def test_what_the_wire_cannot_carry_is_refused_at_once(cluster):
    """A shard the cluster has not, a sequence or epoch of 2**64, a prefix that is
    not text: InvalidArgument before any stream (they hung kvctl after a thread's
    traceback, or were ignored), and kvctl says so in one line."""
    from kvstore.client.events import Cursor
    from kvstore.errors import InvalidArgument

    for kwargs, why in ((dict(start={5: Cursor(0, 1)}), "no shard 5"),
                        (dict(start={0: Cursor(2**64, 1)}), "epoch"),
                        (dict(from_seq=2**64), "from_seq"),
                        (dict(key_prefixes=["ns/\udcff"]), "not text")):
        with pytest.raises(InvalidArgument, match=why):
            EventWatcher(cluster.master, creds=creds("metrics"), **kwargs)
    for args, why in ((("--from", "5:1"), "no shard 5"), (("--namespace", "\udcff"), "not text")):
        out = subprocess.run(kvctl(cluster.master, "metrics", *args, "--idle", "1"),
                             env=env_of("metrics"), capture_output=True, text=True, timeout=60,
                             errors="replace")
        assert out.returncode == 1 and why in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.splitlines()) == 1, out.stderr
