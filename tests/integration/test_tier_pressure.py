"""A real node under pressure: DRAM 64 MiB + SSD 256 MiB, 2 GiB written in mixed sizes.

What must hold, checked with real processes:

* every key the index lists (or a read finds) returns its exact bytes or
  NotFound, never an empty or wrong value, over TCP and shared memory;
* two slow readers hold objects through all of it -- one keeps an
  SHM_ACQUIRE reference, one reads a TCP GET of a large object a little per
  round -- and both get their exact bytes;
* used + free == capacity on every tier after every round (the node's own
  stats through the STATS data op);
* nothing is lost while the SSD has room: after the first 224 MiB (less than
  DRAM's low watermark plus the SSD's high one) every key still reads back
  exact, the node evicted nothing, and no demotion ever failed or found no room.
"""

from __future__ import annotations

import random
import socket
import time

import pytest

from kvstore.client import KVClient, NotFound
from kvstore._proto import kvstore_pb2 as pb
from kvstore.transfer.protocol import REQUEST, RESPONSE, Op, recv_exact_into
from kvstore.transfer.shm import ShmSegment
from kvstore.transfer.tcp import NodeConnection
from kvtest import cluster_running, wait_for

KiB, MiB = 1024, 1024 * 1024
TOTAL_BYTES = 2048 * MiB
SAFE_BYTES = 224 * MiB            # written before the SSD could need to evict
ROUND_BYTES = 64 * MiB
SIZES = [4 * KiB, 60 * KiB + 3, 256 * KiB, 1 * MiB, 1 * MiB + 17, 3 * MiB, 4 * MiB]
POOL = random.Random(2024).randbytes(20 * MiB)


def value(i: int, size: int) -> bytes:
    """Deterministic, distinct bytes for object ``i`` (its index leads, so no two are equal)."""
    head = i.to_bytes(8, "little")[:size]
    off = (i * 7919 * 64) % (len(POOL) - size)
    return head + POOL[off:off + size - len(head)]


@pytest.fixture(scope="module")
def node_cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("pressure")
    with cluster_running(str(base / "logs"), num_nodes=1, dram="64MiB", ssd="256MiB",
                         ssd_dir=str(base), eviction_policy="default") as running:
        yield running


class SlowTcpReader:
    """A raw TCP GET whose value is read a little at a time (the node's send blocks meanwhile)."""

    def __init__(self, host: str, port: int, key: str):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
        self.sock.connect((host, port))
        kb = key.encode()
        self.sock.sendall(REQUEST.pack(Op.GET, 0, len(kb), 0, 0, 0, 0) + kb)
        hdr = bytearray(RESPONSE.size)
        recv_exact_into(self.sock, memoryview(hdr))
        code, _f, _m, _r, _oid, self.size, _ck, _off, _serial = RESPONSE.unpack(hdr)
        assert code == pb.OK
        self.buf = bytearray(self.size)
        self.got = 0

    def read_some(self, n: int) -> None:
        n = min(n, self.size - self.got)
        recv_exact_into(self.sock, memoryview(self.buf)[self.got:self.got + n])
        self.got += n

    def finish(self) -> bytes:
        self.read_some(self.size)
        self.sock.close()
        return bytes(self.buf)


def check_tiers(kv: KVClient) -> dict:
    (stats,) = kv.node_stats().values()
    for t in stats["tiers"]:
        assert t["used_bytes"] + t["free_bytes"] == t["capacity_bytes"], t
    assert [t["kind"] for t in stats["tiers"]] == ["DRAM", "SSD"]
    assert stats["tiers"][0]["capacity_bytes"] == 64 * MiB
    assert stats["tiers"][1]["capacity_bytes"] == 256 * MiB
    return stats


