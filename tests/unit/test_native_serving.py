"""kvstore._native's GET service alone (kvstore/native/serving.hpp): ServingIndex and
serve_gets over a socket pair, without a node."""

from __future__ import annotations

import socket
import time

import pytest

from kvstore import _native
from kvstore.keys import value_checksum
from kvstore.transfer.protocol import REQUEST, RESPONSE, Op

HANDOFF, YIELD, CLOSED = 0, 1, 2


def _frame(op: int, key: bytes, object_id: int = 0, parent: bytes = b"") -> bytes:
    return REQUEST.pack(op, 0, len(key), len(parent), object_id, 0, 0) + key + parent


@pytest.fixture()
def world():
    segment = bytearray(1 << 20)
    segment[4096:4096 + 11] = b"hello world"
    index = _native.ServingIndex(segment, 4)
    index.set_lease(float("inf"))                   # none until set: fenced
    assert index.publish("k", 7, 4096, 11, value_checksum(b"hello world"), 42, 3)
    a, b = socket.socketpair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, b"\x01" + b"\x00" * 15)  # 1 s
    opts = _native.ServeOptions(0.0, 1, 4096, 0.05, [0.001, 0.01])
    yield segment, index, a, b, opts
    a.close()
    b.close()


def _serve(index, b, opts, buf: bytearray, start: int = 0, end: int = 0):
    return _native.serve_gets(index, b.fileno(), buf, start, end, opts)


def _answers(a: socket.socket, n: int) -> list[tuple[int, int, bytes]]:
    out = []
    a.settimeout(5)
    for _ in range(n):
        head = b""
        while len(head) < RESPONSE.size:
            head += a.recv(RESPONSE.size - len(head))
        code, _f, _m, _r, oid, size, _ck, _off, _ser = RESPONSE.unpack(head)
        value = b""
        while len(value) < size:
            value += a.recv(size - len(value))
        out.append((code, oid, value))
    return out


def test_gets_of_a_published_copy_are_answered_and_others_handed_back(world):
    _segment, index, a, b, opts = world
    buf = bytearray(64 * 1024)
    wire = _frame(Op.GET, b"k") + _frame(Op.GET, b"k", 42) + _frame(Op.GET, b"other")
    buf[:len(wire)] = wire
    status, err, start, end, gets, nbytes, hist, seconds, touches, touch_hist, _ = _serve(
        index, b, opts, buf, 0, len(wire))
    assert (status, err, gets, nbytes) == (HANDOFF, 0, 2, 22)
    assert bytes(buf[start:end]) == _frame(Op.GET, b"other")      # left unread
    assert sum(hist) == 2 and seconds >= 0 and sum(touch_hist) == 0
    assert touches == (3).to_bytes(8, "little") + (7).to_bytes(8, "little")   # once per copy
    assert _answers(a, 2) == [(0, 42, b"hello world")] * 2
    assert index.gets == 2
    assert index.serves(b"k", 0) and index.serves(b"k", 42)
    assert not index.serves(b"k", 41) and not index.serves(b"other", 0)


def test_touches_of_a_served_copy_are_counted_and_answered_in_order(world):
    """A same-host reader's SHM_TOUCH (it copied the value without the node) is a read:
    counted with the gets (and the copy's bytes), answered OK with the frame's
    object_id and no value, in order among the GETs; a touch of a copy not served
    is handed back (Python's loop answers it)."""
    _segment, index, a, b, opts = world
    buf = bytearray(64 * 1024)
    wire = (_frame(Op.SHM_TOUCH, b"k", 42) + _frame(Op.GET, b"k") + _frame(Op.SHM_TOUCH, b"k")
            + _frame(Op.SHM_TOUCH, b"k", 41))
    buf[:len(wire)] = wire
    status, _err, start, end, gets, nbytes, hist, _s, touches, touch_hist, _ts = _serve(
        index, b, opts, buf, 0, len(wire))
    assert (status, gets, nbytes) == (HANDOFF, 3, 33)
    assert sum(hist) == 1 and sum(touch_hist) == 2
    assert bytes(buf[start:end]) == _frame(Op.SHM_TOUCH, b"k", 41)      # another version
    assert touches == (3).to_bytes(8, "little") + (7).to_bytes(8, "little")   # once per copy
    assert _answers(a, 3) == [(0, 42, b""), (0, 42, b"hello world"), (0, 0, b"")]
    assert index.gets == 3
    assert index.withdraw(7) == 0                  # a touch holds no reader


