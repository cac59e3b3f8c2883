"""Client <-> master <-> store nodes, as real processes on loopback, over TCP and shm.

Every test runs once per data path (``transport`` = "tcp" / "shm").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.client import KVClient
from kvstore.errors import (InvalidArgument, KeyConflict, KVStoreError, NoSpace, NotFound,
                            TooLarge, Unavailable)
from kvstore.keys import value_checksum
from kvstore.transfer.shm import ShmTransport
from kvstore.transfer.tcp import TcpTransport
from kvtest import cluster_running, node_stats, wait_for

KiB, MiB = 1 << 10, 1 << 20


def random_bytes(size_bytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8).tobytes()


def test_client_uses_the_requested_transport(kv, key_prefix, transport):
    kv.put(key_prefix + "k", b"x")
    (meta,) = kv.lookup([key_prefix + "k"])
    tr = kv._connections.transport(meta.replicas[0].node)
    assert isinstance(tr, ShmTransport if transport == "shm" else TcpTransport)


@pytest.mark.parametrize("size_bytes", [0, 1, 64 * KiB, 4 * MiB],
                         ids=["0B", "1B", "64KiB", "4MiB"])
def test_roundtrip(kv, key_prefix, size_bytes):
    data = random_bytes(size_bytes, seed=size_bytes)
    key = key_prefix + "v"
    assert kv.put(key, data) is True
    got = kv.get(key)
    assert isinstance(got, bytearray) and len(got) == size_bytes
    assert value_checksum(got) == value_checksum(data)
    assert got == data
    (meta,) = kv.lookup([key])
    assert (meta.size_bytes, meta.checksum) == (size_bytes, value_checksum(data))
    assert kv.exists(key)


def test_roundtrip_across_clients_and_transports(master, key_prefix):
    data = random_bytes(100 * KiB, seed=7)
    with KVClient(master, prefer_shm=True) as a, KVClient(master, prefer_shm=False) as b:
        a.put(key_prefix + "from-shm", data)
        b.put(key_prefix + "from-tcp", data)
        assert b.get(key_prefix + "from-shm") == data
        assert a.get(key_prefix + "from-tcp") == data


def test_get_into_numpy_torch_bytearray(kv, key_prefix):
    data = random_bytes(4096, seed=1)
    key = key_prefix + "k"
    kv.put(key, data)
    expected = np.frombuffer(data, dtype=np.uint8)

    arr = np.zeros(4096, dtype=np.uint8)
    assert kv.get_into(key, arr) == 4096
    assert np.array_equal(arr, expected)

    wide = np.zeros((32, 32), dtype=np.float32)        # 4096 B as another dtype and shape
    assert kv.get_into(key, wide) == 4096
    assert wide.tobytes() == data

    big = bytearray(10_000)                            # larger destinations are fine
    assert kv.get_into(key, big) == 4096
    assert big[:4096] == data and big[4096:] == bytes(10_000 - 4096)

    t = torch.zeros(2048, dtype=torch.int16)
    assert kv.get_into(key, t) == 4096
    assert t.numpy().tobytes() == data

    view = memoryview(bytearray(4096))
    assert kv.get_into(key, view) == 4096
    assert view.tobytes() == data


def test_bad_replica_counts_and_keys_are_invalid_argument(kv, key_prefix):
    for n in (-1, 17):
        with pytest.raises(InvalidArgument):
            kv.put(key_prefix + "r", b"x", replica_num=n)
    with pytest.raises(InvalidArgument):
        kv.put("\ud800", b"x")                       # not encodable as UTF-8
    assert kv.batch_exists([key_prefix + "r"]) == [False]


#: Keys no call accepts: empty, not UTF-8, a control char, too long, not a str.
BAD_KEYS = ["", "\ud800", "a\x00b", "k" * 513, 42]


def test_exists_of_an_invalid_key_raises_as_get_does(kv):
    # exists(key) is True iff get(key) would return a value: where get raises
    # InvalidArgument, so does exists (it answered False).
    for bad in BAD_KEYS:
        with pytest.raises(InvalidArgument):
            kv.get(bad)
        with pytest.raises(InvalidArgument):
            kv.exists(bad)
    assert kv.batch_exists(BAD_KEYS) == [False] * len(BAD_KEYS)   # a batch answers per key


def test_batch_put_get_exists_per_key_status_in_input_order(kv, key_prefix):
    p = key_prefix
    present = {p + "a": b"A" * 10, p + "b": b"", p + "c": random_bytes(70 * KiB, 3)}
    non_contiguous = np.arange(100, dtype=np.uint8)[::2]
    keys = [p + "a", "", p + "b", 42, p + "c", p + "bad-value"]
    values = [present[p + "a"], b"x", present[p + "b"], b"y", present[p + "c"], non_contiguous]
    res = kv.batch_put(keys, values)
    assert [type(r) for r in res] == [type(None), InvalidArgument, type(None), InvalidArgument,
                                      type(None), InvalidArgument]
    # Again: already present is success too.
    assert kv.batch_put([p + "c", p + "a"], [present[p + "c"], present[p + "a"]]) == [None, None]

    query = [p + "c", p + "missing", "", p + "a", None, p + "b", p + "bad-value", p + "c"]
    got = kv.batch_get(query)
    assert got[0] == present[p + "c"] and got[7] == present[p + "c"]
    assert isinstance(got[1], NotFound) and got[1].key == p + "missing"
    assert isinstance(got[2], InvalidArgument)
    assert got[3] == present[p + "a"]
    assert isinstance(got[4], InvalidArgument)
    assert got[5] == b"" and isinstance(got[5], bytearray)
    assert isinstance(got[6], NotFound)

    assert kv.batch_exists(query) == [True, False, False, True, False, True, False, True]
    # exists agrees with get, key by key.
    assert kv.batch_exists(query) == [not isinstance(g, KVStoreError) for g in got]

    dests = [bytearray(70 * KiB), bytearray(1), np.zeros(16, np.uint8), bytearray(3)]
    sizes = kv.batch_get_into([p + "c", p + "missing", p + "a", p + "a"], dests)
    assert sizes[0] == 70 * KiB and dests[0] == present[p + "c"]
    assert isinstance(sizes[1], NotFound)
    assert sizes[2] == 10 and dests[2][:10].tobytes() == present[p + "a"]
    assert isinstance(sizes[3], InvalidArgument)     # too small, only this one fails


def test_batch_put_repeating_a_key(kv, key_prefix):
    k = key_prefix + "dup"
    res = kv.batch_put([k, k, k], [b"first", b"first", b"other"])
    assert res[0] is None and res[1] is None and isinstance(res[2], KeyConflict)
    assert kv.get(k) == b"first"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_put_tensor_get_tensor(kv, key_prefix, dtype):
    shape = (2, 2, 16, 4, 8)   # [num_layers, 2 (K/V), block_tokens, num_kv_heads, head_dim]
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
    else:
        t = torch.randint(-128, 127, shape, generator=g, dtype=dtype)
    key = key_prefix + str(dtype)
    assert kv.put_tensor(key, t) is True
    got = kv.get_tensor(key, shape=shape, dtype=dtype)
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(got, t)
    out = torch.empty(shape, dtype=dtype)
    assert kv.get_tensor(key, out) is out and torch.equal(out, t)
    with pytest.raises(InvalidArgument):
        kv.get_tensor(key, shape=(3,), dtype=dtype)                  # wrong size
    with pytest.raises(InvalidArgument):
        kv.get_tensor(key)                                           # no out, no shape
    with pytest.raises(InvalidArgument):
        kv.put_tensor(key_prefix + "nc", t.transpose(0, 4))          # not contiguous
    assert not kv.exists(key_prefix + "nc")


def test_zero_byte_value_and_missing_key(kv, key_prefix):
    kv.put(key_prefix + "empty", b"")
    assert kv.exists(key_prefix + "empty")
    assert kv.get(key_prefix + "empty") == bytearray()
    assert kv.get_into(key_prefix + "empty", bytearray(0)) == 0
    assert not kv.exists(key_prefix + "missing")
    with pytest.raises(NotFound):
        kv.get(key_prefix + "missing")
    with pytest.raises(NotFound):
        kv.get_into(key_prefix + "missing", bytearray(8))


def test_put_never_overwrites(kv, make_client, key_prefix):
    key = key_prefix + "k"
    original = random_bytes(1000, 5)
    assert kv.put(key, original) is True
    assert kv.put(key, bytes(original)) is False                 # equal bytes: already present
    other = make_client(prefer_shm=False)
    assert other.put(key, bytearray(original)) is False          # from another client too
    for different in (original[:-1] + b"\x00", original + b"!", b""):
        with pytest.raises(KeyConflict):
            kv.put(key, different)
    assert kv.get(key) == original
    (meta,) = kv.lookup([key])
    assert meta.checksum == value_checksum(original)


def test_too_large_leaves_nothing_behind(kv, key_prefix):
    key = key_prefix + "huge"
    before = kv.stat()[0]
    with pytest.raises(TooLarge):
        kv.put(key, bytearray(64 * MiB + 1))
    assert not kv.exists(key)
    assert list(kv.list(key_prefix)) == []
    with pytest.raises(NotFound):
        kv.get(key)
    after = kv.stat()[0]
    assert after.num_objects == before.num_objects
    # The key is still free for a value that fits.
    assert kv.put(key, b"fits")


def test_remove_then_get_not_found(kv, key_prefix):
    key = key_prefix + "k"
    kv.put(key, b"one")
    kv.remove(key)
    assert not kv.exists(key)
    with pytest.raises(NotFound):
        kv.get(key)
    assert list(kv.list(key_prefix)) == []
    with pytest.raises(NotFound):
        kv.remove(key)
    assert kv.put(key, b"two") is True           # a removed key takes new bytes
    assert kv.get(key) == b"two"


def test_bad_input_is_invalid_argument_and_loses_nothing(kv, key_prefix):
    key = key_prefix + "keep"
    data = random_bytes(2048, 9)
    kv.put(key, data)
    bad_calls = [
        lambda: kv.put("", b"x"),
        lambda: kv.put(123, b"x"),
        lambda: kv.put(key_prefix + "a\x00b", b"x"),
        lambda: kv.put(key_prefix + "x" * 600, b"x"),
        lambda: kv.put(key_prefix + "nc", np.zeros((8, 8), np.uint8)[:, ::2]),
        lambda: kv.put(key_prefix + "obj", object()),
        lambda: kv.get(""),
        lambda: kv.get(123),
        lambda: kv.exists(""),
        lambda: kv.exists(123),
        lambda: kv.remove(""),
        lambda: kv.remove(b"bytes"),
        lambda: kv.get_into(key, bytearray(2047)),                  # too small
        lambda: kv.get_into(key, np.zeros(2048, np.uint8)[::2]),    # not contiguous
        lambda: kv.get_into(key, bytes(4096)),                      # read-only
        lambda: kv.batch_put([key], [b"a", b"b"]),                  # length mismatch
    ]
    for call in bad_calls:
        with pytest.raises(InvalidArgument):
            call()
    assert kv.batch_exists(["", 123]) == [False, False]     # a batch answers per key
    # Nothing lost, nothing created, and the connection still works.
    assert kv.get(key) == data
    assert [m.key for m in kv.list(key_prefix)] == [key]


def test_list_in_key_order_with_paging(kv, key_prefix):
    keys = [f"{key_prefix}{i:02d}" for i in range(12)]
    kv.batch_put(keys, [bytes([i]) * i for i in range(12)])
    metas = list(kv.list(key_prefix, page_size=5))
    assert [m.key for m in metas] == keys
    assert [m.size_bytes for m in metas] == list(range(12))
    assert all(len(m.replicas) == 1 and m.replicas[0].node.node_id in ("n0", "n1") for m in metas)


# ---- a full store: its own small cluster ----

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Master + two 4 MiB nodes, for tests that fill the store."""
    with cluster_running(str(tmp_path_factory.mktemp("small-logs")), num_nodes=2,
                         dram="4MiB") as running:
        yield running


