"""AsyncKVClient against the shared cluster: the round-trip rules of the sync SDK
(test_roundtrip.py), awaited, and many operations in flight on one connection."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.client.aio import AsyncKVClient
from kvstore.client.core.placement import IDS_PER_GRANT
from kvstore.errors import InvalidArgument, KeyConflict, NotFound, TooLarge
from kvstore.keys import value_checksum

KiB, MiB = 1 << 10, 1 << 20


def random_bytes(size_bytes: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size_bytes, dtype=np.uint8).tobytes()


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("size_bytes", [0, 1, 64 * KiB, 4 * MiB],
                         ids=["0B", "1B", "64KiB", "4MiB"])
def test_roundtrip(master, key_prefix, size_bytes):
    data = random_bytes(size_bytes, seed=size_bytes)
    key = key_prefix + "v"

    async def go():
        async with AsyncKVClient(master) as kv:
            assert await kv.put(key, data) is True
            got = await kv.get(key)
            assert got == data and type(got) is bytearray     # as the sync get, also empty
            (meta,) = await kv.lookup([key])
            assert (meta.size_bytes, meta.checksum) == (size_bytes, value_checksum(data))
            assert await kv.exists(key)
    run(go())
    with KVClient(master, prefer_shm=False) as sync:         # the sync SDK reads it too
        assert sync.get(key) == data


def test_put_never_overwrites_and_missing_is_not_found(master, key_prefix):
    key = key_prefix + "k"
    original = random_bytes(1000, 5)

    async def go():
        async with AsyncKVClient(master) as kv:
            assert await kv.put(key, original) is True
            assert await kv.put(key, bytes(original)) is False
            for different in (original[:-1] + b"\x00", b""):
                with pytest.raises(KeyConflict):
                    await kv.put(key, different)
            assert await kv.get(key) == original
            with pytest.raises(NotFound):
                await kv.get(key_prefix + "missing")
            assert not await kv.exists(key_prefix + "missing")
            with pytest.raises(TooLarge):
                await kv.put(key_prefix + "huge", bytearray(64 * MiB + 1))
            assert not await kv.exists(key_prefix + "huge")
            with pytest.raises(InvalidArgument):
                await kv.put("", b"x")
            with pytest.raises(InvalidArgument):
                await kv.put(key_prefix + "r", b"x", replica_num=17)
    run(go())


def test_remove_then_not_found_and_new_bytes(master, key_prefix):
    key = key_prefix + "k"

    async def go():
        async with AsyncKVClient(master) as kv:
            await kv.put(key, b"one")
            await kv.remove(key)
            assert not await kv.exists(key)
            with pytest.raises(NotFound):
                await kv.get(key)
            with pytest.raises(NotFound):
                await kv.remove(key)
            assert await kv.put(key, b"two") is True
            assert await kv.get(key) == b"two"
    run(go())


def test_many_in_flight_batch_forms_in_input_order(master, key_prefix):
    keys = [f"{key_prefix}{i}" for i in range(200)]
    values = [random_bytes(1000 + i, seed=i) for i in range(200)]

    async def go():
        async with AsyncKVClient(master) as kv:
            assert await asyncio.gather(*(kv.put(k, v) for k, v in zip(keys, values))) == \
                [True] * 200
            got = await asyncio.gather(*(kv.get(k) for k in keys))
            assert got == values
            mixed = await kv.batch_get([keys[0], key_prefix + "nope", keys[1]])
            assert mixed[0] == values[0] and isinstance(mixed[1], NotFound) and \
                mixed[2] == values[1]
            assert await kv.batch_exists([keys[5], key_prefix + "nope"]) == [True, False]
            again = await kv.batch_put([keys[0], key_prefix + "new"], [values[0], b"n"])
            assert again == [None, None]           # as KVClient.batch_put: None on success
            assert await kv.put(key_prefix + "new", b"n") is False
            # Every node answered on one connection each.
            assert len(kv._conns) <= 2
    run(go())


def test_batch_put_of_more_keys_than_one_grant_holds(master, key_prefix):
    # 5000 puts at once waited on one grant fetch and shared its 4096 ids: the
    # 904 beyond them failed Unavailable('no placement grant').
    n = IDS_PER_GRANT + 904
    keys = [f"{key_prefix}{i}" for i in range(n)]

    async def go():
        async with AsyncKVClient(master) as kv:
            res = await kv.batch_put(keys, [b"v" * 64] * n)
            failed = [r for r in res if r is not None]
            assert not failed, f"{len(failed)} of {n} puts failed, the first: {failed[0]!r}"
            assert all(await kv.batch_exists(keys))
    run(go())


def test_exists_of_an_invalid_key_raises_as_get_does(master):
    # As the sync SDK (test_roundtrip.py): exists raised nothing, it answered False.
    async def go():
        async with AsyncKVClient(master) as kv:
            for bad in ("", "\ud800", "a\x00b", "k" * 513, 42):
                with pytest.raises(InvalidArgument):
                    await kv.get(bad)
                with pytest.raises(InvalidArgument):
                    await kv.exists(bad)
    run(go())


def test_get_into_receives_into_the_callers_memory(master, key_prefix):
    """get_into fills bytearrays, numpy arrays and memoryviews (values larger than the
    connection's read-ahead too), answers the size, refuses a small destination
    without losing the value, and many at once land each in its own buffer."""
    small, big = random_bytes(3000, 1), random_bytes(5 * MiB + 7, 2)
    many = [random_bytes(64 * KiB, 10 + j) for j in range(48)]

    async def go():
        async with AsyncKVClient(master) as kv:
            await kv.put(key_prefix + "s", small)
            await kv.put(key_prefix + "b", big)
            assert await kv.batch_put([f"{key_prefix}m{j}" for j in range(48)], many) \
                == [None] * 48
            dest = bytearray(4000)
            assert await kv.get_into(key_prefix + "s", dest) == 3000
            assert dest[:3000] == small
            arr = np.zeros(len(big), dtype=np.uint8)
            assert await kv.get_into(key_prefix + "b", arr) == len(big)
            assert arr.tobytes() == big
            with pytest.raises(InvalidArgument):
                await kv.get_into(key_prefix + "b", bytearray(100))
            with pytest.raises(NotFound):
                await kv.get_into(key_prefix + "missing", bytearray(10))
            assert await kv.get(key_prefix + "b") == big          # still there, whole
            bufs = [bytearray(64 * KiB) for _ in many]
            views = [memoryview(b) for b in bufs]
            sizes = await asyncio.gather(*(kv.get_into(f"{key_prefix}m{j}", views[j])
                                           for j in range(48)))
            assert sizes == [64 * KiB] * 48 and bufs == many
            got = await kv.batch_get_into([key_prefix + "s", key_prefix + "nope"],
                                          [bytearray(3000), bytearray(1)])
            assert got[0] == 3000 and isinstance(got[1], NotFound)
            assert isinstance(await kv.get(key_prefix + "s"), bytearray)
    run(go())


def test_one_str_is_no_batch_of_keys(master, key_prefix):
    # batch_get("abc") read keys "a", "b" and "c" (NotFound each): every batch call
    # of both clients refuses one str or bytes for its keys.
    with KVClient(master, prefer_shm=False) as kv:
        for call in (kv.batch_get, kv.lookup, kv.locate, kv.batch_remove, kv.batch_pin,
                     kv.batch_unpin, lambda ks: kv.batch_get_into(ks, [bytearray(1)] * 3),
                     lambda ks: kv.prefetch(ks, 1000)):
            with pytest.raises(InvalidArgument, match="sequence of str"):
                call("abc")

    async def go():
        async with AsyncKVClient(master) as akv:
            for call in (akv.batch_get, akv.lookup, akv.lookup_cached,
                         lambda ks: akv.batch_get_into(ks, [bytearray(1)] * 3)):
                with pytest.raises(InvalidArgument, match="sequence of str"):
                    await call("abc")
    run(go())


def test_a_stale_cached_size_does_not_refuse_a_destination_that_fits_the_new_value(
        master, key_prefix):
    """Another client removed the key and put a smaller value: a destination that fits
    the new value is read into (fresh metadata), as the sync SDK does, not refused
    against the cached size; one too small for the new value is still refused."""
    key = key_prefix + "shrunk"
    small = random_bytes(100, 8)

    async def go():
        async with AsyncKVClient(master) as kv:
            assert await kv.put(key, random_bytes(5000, 7)) is True
            assert len(await kv.get(key)) == 5000                   # cached: 5000 B
            with KVClient(master, prefer_shm=False) as other:
                other.remove(key)
                assert other.put(key, small) is True
            dest = bytearray(100)
            assert await kv.get_into(key, dest) == 100 and dest == small
            with pytest.raises(InvalidArgument):
                await kv.get_into(key, bytearray(99))
    run(go())