@pytest.mark.parametrize("wire", [
    _frame(Op.GET, b"k", 41),                 # another version: Python's NOT_FOUND
    REQUEST.pack(Op.SHM_TOUCH, 0, 1, 0, 0, 0, 0) + b"x",     # a touch of a copy not served
    _frame(Op.GET, b"k", 0, parent=b"p"),     # a GET with a parent is not one of ours
    _frame(Op.PUT, b"k"),                     # not a GET
    _frame(Op.GET, b""),                      # no key
    REQUEST.pack(Op.GET, 0, 600, 0, 0, 0, 0) + b"x" * 600,   # a key over 512 B
    REQUEST.pack(Op.GET, 1, 1, 0, 0, 0, 0) + b"k",           # flags on a GET
])
def test_what_is_not_a_plain_get_of_a_served_copy_is_handed_back(world, wire):
    _segment, index, _a, b, opts = world
    buf = bytearray(64 * 1024)
    buf[:len(wire)] = wire
    status, _err, start, end, gets, *_ = _serve(index, b, opts, buf, 0, len(wire))
    assert (status, gets, start, end) == (HANDOFF, 0, 0, len(wire))


def test_a_withdrawn_copy_a_lease_and_the_cap(world):
    segment, index, a, b, opts = world
    buf = bytearray(64 * 1024)
    wire = _frame(Op.GET, b"k")
    buf[:len(wire)] = wire
    index.set_lease(time.monotonic() - 1)             # fenced
    assert _serve(index, b, opts, buf, 0, len(wire))[0:5:4] == (HANDOFF, 0)
    index.set_lease(float("inf"))
    assert index.withdraw(7) == 0 and len(index) == 0   # no send under way: free at once
    assert _serve(index, b, opts, buf, 0, len(wire))[0:5:4] == (HANDOFF, 0)
    assert index.take_released() == []
    # Out of the segment: refused. The cap: 4 copies.
    assert not index.publish("far", 1, len(segment) - 4, 8, 0, 1, 0)
    assert all(index.publish(f"c{i}", 10 + i, 0, 8, 0, 1, i) for i in range(4))
    assert not index.publish("c4", 20, 0, 8, 0, 1, 4)
    # A newer copy of a key replaces the older one (which counts as withdrawn).
    assert index.publish("c0", 30, 64, 8, 0, 2, 0)
    assert len(index) == 4 and index.withdraw(10) == 0


def test_a_closed_peer_and_an_idle_wait_that_accounts_first(world):
    _segment, index, a, b, opts = world
    buf = bytearray(64 * 1024)
    a.sendall(_frame(Op.GET, b"k"))
    status, _err, start, end, gets, *_ = _serve(index, b, opts, buf)
    assert (status, gets) == (YIELD, 1)          # answered, then back before sleeping
    assert start == end
    assert _answers(a, 1) == [(0, 42, b"hello world")]
    a.shutdown(socket.SHUT_WR)
    assert _serve(index, b, opts, buf, start, end)[0] == CLOSED


def test_bad_arguments_are_refused(world):
    _segment, index, _a, b, opts = world
    with pytest.raises(ValueError):
        _native.serve_gets(index, b.fileno(), bytearray(64 * 1024), 10, 5, opts)
    with pytest.raises(ValueError):
        _native.serve_gets(index, b.fileno(), bytearray(100), 0, 0, opts)
