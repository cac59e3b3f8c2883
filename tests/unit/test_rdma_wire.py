"""The RDMA transport's pure parts: wire descriptors, staging plans, region lookup.

No RDMA hardware or pyverbs needed; ``tests/rdma`` has the hardware tests.
"""

from __future__ import annotations

import importlib.util
import struct

import numpy as np
import pytest

from kvstore.errors import InvalidArgument, Unavailable
from kvstore.transfer import rdma_wire as rdma
from kvstore.transfer.protocol import REQUEST, Op
from kvstore.transfer.rdma_wire import (Chunk, MrDescriptor, QpDescriptor, RegionTable,
                                        address_of, decode_connect_reply, encode_connect_reply,
                                        gid_to_bytes, gid_to_text, plan_rounds)
from kvstore.transfer.verbs import RdmaDevice

GID = bytes.fromhex("fe800000000000000202c9fffe0a0b0c")


def test_qp_descriptor_round_trip_and_layout():
    d = QpDescriptor(qpn=0x12345, psn=0xABCDEF, lid=7, gid=GID, port=2, mtu=5, gid_index=3,
                     rd_atomic=16)
    raw = d.encode()
    assert len(raw) == 36
    assert raw[:4] == b"KVRQ" and raw[4] == 1
    assert struct.unpack_from("<HHI", raw, 8) == (7, 16, 0x12345)   # lid, rd_atomic, qpn
    assert raw[-16:] == GID
    assert QpDescriptor.decode(raw) == d
    assert QpDescriptor.decode(memoryview(raw)) == d


@pytest.mark.parametrize("bad", [
    dict(qpn=1 << 24), dict(psn=1 << 24), dict(qpn=-1), dict(gid=b"\0" * 15), dict(lid=1 << 16),
    dict(port=256), dict(rd_atomic=1 << 16),
])
def test_qp_descriptor_rejects_fields_that_do_not_fit(bad):
    fields = dict(qpn=1, psn=2, lid=3, gid=GID) | bad
    with pytest.raises(InvalidArgument):
        QpDescriptor(**fields).encode()


def test_descriptors_reject_foreign_bytes():
    good = QpDescriptor(qpn=1, psn=2, lid=0, gid=GID).encode()
    with pytest.raises(InvalidArgument):
        QpDescriptor.decode(good[:-1])
    with pytest.raises(InvalidArgument):
        QpDescriptor.decode(b"XXXX" + good[4:])
    with pytest.raises(InvalidArgument):
        QpDescriptor.decode(good[:4] + b"\x02" + good[5:])   # a future version
    mr = MrDescriptor(addr=1, length=2, rkey=3).encode()
    with pytest.raises(InvalidArgument):
        MrDescriptor.decode(good[:32])                      # right size, wrong magic
    with pytest.raises(InvalidArgument):
        MrDescriptor.decode(mr + b"\0")


def test_mr_descriptor_round_trip_and_bounds():
    d = MrDescriptor(addr=0x7F00_0000_1000, length=64 << 20, rkey=0xDEADBEEF)
    raw = d.encode()
    assert len(raw) == 32 and raw[:4] == b"KVRM"
    assert MrDescriptor.decode(raw) == d
    assert d.remote_address(0, 16) == d.addr
    assert d.remote_address(d.length - 16, 16) == d.addr + d.length - 16
    assert d.remote_address(d.length, 0) == d.addr + d.length
    for offset, size in [(d.length - 15, 16), (-1, 1), (0, d.length + 1), (2**64 - 1, 1)]:
        with pytest.raises(InvalidArgument):
            d.remote_address(offset, size)
    with pytest.raises(InvalidArgument):
        MrDescriptor(addr=-1, length=0, rkey=0).encode()


def test_connect_reply_round_trip():
    qp = QpDescriptor(qpn=9, psn=10, lid=11, gid=bytes(16))
    mr = MrDescriptor(addr=4096, length=8192, rkey=5)
    raw = encode_connect_reply(qp, mr)
    assert len(raw) == 68 <= rdma.MAX_CONNECT_BYTES
    assert decode_connect_reply(raw) == (qp, mr)
    with pytest.raises(InvalidArgument):
        decode_connect_reply(raw[:-1])