def test_no_space_when_full_then_remove_frees_memory(small, transport):
    kv = KVClient(small.master, prefer_shm=transport == "shm")
    try:
        keys = [f"{transport}/fill/{i}" for i in range(8)]
        values = [random_bytes(MiB, seed=i) for i in range(8)]
        # Fill both nodes exactly (4 x 1 MiB each). Placement follows the nodes'
        # heartbeats; a NoSpace while one node still has room is retried after one.
        for k, v in zip(keys, values):
            wait_for(lambda: _put_or_none(kv, k, v), timeout_s=10)
        full = wait_for(lambda: (lambda s: s if all(n.used_bytes == 4 * MiB and n.num_objects == 4
                                                   for n in s.values()) else None)(node_stats(kv)))
        assert set(full) == {"n0", "n1"}

        for size in (MiB, 1, 0):
            with pytest.raises(NoSpace):
                kv.put(f"{transport}/one-too-many-{size}", b"z" * size)
            assert not kv.exists(f"{transport}/one-too-many-{size}")
        st = kv.stat()[0]
        assert st.num_objects == 8
        assert [m.key for m in kv.list(f"{transport}/")] == sorted(keys)
        # Nothing half-created on the nodes either: wait for fresh heartbeats.
        beats = {n: s.last_heartbeat_ms for n, s in full.items()}
        fresh = wait_for(lambda: (lambda s: s if all(s[n].last_heartbeat_ms > beats[n]
                                                     for n in beats) else None)(node_stats(kv)))
        assert all(n.used_bytes == 4 * MiB and n.num_objects == 4 for n in fresh.values())
        assert kv.batch_get(keys) == values                 # nothing disturbed

        assert kv.batch_remove(keys) == [None] * 8
        assert all(isinstance(r, NotFound) for r in kv.batch_get(keys))
        # Drop orders ride the next heartbeat; the one after reports the freed memory.
        wait_for(lambda: all(n.used_bytes == 0 and n.num_objects == 0
                             for n in node_stats(kv).values()))
        assert kv.put(f"{transport}/after", values[0]) is True
        assert kv.remove(f"{transport}/after") is None
        wait_for(lambda: all(n.used_bytes == 0 for n in node_stats(kv).values()))
    finally:
        kv.close()


