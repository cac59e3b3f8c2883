"""The RESP reader and encoder, without a network (kvstore.client.integrations.resp.protocol)."""

from __future__ import annotations

import pytest

from kvstore.client.integrations.resp.protocol import (OK, CommandReader, Limits, ProtocolError,
                                                       RespError, Status, encode, split_inline)


def reader_of(data: bytes, chunk: int = 7, limits: Limits = Limits()) -> CommandReader:
    """A reader over ``data`` that arrives ``chunk`` bytes at a time."""
    pos = [0]

    def recv_into(view: memoryview) -> int:
        n = min(chunk, len(view), len(data) - pos[0])
        view[:n] = data[pos[0]:pos[0] + n]
        pos[0] += n
        return n
    return CommandReader(recv_into, limits)


def commands(data: bytes, **kw) -> list:
    r, out = reader_of(data, **kw), []
    while (c := r.read_command()) is not None:
        out.append([bytes(a) for a in c])
    return out


def test_multibulk_inline_and_pipelines_in_any_chunking():
    big = b"v" * 200_000
    stream = (b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % len(big) + big + b"\r\n"
              + b"PING\r\n\r\nset q \"a b\\x41\\n\" 'c d'\r\n" + b"*1\r\n$4\r\nPING\r\n" * 100)
    for chunk in (5, 4096, 1 << 20):      # 5: every boundary falls inside some frame
        got = commands(stream, chunk=chunk)
        assert got[0] == [b"SET", b"k", big]
        assert got[1] == [b"PING"]
        assert got[2] == [b"set", b"q", b"a bA\n", b"c d"]
        assert got[3:] == [[b"PING"]] * 100


def test_empty_and_zero_length_arguments():
    assert commands(b"*2\r\n$3\r\nGET\r\n$0\r\n\r\n") == [[b"GET", b""]]
    assert commands(b"*0\r\n*1\r\n$4\r\nPING\r\n") == [[], [b"PING"]]


@pytest.mark.parametrize("frame", [
    b"*99999999999\r\n",                        # over max_args
    b"*1\r\n$999999999999\r\n",                 # over max_bulk_bytes
    b"*1\r\n$-5\r\n",
    b"*x\r\n", b"*1\r\n:3\r\n", b"*1\r\n$3\r\nabcde\r\n",
    b"SET \"unbalanced\r\n",
])
def test_malformed_frames_are_protocol_errors(frame):
    with pytest.raises(ProtocolError):
        commands(frame)


def test_lines_are_bounded():
    limits = Limits(max_inline_bytes=1024)
    with pytest.raises(ProtocolError, match="too big inline"):
        commands(b"A" * 5000, limits=limits, chunk=4096)


def test_truncated_frame_is_eof():
    r = reader_of(b"*2\r\n$3\r\nGET\r\n$10\r\nabc")
    with pytest.raises(EOFError):
        r.read_command()


def test_large_bulk_goes_to_its_own_buffer():
    size = 3 << 20
    got = commands(b"*1\r\n$%d\r\n" % size + b"z" * size + b"\r\n", chunk=65536)
    assert got == [[b"z" * size]]


def test_split_inline_quotes():
    assert split_inline(b"  a  'b c'  \"d\\te\"") == [b"a", b"b c", b"d\te"]
    assert split_inline(b"") == []


def _wire(value, proto):
    out: list = []
    encode(value, proto, out)
    return b"".join(bytes(b) for b in out)


def test_encoder_resp2_and_resp3():
    assert _wire(None, 2) == b"$-1\r\n" and _wire(None, 3) == b"_\r\n"
    assert _wire(b"", 2) == b"$0\r\n\r\n"
    assert _wire(OK, 3) == b"+OK\r\n" and _wire(Status("PONG"), 2) == b"+PONG\r\n"
    assert _wire(7, 2) == b":7\r\n"
    assert _wire([b"a", None], 2) == b"*2\r\n$1\r\na\r\n$-1\r\n"
    assert _wire({"k": 1}, 3) == b"%1\r\n$1\r\nk\r\n:1\r\n"
    assert _wire({"k": 1}, 2) == b"*2\r\n$1\r\nk\r\n:1\r\n"
    assert _wire(RespError("bad\r\nthing", "NOAUTH"), 2) == b"-NOAUTH bad  thing\r\n"
    assert _wire(memoryview(b"xyz")[1:], 2) == b"$2\r\nyz\r\n"


