"""The same-host paths: values copied through the node's segment (the asyncio SDK's,
and which puts the sync SDK sends that way).

One node on this host: puts of PUT_MIN_BYTES or more and every get go through
its shared memory (SHM_ALLOC / SHM_COMMIT, SHM_ACQUIRE / SHM_RELEASE on the
pipelined connection); a get of a location learnt before is the copy alone,
checked in the read slots. A reference taken for a cancelled read is released
all the same, and a removed key is NotFound, not the old bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from kvstore.client import KVClient
from kvstore.client.aio import AsyncKVClient
from kvstore.errors import KeyConflict, NotFound
from kvstore.keys import value_checksum
from kvstore.transfer.aio_shm import PUT_MIN_BYTES, AsyncShm
from kvstore.transfer.aio_tcp import AsyncNodeConnection
from kvstore.transfer.protocol import MAX_UNANSWERED, Op
from kvstore.transfer.shm import SEGMENT_PUT_MIN_BYTES, ShmTransport
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

    async def counted(self, key, *args):
        writes.append(key)
        return await real_write(self, key, *args)
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
            shm = kv._shms.of(node, kv._conns.ready(node))
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


def test_known_reads_that_await_nothing_still_let_the_loop_read_their_answers(one_node):
    """A coroutine whose gets are all copies from known locations never suspends by
    itself: past MAX_UNANSWERED unanswered SHM_TOUCH frames each such get
    gives the loop one turn, so the answers are read as they come (they piled up,
    and the first get that did yield paid for all of them), and every get is counted."""
    async def go():
        async with AsyncKVClient(one_node.master) as kv:
            await check(kv)

    async def check(kv):
        with KVClient(one_node.master) as observer:
            await kv.put("touched", value(SMALL, 4))
            dest = bytearray(SMALL)
            await kv.get_into("touched", dest)              # learns the location
            (meta,) = await kv.lookup_cached(["touched"])
            conn = kv._conns.ready(meta.replicas[0].node)
            gets = observer.node_stats()["n0"]["counters"]["gets"]
            most, n = 0, 8 * MAX_UNANSWERED
            for _ in range(n):
                assert await kv.get_into("touched", dest) == SMALL
                most = max(most, conn.unanswered())
            assert dest == value(SMALL, 4) and conn.broken is None
            assert most <= 4 * MAX_UNANSWERED, most
            await asyncio.sleep(0.05)
            wait_for(lambda: observer.node_stats()["n0"]["counters"]["gets"] >= gets + n,
                     timeout_s=10)
            await kv.remove("touched")
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


def test_a_put_cancelled_after_its_reservation_was_asked_leaves_nothing_reserved(
        one_node, monkeypatch):
    real = AsyncNodeConnection.request

    async def go():
        asked = asyncio.Event()

        async def spy(self, op, *args, **kwargs):
            if op == Op.SHM_ALLOC:
                asked.set()
            return await real(self, op, *args, **kwargs)
        monkeypatch.setattr(AsyncNodeConnection, "request", spy)
        async with AsyncKVClient(one_node.master) as kv:
            task = asyncio.ensure_future(kv.put("cancelled", value(4 * MiB, 4)))
            await asked.wait()
            task.cancel()                   # its SHM_ALLOC is out, the answer not yet in
            with pytest.raises(asyncio.CancelledError):
                await task
            with KVClient(one_node.master) as other:   # aborted: nothing held, live
                await asyncio.to_thread(wait_for, lambda: other.node_stats()["n0"]["tiers"][0][
                    "used_bytes"] == 0, what="the reservation given back")
            assert not await kv.exists("cancelled")
    asyncio.run(go())


def test_a_read_cancelled_before_its_frame_was_queued_releases_nothing(one_node):
    """Cancelled while the connection's writing is paused (its SHM_ACQUIRE never
    queued): no SHM_RELEASE follows, which would drop another read's reference."""
    async def go():
        async with AsyncKVClient(one_node.master) as kv:
            await kv.put("paused", value(BIG, 5))
            (meta,) = await kv.lookup(["paused"])
            node = meta.replicas[0].node
            conn = await kv._conns.get(node, 5)
            shm = kv._shms.of(node, conn)
            sent = []
            real_send_only = conn.send_only
            conn.send_only = lambda op, *a: sent.append(op) or real_send_only(op, *a)
            conn.pause_writing()
            task = asyncio.ensure_future(shm.read("paused", meta.object_id, BIG, None, 5))
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            conn.resume_writing()
            assert sent == []
            got = await shm.read("paused", meta.object_id, BIG, None, 5)
            assert got == value(BIG, 5) and sent == [Op.SHM_RELEASE]
            await kv.remove("paused")
    asyncio.run(go())


def test_a_new_connection_maps_the_segment_again_and_a_gone_one_is_tcp(one_node):
    """A mapping serves one connection: after the connection broke (the node may have
    restarted with another segment), the segment is looked up and mapped again; a
    segment file that is gone sends the node's values over TCP."""
    async def go():
        async with AsyncKVClient(one_node.master) as kv:
            await kv.put("again", value(BIG, 6))
            (meta,) = await kv.lookup_cached(["again"])
            node = meta.replicas[0].node
            assert await kv.get("again") == value(BIG, 6)
            first = kv._shms.of(node, kv._conns.ready(node))
            kv._conns.ready(node).close()           # the connection breaks
            assert await kv.get("again") == value(BIG, 6)
            second = kv._shms.of(node, kv._conns.ready(node))
            assert second is not first and first.segment.closed
            gone = dataclasses.replace(node, shm_name=node.shm_name + "-gone")
            assert kv._shms.of(gone, kv._conns.ready(node)) is None
            assert not kv._shms.local(gone)
            await kv.remove("again")
    asyncio.run(go())


def test_the_sync_sdk_puts_small_values_as_frames_and_large_ones_through_the_segment(
        one_node, monkeypatch):
    """``KVClient(prefer_shm=True)`` too: a batch's values under SEGMENT_PUT_MIN_BYTES
    go as PUT frames on the node's control connection, the others through its
    segment; every result in input order, a conflict where it belongs."""
    through_segment = []
    real = ShmTransport._write_many

    def spy(self, seg, items):
        through_segment.extend(it.key for it in items)
        return real(self, seg, items)
    monkeypatch.setattr(ShmTransport, "_write_many", spy)
    keys = ["s-small", "s-big", "s-small2", "s-big2"]
    values = [value(SMALL, 20), value(BIG, 21), value(SMALL, 22), value(BIG, 23)]
    assert SMALL < SEGMENT_PUT_MIN_BYTES <= BIG
    with KVClient(one_node.master, prefer_shm=True) as kv:
        kv.put("s-small2", value(SMALL, 99))                # another value already there
        assert through_segment == []
        results = kv.batch_put(keys, values)
        assert [type(r) for r in results] == [type(None), type(None), KeyConflict, type(None)]
        assert through_segment == ["s-big", "s-big2"]
        for k, v in zip(keys, values):
            if k != "s-small2":
                assert kv.get(k) == v
        kv.batch_remove(keys)
