"""AsyncNodeConnection's reading of answers, against a scripted peer: answers
split anywhere are parsed in order, and what no node of ours sends (a value
longer than the request allows, an answer to nothing) breaks the connection
instead of being believed."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.transfer.aio_tcp import AsyncNodeConnection
from kvstore.errors import Unavailable
from kvstore.transfer.protocol import REQUEST, RESPONSE, Op
from waits import await_until


def _answer(size: int = 0, value: bytes = b"") -> bytes:
    return RESPONSE.pack(pb.OK, 0, 0, 0, 7, size, 0, 0, 0) + value


async def _peer(script):
    """A server that reads one request frame per answer and sends the scripted bytes
    (in pieces of 3 bytes, so every answer arrives split)."""
    async def serve(reader, writer):
        for reply in script:
            await reader.readexactly(REQUEST.size)
            for i in range(0, len(reply), 3):
                writer.write(reply[i:i + 3])
                await writer.drain()
        await asyncio.sleep(0.5)            # holds the connection open while the client reads
        writer.close()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@contextlib.asynccontextmanager
async def _connected_to(handler, timeout_s: float):
    """A connection to a server that runs ``handler(reader, writer)`` on it, then
    reads until the client closes; on leaving, the connection is closed and the
    server's side is waited for (nothing of it is left running)."""
    served = asyncio.Event()

    async def serve(reader, writer):
        try:
            await handler(reader, writer)
            await reader.read()                       # until the client closes
            writer.close()
        finally:
            served.set()
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        conn = await AsyncNodeConnection.open("127.0.0.1", server.sockets[0].getsockname()[1],
                                              timeout_s=timeout_s)
        try:
            yield conn
        finally:
            conn.close()
            await asyncio.wait_for(served.wait(), 10)


def test_answers_split_anywhere_arrive_in_order():
    async def go():
        server, port = await _peer([_answer(), _answer(5, b"hello"), _answer(3, b"abc")])
        async with server:
            conn = await AsyncNodeConnection.open("127.0.0.1", port, timeout_s=5)
            ping, got, into = await asyncio.gather(
                conn.request(Op.PING, ""), conn.request(Op.GET, "a", max_value_bytes=5),
                conn.request(Op.GET, "b", into=memoryview(bytearray(8))))
            assert ping.code == pb.OK and not ping.value
            assert got.value == bytearray(b"hello")
            assert bytes(into.value) == b"abc"
            conn.close()
    asyncio.run(go())


def test_a_value_longer_than_allowed_breaks_the_connection():
    async def go():
        server, port = await _peer([_answer(1 << 40)])
        async with server:
            conn = await AsyncNodeConnection.open("127.0.0.1", port, timeout_s=5)
            with pytest.raises(Unavailable, match="malformed"):
                await conn.request(Op.GET, "k", max_value_bytes=1024)
            with pytest.raises(Unavailable):
                await conn.request(Op.PING, "")
    asyncio.run(go())


def test_an_answer_to_no_request_breaks_the_connection():
    async def go():
        server, port = await _peer([_answer() + _answer()])
        async with server:
            conn = await AsyncNodeConnection.open("127.0.0.1", port, timeout_s=5)
            await conn.request(Op.PING, "")
            await await_until(lambda: conn.broken is not None, interval_s=0.01,
                              what="the unasked answer to break the connection")
            assert "not sent" in str(conn.broken)
    asyncio.run(go())


def test_an_answer_given_up_on_never_lands_in_the_callers_memory():
    # A read that stops waiting (its own short timeout: another replica to try) gets
    # Unavailable at once; its answer comes later, in order, and is dropped -- not
    # written into the buffer the caller has since handed to another read -- and
    # the connection goes on.
    async def serve(reader, writer):
        await reader.readexactly(REQUEST.size + 4)          # GET "slow"
        await reader.readexactly(REQUEST.size + 4)          # GET "next"
        # The client sent "next" after it gave up on "slow" (its 0.2 s): the answer
        # written now comes late for it, with no sleep to make it so.
        writer.write(_answer(5, b"LATE!") + _answer(5, b"fresh"))
        await writer.drain()
        await asyncio.sleep(0.5)            # holds the connection open while the client reads
        writer.close()

    async def go():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        async with server:
            port = server.sockets[0].getsockname()[1]
            conn = await AsyncNodeConnection.open("127.0.0.1", port, timeout_s=5)
            dest = bytearray(5)
            with pytest.raises(Unavailable, match="within 0.2 s"):
                await conn.request(Op.GET, "slow", into=memoryview(dest), timeout_s=0.2)
            dest[:] = b"mine!"                              # the caller's again
            other = bytearray(5)
            got = await conn.request(Op.GET, "next", into=memoryview(other))
            assert bytes(got.value) == b"fresh" and other == b"fresh"
            assert dest == b"mine!"                         # the late answer went nowhere
            assert conn.broken is None
            conn.close()
    asyncio.run(go())