def test_docs_list_every_command():
    import pathlib

    from kvstore.client.integrations.resp import server  # noqa: F401  (fills the command table)
    from kvstore.client.integrations.resp.table import COMMANDS

    page = pathlib.Path(__file__).resolve().parents[2] / "docs" / "redis.md"
    table = page.read_text().split("## Commands", 1)[1]
    missing = [name for name in COMMANDS if f"| `{name}` |" not in table]
    assert not missing, f"docs/redis.md's command table lacks {missing}"


def test_reply_buffers_are_reused_and_bounded():
    from kvstore.client.integrations.resp.data import ReplyBuffers

    pool = ReplyBuffers()
    pool.learn(1000)
    first = [pool.take() for _ in range(40)]
    assert all(len(b) == 1000 for b in first)
    pool.recycle()                                   # the replies are sent
    again = [pool.take() for _ in range(40)]
    assert sum(any(a is b for b in first) for a in again) == ReplyBuffers.MAX_POOLED
    pool.learn(ReplyBuffers.MAX_BUFFER_BYTES + 1)    # too large to pool: the size stays
    assert pool.size_bytes == 1000
    pool.learn(2000)                                 # larger values: larger buffers
    pool.recycle()
    assert len(pool.take()) == 2000
    pool.learn(1 << 20)                              # 1 MiB values: fewer of them
    assert pool.capacity == ReplyBuffers.POOL_BYTES >> 20
    one = pool.take()
    pool.recycle()
    assert pool.take() is one                        # serial GETs reuse one buffer
    pool.recycle()
    held = [pool.take() for _ in range(3 * pool.capacity)]
    pool.recycle()
    assert len(pool._free) == pool.capacity          # the pool keeps POOL_BYTES at most
    assert sum(len(b) for b in pool._free) <= ReplyBuffers.POOL_BYTES
    del held


def test_glob_patterns_of_scan_and_keys():
    from kvstore.client.integrations.resp.verbs import glob_prefix, glob_regex

    assert glob_regex("k[a-c]?x*").fullmatch("kbzx123")
    assert glob_regex("k[^a]").fullmatch("kb") and not glob_regex("k[^a]").fullmatch("ka")
    assert glob_regex("a\\*b").fullmatch("a*b") and not glob_regex("a\\*b").fullmatch("axb")
    assert glob_regex("[[]x").fullmatch("[x") and glob_regex("a.b").fullmatch("a.b")
    assert not glob_regex("a.b").fullmatch("axb")
    assert glob_prefix("user:1*") == "user:1" and glob_prefix("*x") == ""
    with pytest.raises(RespError, match="invalid pattern"):
        glob_regex("[z-a]")            # an error reply, never an internal error


def test_complete_buffered_sees_a_whole_next_command_without_consuming_it():
    whole = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nabc\r\n"
    for data, want in ((b"PING\r\n", True), (b"PIN", False), (whole, True),
                       (whole[:-1], False), (whole[:10], False), (b"*x\r\n", True),
                       (b"*2\r\n:1\r\n", True)):          # malformed: reading raises at once
        r = reader_of(data, chunk=len(data))
        r._fill()
        assert r.complete_buffered() is want, data
    r = reader_of(whole + b"PING\r\n", chunk=1000)
    r._fill()
    assert r.read_command() == [b"SET", b"k", b"abc"] and r.complete_buffered()
    assert r.read_command() == [b"PING"] and not r.complete_buffered()