def test_connect_op_is_outside_the_core_protocol_and_fits_a_frame():
    assert rdma.OP_RDMA_CONNECT not in {int(op) for op in Op}
    REQUEST.pack(rdma.OP_RDMA_CONNECT, 0, 0, 0, 0, 36, 0)   # fits the u8 op field


def test_gid_text_round_trip():
    text = gid_to_text(GID)
    assert text == "fe80:0000:0000:0000:0202:c9ff:fe0a:0b0c"
    assert gid_to_bytes(text) == GID
    with pytest.raises(InvalidArgument):
        gid_to_bytes("fe80::1")


def _covered(rounds, sizes):
    """Every byte of every value exactly once, in order."""
    seen = {i: [] for i in range(len(sizes))}
    for rnd in rounds:
        for c in rnd:
            seen[c.item].append((c.item_offset, c.length))
    for i, size in enumerate(sizes):
        pos = 0
        for off, n in seen[i]:
            assert off == pos and n > 0
            pos += n
        assert pos == size


@pytest.mark.parametrize("sizes,capacity,max_chunks", [
    ([32768] * 10, 65536, 32),          # two KV pages per round
    ([100, 0, 5, 70000, 1], 4096, 3),   # a value bigger than the buffer, a 0-byte value
    ([1] * 50, 1 << 20, 8),             # bounded by work requests, not bytes
    ([], 1024, 4),
])
def test_plan_rounds_covers_each_value_within_limits(sizes, capacity, max_chunks):
    rounds = plan_rounds(sizes, capacity, max_chunks)
    _covered(rounds, sizes)
    for rnd in rounds:
        assert rnd and len(rnd) <= max_chunks
        assert sum(c.length for c in rnd) <= capacity
        spans = sorted((c.staging_offset, c.staging_offset + c.length) for c in rnd)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))   # no overlap in staging
        assert spans[-1][1] <= capacity


def test_plan_rounds_packs_in_order():
    assert plan_rounds([3, 3], 4, 8) == [[Chunk(0, 0, 3, 0), Chunk(1, 0, 1, 3)],
                                         [Chunk(1, 1, 2, 0)]]
    with pytest.raises(ValueError):
        plan_rounds([1], 0, 1)


def test_region_table_finds_the_covering_registration():
    t = RegionTable()
    t.add(0x1000, 0x1000, lkey=1)
    t.add(0x4000, 0x100, lkey=2)
    assert t.find(0x1000, 0x1000) == 1
    assert t.find(0x1800, 0x10) == 1
    assert t.find(0x1FFF, 2) is None        # runs past the end
    assert t.find(0x0FFF, 1) is None
    assert t.find(0x3000, 1) is None
    assert t.find(0x40FF, 1) == 2
    with pytest.raises(ValueError):
        t.add(0x1FFF, 2, lkey=3)            # overlaps the first
    with pytest.raises(ValueError):
        t.add(0x3F00, 0x101, lkey=3)        # overlaps the second
    t.add(0x2000, 0x2000, lkey=4)           # touching both is fine
    t.remove(0x1000)
    assert t.find(0x1800, 1) is None and t.find(0x2000, 1) == 4


def test_address_of_matches_numpy_for_writable_and_read_only_views():
    arr = np.zeros(64, dtype=np.uint8)
    view = memoryview(arr)
    assert address_of(view) == arr.ctypes.data
    assert address_of(view[16:]) == arr.ctypes.data + 16
    ro = memoryview(bytes(8))
    assert address_of(ro) == np.frombuffer(ro, dtype=np.uint8).ctypes.data


@pytest.mark.skipif(importlib.util.find_spec("pyverbs") is not None, reason="pyverbs is installed")
def test_without_pyverbs_the_error_says_what_to_install():
    with pytest.raises(Unavailable, match="pyverbs.*rdma"):
        RdmaDevice("rxe0")
