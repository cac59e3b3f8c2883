"""The invariants checked after every batch: processes, reference reads, probes, memory.

    alive        every watched process still runs (its exit code otherwise)
    reads        a plain KVClient (client token, no metadata cache: every read asks
                 the master) reads each reference object over shared memory and
                 over TCP and compares the bytes; wrong bytes and failed reads are
                 counted apart
    probes       one well-formed request per surface on a fresh connection: a data
                 PING after the handshake (TCP and Unix socket), a master Exists, an
                 HTTP GET /v1/models; a surface that stopped answering shows here
                 even when its process lives
    rss          resident memory of master, node and conductor
    cross-tenant tenant fuzz-b's token asks for tenant fuzz-a's objects: get, exists
    reads        and lookup on the master, a raw GET on the data port (TCP and Unix
                 socket); an answer that returns bytes or confirms the key (found,
                 True, metadata, or a NotFound other than a missing key's) counts

The reference objects (``fuzz-ref/<i>``, sizes from 0 B to 1 MiB, bytes from
the seed) are put and hard-pinned at the start, so the node's eviction never
takes them while fuzzed writes fill its DRAM; no generator makes a key with
that prefix. RSS is ``VmRSS - RssShmem`` from ``/proc/PID/status``: the
node's DRAM tier is a shared-memory segment of fixed size (``--dram``)
whose pages count in VmRSS as they are first touched, which is not growth
of the process (psutil's ``rss`` when ``/proc`` is not there).
"""

from __future__ import annotations

import json
import os
import random
import urllib.request

from kvstore.errors import KVStoreError
from kvstore.tools.faults.fuzz.cluster import TENANT_TOKENS, Target

REF_PREFIX = "fuzz-ref/"
_REF_SIZES = (0, 1, 7, 512, 4096, 65536, 1 << 20, 33_333)


