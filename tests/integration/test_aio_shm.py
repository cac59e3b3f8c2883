"""The asyncio SDK's same-host path: values copied through the node's segment.

One node on this host: puts of PUT_MIN_BYTES or more and every get go through
its shared memory (SHM_ALLOC / SHM_COMMIT, SHM_ACQUIRE / SHM_RELEASE on the
pipelined connection); a get of a location learnt before is the copy alone,
checked in the read slots. A reference taken for a cancelled read is released
all the same, and a removed key is NotFound, not the old bytes.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.client.aio import AsyncKVClient
from kvstore.errors import KeyConflict, NotFound
from kvstore.keys import value_checksum
from kvstore.transfer.aio_shm import PUT_MIN_BYTES, AsyncShm
from kvtest import cluster_running, node_stats, wait_for

MiB = 1 << 20
BIG = 2 * MiB            # through the segment
SMALL = 64 << 10         # a put over TCP, its gets through the segment


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    with cluster_running(str(tmp_path_factory.mktemp("aio-shm-logs")), num_nodes=1,
                         dram="32MiB") as running:
        yield running


def value(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_values_go_through_the_segment_and_a_known_read_sends_nothing(one_node, monkeypatch):
    assert BIG >= PUT_MIN_BYTES > SMALL
    writes = []
    real_write = AsyncShm.write

    async def counted(self, conn, key, *args):
        writes.append(key)
        return await real_write(self, conn, key, *args)
    monkeypatch.setattr(AsyncShm, "write", counted)

    async def go():
        async with AsyncKVClient(one_node.master) as kv:
            assert await kv.warm_up()
            assert await kv.put("big", value(BIG, 1)) is True
            assert await kv.put("small", value(SMALL, 2)) is True
            assert writes == ["big"]                        # the small one went over TCP
            assert await kv.put("big", value(BIG, 1)) is False      # already there
            with pytest.raises(KeyConflict):                # hashed on the way in, all the same
                await kv.put("big", value(BIG, 9))
            assert writes == ["big"] * 3
            (meta,) = await kv.lookup(["big"])
            assert meta.checksum == value_checksum(value(BIG, 1))

            (meta,) = await kv.lookup_cached(["big"])
            node = meta.replicas[0].node
            shm = kv._shms.of(node)
            dest = bytearray(BIG)
            assert await kv.get_into("big", dest) == BIG and dest == value(BIG, 1)
            assert shm.unreferenced == 0                    # learnt under a reference
            conn = kv._conns.ready(node)

            async def no_request(*_args, **_kwargs):
                raise AssertionError("a known read went to the node")
            conn.request = no_request
            try:
                dest[:] = bytes(BIG)
                assert await kv.get_into("big", dest) == BIG and dest == value(BIG, 1)
                assert await kv.get("big") == value(BIG, 1)
            finally:
                del conn.request
            assert shm.unreferenced == 2
            assert await kv.get("small") == value(SMALL, 2)
            await kv.remove("big")
            with pytest.raises(NotFound):                   # not the old bytes
                await kv.get("big")
            await kv.remove("small")
    asyncio.run(go())


def test_a_key_removed_by_another_client_is_not_found_through_a_known_location(one_node):
    async def go():
        async with AsyncKVClient(one_node.master) as kv:
            await kv.put("gone", value(BIG, 3))
            assert await kv.get("gone") == value(BIG, 3)    # cached, location learnt
            with KVClient(one_node.master) as other:
                other.remove("gone")                        # the node drops it first
            with pytest.raises(NotFound):
                await kv.get("gone")
    asyncio.run(go())


def test_a_cancelled_read_leaves_no_reference_behind(one_node):
    """A get cancelled while its SHM_ACQUIRE is answered: the reference it may have
    taken is released, so the removed object's memory goes back to the node while
    the client's connection stays open."""
    async def go():
        async with AsyncKVClient(one_node.master) as kv:
            for i in range(5):
                await kv.put(f"c{i}", value(BIG, 10 + i))
            node = (await kv.lookup_cached([f"c{i}" for i in range(5)]))[0].replicas[0].node
            for i in range(5):
                task = asyncio.ensure_future(kv.get(f"c{i}"))
                for _ in range(i):                          # cancelled at various points
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
            await asyncio.sleep(0.05)                       # the answers come and go
            with KVClient(one_node.master) as other:
                other.batch_remove([f"c{i}" for i in range(5)])
                wait_for(lambda: node_stats(other)["n0"].used_bytes == 0,
                         what="the removed objects' memory freed")
            assert kv._conns.ready(node) is not None        # released, not disconnected
    asyncio.run(go())