def _put_or_none(kv: KVClient, key: str, value: bytes) -> bool:
    try:
        kv.put(key, value)
        return True
    except NoSpace:
        return False


def test_short_lived_threads_leave_no_connections_behind(master, key_prefix, transport):
    """Each thread gets its own data connections; they close when the thread ends."""
    import gc
    import os
    import threading

    with KVClient(master, prefer_shm=transport == "shm") as kv:
        kv.put(f"{key_prefix}t", b"v" * 4096)
        dest = bytearray(4096)
        kv.get_into(f"{key_prefix}t", dest)            # this thread's own connection
        fds = len(os.listdir("/proc/self/fd"))
        for _ in range(40):
            t = threading.Thread(target=kv.get_into, args=(f"{key_prefix}t", bytearray(4096)))
            t.start()
            t.join()
        gc.collect()
        assert len(kv._connections._holders) == 1                  # the main thread's only
        assert len(os.listdir("/proc/self/fd")) <= fds + 2
        assert bytes(kv.get(f"{key_prefix}t")) == b"v" * 4096


def test_a_closed_client_says_so(master, key_prefix):
    kv = KVClient(master)
    kv.put(f"{key_prefix}c", b"x")
    kv.close()
    for call in (lambda: kv.get(f"{key_prefix}c"), lambda: kv.put(f"{key_prefix}d", b"y"),
                 lambda: kv.batch_exists([f"{key_prefix}c"])):
        with pytest.raises(Unavailable, match="closed"):
            call()