def reference_values(seed: int, count: int = 16) -> dict[str, bytes]:
    """The reference objects of a run: key -> bytes (deterministic in ``seed``)."""
    rng = random.Random(f"{seed}:reference")
    return {f"{REF_PREFIX}{i}": rng.randbytes(_REF_SIZES[i % len(_REF_SIZES)])
            for i in range(count)}


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` without shared-memory pages (0: cannot be read)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        kib = int(fields["VmRSS"].split()[0]) - int(fields.get("RssShmem", "0 kB").split()[0])
        return kib * 1024
    except (OSError, KeyError, ValueError):
        pass
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:      # no psutil, or the process is gone
        return 0


class Checker:
    """Puts the reference objects, then checks the invariants on demand.

    Args:
        target: the cluster.
        seed: the run's seed (reference bytes).

    Raises:
        KVStoreError: the reference objects cannot be put (the cluster is not usable).
    """

    def __init__(self, target: Target, seed: int):
        from kvstore.client import KVClient

        self.target = target
        self.values = reference_values(seed)
        token = target.tokens["client"]
        self.shm = KVClient(target.master, token=token, meta_cache_entries=0, timeout_s=5.0)
        self.tcp = KVClient(target.master, token=token, meta_cache_entries=0, timeout_s=5.0,
                            prefer_shm=False)
        for key, value in self.values.items():
            self.shm.put(key, value)
            self.shm.pin(key)
        from kvstore.tools.faults.fuzz.mutate import POOL_KEYS

        rng = random.Random(f"{seed}:pool")
        for key in POOL_KEYS:        # real objects for the generators' keys to hit
            value = rng.randbytes(rng.randint(0, 4096))
            try:
                self.shm.put(key, value)
            except KVStoreError:     # attached to a cluster fuzzed before: taken already
                pass

    def read_references(self) -> tuple[int, int, int]:
        """Read every reference object on both transports: (reads, wrong bytes, failures)."""
        reads = wrong = failed = 0
        for kv in (self.shm, self.tcp):
            for key, value in self.values.items():
                reads += 1
                try:
                    got = kv.get(key)
                except KVStoreError:
                    failed += 1
                    continue
                if bytes(got) != value:
                    wrong += 1
        return reads, wrong, failed

    def probe(self) -> list[str]:
        """One well-formed request per surface; the surfaces that did not answer it."""
        from kvstore.transfer.protocol import Op
        from kvstore.transfer.tcp import NodeConnection

        t = self.target
        token = t.tokens["client"]
        bad = []
        for name, kw in (("data-tcp", {}), ("data-unix", {"unix_address": t.node_unix})):
            if name == "data-unix" and not t.node_unix:
                continue
            try:
                conn = NodeConnection(*t.node_tcp, timeout_s=5.0, token=token, **kw)
                try:
                    conn.call(Op.PING, "")
                finally:
                    conn.close()
            except KVStoreError:
                bad.append(name)
        try:
            self.tcp.batch_exists([REF_PREFIX + "0"])
        except KVStoreError:
            bad.append("master")
        if t.http:
            req = urllib.request.Request(f"http://{t.http}/v1/models",
                                         headers={"Authorization": f"Bearer {token}"})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    json.loads(r.read())
            except (OSError, ValueError):
                bad.append("http")
        if t.resp and not _resp_answers(t.resp, token):
            bad.append("resp")
        return bad

    def close(self) -> None:
        self.shm.close()
        self.tcp.close()


def exited(pids: dict[str, int], popen: dict | None = None) -> dict[str, int]:
    """Watched processes that are gone: name -> exit code (-1: unknown, not our child)."""
    out = {}
    for name, pid in pids.items():
        proc = (popen or {}).get(name)
        if proc is not None:
            rc = proc.poll()
            if rc is not None:
                out[name] = rc
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            out[name] = -1
        except PermissionError:
            pass
    return out


def _resp_answers(address: str, token: str) -> bool:
    """Whether the RESP front answers AUTH and PING with the client token."""
    import socket

    host, _, port = address.rpartition(":")
    auth = b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(token), token.encode())
    try:
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(auth + b"PING\r\n")
            got = b""
            while len(got) < 12 and (data := s.recv(64)):
                got += data
        return got == b"+OK\r\n+PONG\r\n"
    except OSError:
        return False


#: Tenant fuzz-a's objects, which tenant fuzz-b's token must never read or confirm.
SECRET_PREFIX = f"@{TENANT_TOKENS['tenant_a']}/secret/"


class TenantCheck:
    """Tenant ``fuzz-a`` puts and pins a few objects; each :meth:`check`, tenant
    ``fuzz-b``'s token asks for them every way it can and counts the answers that
    return or confirm one (cross-tenant reads: the invariant is 0).

    Raises:
        KVStoreError: the objects cannot be put.
    """

    def __init__(self, target: Target, seed: int, count: int = 8):
        from kvstore.client import KVClient

        self.target = target
        rng = random.Random(f"{seed}:tenant")
        self.secrets = {f"{SECRET_PREFIX}{i}": rng.randbytes(rng.randint(1, 4096))
                        for i in range(count)}
        self.owner = KVClient(target.master, token=target.tokens["tenant_a"], timeout_s=5.0)
        self.other = KVClient(target.master, token=target.tokens["tenant_b"],
                              meta_cache_entries=0, timeout_s=5.0, prefer_shm=False)
        for key, value in self.secrets.items():
            try:
                self.owner.put(key, value)
            except KVStoreError:     # attached to a cluster checked before: there already
                pass
            self.owner.pin(key)

    @staticmethod
    def available(target: Target) -> bool:
        return all(name in target.tokens for name in TENANT_TOKENS)

    def check(self) -> tuple[int, int]:
        """(tries, cross-tenant reads) of one round over every object."""
        from kvstore.errors import NotFound

        tries = crossed = 0
        kv = self.other
        never = self._miss_message(f"{SECRET_PREFIX}never-stored")
        for key in self.secrets:
            tries += 3
            try:
                kv.get(key)
                crossed += 1
            except NotFound as err:
                crossed += err.message != never
            except KVStoreError:
                pass
            crossed += bool(kv.exists(key))
            crossed += not isinstance(kv.lookup([key])[0], KVStoreError)
        for tried, hit in (self._raw(kw) for kw in self._data_ports()):
            tries += tried
            crossed += hit
        return tries, crossed

    def _miss_message(self, key: str) -> str:
        from kvstore.errors import NotFound

        try:
            self.other.get(key)
        except NotFound as err:
            return err.message
        except KVStoreError:
            pass
        return ""

    def _data_ports(self) -> list[dict]:
        ports = [{}]
        if self.target.node_unix:
            ports.append({"unix_address": self.target.node_unix})
        return ports

    def _raw(self, kw: dict) -> tuple[int, int]:
        """Raw data-port GETs of every object with fuzz-b's token: (tries, answered OK)."""
        from kvstore._proto import kvstore_pb2 as pb
        from kvstore.transfer.protocol import Op
        from kvstore.transfer.tcp import NodeConnection

        hits = 0
        try:
            conn = NodeConnection(*self.target.node_tcp, timeout_s=5.0,
                                  token=self.target.tokens["tenant_b"], **kw)
        except KVStoreError:
            return 0, 0              # the probe counts a data port that does not answer
        try:
            for key in self.secrets:
                conn.send(Op.GET, key, 0, 0, 0, None)
                code, _oid, size, *_ = conn.recv_header()
                if code == pb.OK:
                    hits += 1
                    conn.recv_value_into(size, memoryview(bytearray(size)))
        except KVStoreError:
            pass
        finally:
            conn.close()
        return len(self.secrets), hits

    def close(self) -> None:
        self.owner.close()
        self.other.close()