def test_two_gib_through_64_mib_of_dram(node_cluster):
    t0 = time.monotonic()
    info = node_cluster.nodes["n0"]
    host, port = info.address.rsplit(":", 1)
    rng = random.Random(7)
    sizes: dict[str, int] = {}
    with KVClient(node_cluster.master, prefer_shm=True) as shm_kv, \
            KVClient(node_cluster.master, prefer_shm=False) as tcp_kv:
        # The slow readers' objects, then their readers.
        slow_shm, slow_tcp = value(10**6, 4 * MiB), value(10**6 + 1, 16 * MiB)
        shm_kv.put("slow/shm", slow_shm)
        shm_kv.put("slow/tcp", slow_tcp)
        conn = NodeConnection(host, int(port))
        segment = ShmSegment(info.info["shm_name"])
        shm_oid, size, _ck, offset = conn.call(Op.SHM_ACQUIRE, "slow/shm")
        assert size == len(slow_shm)
        tcp_reader = SlowTcpReader(host, int(port), "slow/tcp")

        def check_get(kv: KVClient, keys: list[str]) -> int:
            found = 0
            for k, got in zip(keys, kv.batch_get(keys)):
                if isinstance(got, NotFound):
                    continue
                assert not isinstance(got, Exception), (k, got)
                assert got == value(int(k[2:]), sizes[k]), f"wrong bytes for {k}"
                found += 1
            return found

        written = 0
        i = 0
        rounds = 0
        safe_checked = False
        while written < TOTAL_BYTES:
            round_end = written + ROUND_BYTES
            while written < round_end:
                keys, values = [], []
                for _ in range(8):
                    k = f"p/{i}"
                    sizes[k] = rng.choice(SIZES)
                    keys.append(k)
                    values.append(value(i, sizes[k]))
                    written += sizes[k]
                    i += 1
                kv = shm_kv if rounds % 2 == 0 else tcp_kv
                assert kv.batch_put(keys, values) == [None] * len(keys)
                check_get(tcp_kv if rounds % 2 == 0 else shm_kv,
                          rng.sample(sorted(sizes), min(6, len(sizes))))
            rounds += 1
            stats = check_tiers(shm_kv)
            assert bytes(segment.view[offset:offset + size]) == slow_shm   # never reused
            tcp_reader.read_some(256 * KiB)
            if not safe_checked and written >= SAFE_BYTES - ROUND_BYTES:
                # The SSD had room all along: every demoted object is still there.
                safe_checked = True
                assert stats["counters"]["evictions"] == 0, stats["counters"]
                keys = sorted(sizes)
                for start in range(0, len(keys), 64):
                    assert check_get(shm_kv, keys[start:start + 64]) == len(keys[start:start + 64])
                assert check_tiers(shm_kv)["counters"]["evictions"] == 0
        put_s = time.monotonic() - t0

        # The slow readers get exactly their bytes.
        assert bytes(segment.view[offset:offset + size]) == slow_shm
        conn.call(Op.SHM_RELEASE, "slow/shm", shm_oid)
        assert tcp_reader.finish() == slow_tcp

        # Every listed key: exact bytes or NotFound, on both transports.
        listed = [m.key for m in shm_kv.list("p/")]
        assert listed and len(listed) < len(sizes)      # the SSD evicted, as it had to
        for kv in (shm_kv, tcp_kv):
            for start in range(0, len(listed), 64):
                check_get(kv, listed[start:start + 64])
        stats = check_tiers(shm_kv)
        c = stats["counters"]
        assert c["demotion_failures"] == 0 and c["evicted_no_room"] == 0, c
        assert c["demotions"] > 0 and c["promotions"] > 0 and c["evictions"] > 0, c
        assert all(not t["eviction_blocked"] for t in stats["tiers"]), stats["tiers"]

        # The index catches up with the node: exists agrees with get.
        keys = sorted(sizes)

        def consistent() -> bool:
            ex = tcp_kv.batch_exists(keys)
            got = tcp_kv.batch_get(keys)
            return all(e == (not isinstance(g, NotFound)) for e, g in zip(ex, got))
        wait_for(consistent, timeout_s=10)
        segment.close()
        conn.close()
    print(f"\n{written / MiB:.0f} MiB in {len(sizes)} objects through DRAM 64 MiB + SSD 256 MiB: "
          f"{put_s:.1f} s of puts and reads, {time.monotonic() - t0:.1f} s in all; counters {c}")