def test_values_sent_with_their_frames_arrive_whole_and_in_order():
    """A value above the join size goes out in one gathered send with the frames
    queued before it; a peer that reads slowly makes the kernel take part of it, and
    the rest follows through the transport, in order (frames and values byte exact)."""
    values: list = [bytes([i]) * ((1 << 20) + 7 * i) for i in range(12)]
    values[5] = memoryview(np.arange(300_001, dtype=np.float32))   # lengths count bytes
    expected = [bytes(v) for v in values]
    got: list[tuple[str, bytes]] = []

    async def serve(reader, writer):
        for _ in values:
            head = await reader.readexactly(REQUEST.size)
            _op, _flags, key_len, parent_len, _oid, size, _sum = REQUEST.unpack(head)
            key = (await reader.readexactly(key_len + parent_len))[:key_len].decode()
            await asyncio.sleep(0.02)                 # the client's sends fill the socket
            got.append((key, await reader.readexactly(size)))
            writer.write(_answer())
            await writer.drain()

    async def go():
        async with _connected_to(serve, timeout_s=10) as conn:
            answers = await asyncio.gather(*(
                conn.request(Op.PUT, f"k{i}", size=len(expected[i]), payload=v)
                for i, v in enumerate(values)))
            assert all(a.code == pb.OK for a in answers)
    asyncio.run(go())
    assert [k for k, _ in got] == [f"k{i}" for i in range(len(values))]
    assert all(v == expected[i] for i, (_, v) in enumerate(got))


def test_a_bad_value_is_refused_before_anything_is_queued():
    """A value that is not contiguous bytes of its announced size is refused before
    its frame is queued: the requests before and after it on the connection get
    their own answers (nothing is sent for it, nothing of theirs is dropped)."""
    import numpy as np
    from kvstore.errors import InvalidArgument

    async def go():
        server, port = await _peer([_answer(5, b"hello"), _answer(3, b"abc")])
        async with server:
            conn = await AsyncNodeConnection.open("127.0.0.1", port, timeout_s=5)
            strided = np.zeros(64 * 1024, dtype=np.uint8)[::2]          # not contiguous
            first, bad, wrong_size, last = await asyncio.gather(
                conn.request(Op.GET, "", max_value_bytes=5),
                conn.request(Op.PUT, "", size=strided.nbytes, payload=strided),
                conn.request(Op.PUT, "", size=10, payload=b"nine byte"),
                conn.request(Op.GET, "", max_value_bytes=3), return_exceptions=True)
            assert isinstance(bad, InvalidArgument) and isinstance(wrong_size, InvalidArgument)
            assert first.value == bytearray(b"hello") and last.value == bytearray(b"abc")
            conn.close()
    asyncio.run(go())


def test_each_request_ends_at_its_own_wait_whatever_the_order():
    """Requests' own waits: a short wait queued after a long one still ends on time, a
    later one after it, and the answers that then come go to the callers still
    waiting, in order."""
    async def serve(reader, writer):
        for _ in range(3):
            await reader.readexactly(REQUEST.size)
        await asyncio.sleep(0.5)
        writer.write(_answer(5, b"hello") + _answer(3, b"abc") + _answer(3, b"xyz"))
        await writer.drain()

    async def go():
        async with _connected_to(serve, timeout_s=5) as conn:
            loop = asyncio.get_running_loop()
            t0 = loop.time()

            async def timed(wait_s):
                try:
                    return await conn.request(Op.GET, "", max_value_bytes=5, timeout_s=wait_s)
                except Unavailable:
                    return loop.time() - t0
            long, short, middle = await asyncio.gather(timed(3.0), timed(0.1), timed(0.25))
            assert 0.1 <= short < 0.25 <= middle < 0.45           # each at its own time
            assert long.value == bytearray(b"hello")             # its own answer
    asyncio.run(go())


def test_a_send_that_fails_fails_its_request_at_once():
    """The gathered send of a value fails (the node reset the connection before the
    loop noticed): that request fails Unavailable at once, as do the later ones; none
    waits for an answer that cannot come."""
    import socket
    import threading
    import time

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    opened = threading.Event()

    def reset_the_first():
        peer, _ = listener.accept()
        opened.wait(10)                               # once the client's connect is done
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        peer.close()                                  # RST
    threading.Thread(target=reset_the_first, daemon=True).start()

    async def go():
        conn = await AsyncNodeConnection.open("127.0.0.1", port, timeout_s=30)
        opened.set()
        time.sleep(0.3)              # the reset has arrived; the loop has not looked yet
        value = bytes(1 << 20)
        outcomes = []
        for _ in range(3):
            try:
                await asyncio.wait_for(conn.request(Op.PUT, "k", size=len(value),
                                                    payload=value), 5)
                outcomes.append("answered")
            except Unavailable:
                outcomes.append("unavailable")
        assert outcomes == ["unavailable"] * 3
        conn.close()
    try:
        asyncio.run(go())
    finally:
        listener.close()
