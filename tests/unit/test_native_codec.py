"""The native per-byte codec (kvstore/native/{xxh3,io,frames}.cpp, through
kvstore.transfer.codec and kvstore._native): XXH3-64 bit-identical to python-xxhash
at every length and split, copies and receives that hash on the way, and headers
whose every length is bounded. These also run against the sanitizer build of the
extension in CI (.ci/native_checks.sh)."""

from __future__ import annotations

import errno
import os
import random
import signal
import socket
import struct
import threading

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import _native
from kvstore.transfer import codec
from kvstore.transfer.protocol import REQUEST, RESPONSE, FrameReader, Op, StreamEnded

SEEDS = [0, 1, 0x9E3779B185EBCA87, 2**64 - 1]


def test_one_shot_matches_python_xxhash_at_every_length_to_2100():
    # 0-16, 17-128, 129-240 and the stripe/block boundaries of the long form.
    data = np.random.default_rng(1).integers(0, 256, 2100, dtype=np.uint8).tobytes()
    for n in range(len(data) + 1):
        for seed in SEEDS:
            assert _native.xxh3_64(data[:n], seed) == xxhash.xxh3_64_intdigest(data[:n], seed), \
                (n, seed)


def test_one_shot_matches_at_random_lengths_up_to_several_mib():
    rng = random.Random(2)
    big = np.random.default_rng(2).integers(0, 256, 6 << 20, dtype=np.uint8).tobytes()
    for _ in range(40):
        n = rng.randrange(len(big) + 1)
        start = rng.randrange(16)             # unaligned starts too
        view = memoryview(big)[start:start + n]
        assert codec.value_hash(view) == xxhash.xxh3_64_intdigest(view), n


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=5000), cuts=st.lists(st.integers(0, 5000), max_size=12),
       seed=st.sampled_from(SEEDS))
def test_streaming_gives_the_one_shot_hash_whatever_the_split(data, cuts, seed):
    h = _native.Hasher(seed)
    last = 0
    for cut in sorted(c % (len(data) + 1) for c in cuts):
        h.update(data[last:cut])
        last = cut
    h.update(data[last:])
    assert h.intdigest() == xxhash.xxh3_64_intdigest(data, seed)
    assert h.total_bytes == len(data)
    assert h.intdigest() == h.intdigest()        # digest leaves the state as it was


def test_streaming_large_values_in_random_pieces():
    rng = random.Random(3)
    data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    for _ in range(5):
        h, off = codec.Hasher(), 0
        while off < len(data):
            k = rng.choice([1, 63, 64, 65, 1023, 1024, 1025, 65536, rng.randrange(1, 300000)])
            h.update(memoryview(data)[off:off + k])
            off += k
        assert h.intdigest() == xxhash.xxh3_64_intdigest(data)
    h.reset()
    assert h.intdigest() == xxhash.xxh3_64_intdigest(b"")


def test_buffers_of_any_exporter():
    arr = np.arange(100000, dtype=np.float32)
    expected = xxhash.xxh3_64_intdigest(arr.tobytes())
    assert codec.value_hash(arr) == expected
    assert codec.value_hash(memoryview(arr)) == expected
    assert codec.value_hash(bytearray(arr.tobytes())) == expected
    torch = pytest.importorskip("torch")
    t = torch.arange(100000, dtype=torch.float32)
    assert codec.value_hash(memoryview(t.numpy())) == expected


def test_non_contiguous_buffers_are_refused():
    arr = np.arange(1000, dtype=np.uint8)[::2]
    with pytest.raises((BufferError, TypeError, ValueError)):
        codec.value_hash(arr)
    with pytest.raises(TypeError):
        codec.value_hash("not a buffer")


def test_copy_hashed_checks_lengths_writability_and_overlap():
    src = os.urandom(300000)
    dest = bytearray(len(src))
    assert codec.copy_hashed(dest, src) == xxhash.xxh3_64_intdigest(src)
    assert dest == src
    with pytest.raises(ValueError, match="must be equal"):
        codec.copy_hashed(bytearray(10), b"x" * 11)
    with pytest.raises((BufferError, TypeError)):
        codec.copy_hashed(bytes(10), b"x" * 10)          # not writable
    with pytest.raises((BufferError, TypeError)):
        codec.copy_hashed(memoryview(bytearray(10)).toreadonly(), b"x" * 10)
    buf = bytearray(100)
    with pytest.raises(ValueError, match="overlap"):
        codec.copy_hashed(memoryview(buf)[10:60], memoryview(buf)[0:50])


def test_copy_hashed_into_numpy():
    src = np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8)
    dest = np.zeros(1 << 18, dtype=np.float32)            # same bytes, other item type
    assert codec.copy_hashed(dest, src) == xxhash.xxh3_64_intdigest(src.tobytes())
    assert dest.tobytes() == src.tobytes()


# ---- recv_into_hashed ----

def _pair():
    a, b = socket.socketpair()
    return a, b


def _send_later(sock: socket.socket, data: bytes, pieces: int = 7) -> threading.Thread:
    def run():
        step = max(1, len(data) // pieces)
        for off in range(0, len(data), step):
            sock.sendall(data[off:off + step])
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("size", [0, 1, 240, 241, 70000, 3 << 20])
@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_recv_into_hashed_receives_and_hashes(size, timeout_s):
    a, b = _pair()
    try:
        b.settimeout(timeout_s)
        data = os.urandom(size)
        have = min(size, 100)
        dest = bytearray(size + 8)
        dest[:have] = data[:have]
        sender = _send_later(a, data[have:])
        assert codec.recv_into_hashed(b, dest, size, have) == xxhash.xxh3_64_intdigest(data)
        sender.join()
        assert dest[:size] == data and dest[size:] == bytes(8)
    finally:
        a.close()
        b.close()


def test_recv_into_hashed_reports_a_closed_stream():
    a, b = _pair()
    a.sendall(b"abc")
    a.close()
    with pytest.raises(EOFError):
        codec.recv_into_hashed(b, bytearray(10), 10)
    b.close()
    with pytest.raises(OSError) as exc:              # a closed socket: as sock.recv_into
        codec.recv_into_hashed(b, bytearray(10), 10)
    assert exc.value.errno == errno.EBADF


def test_recv_into_hashed_times_out_like_recv_into():
    a, b = _pair()
    try:
        b.settimeout(0.05)
        with pytest.raises(TimeoutError):
            codec.recv_into_hashed(b, bytearray(10), 10)
        b.settimeout(None)                           # the kernel's timeout: EAGAIN
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 50000))
        with pytest.raises(BlockingIOError):
            codec.recv_into_hashed(b, bytearray(10), 10)
        b.setblocking(False)
        with pytest.raises(BlockingIOError):
            codec.recv_into_hashed(b, bytearray(10), 10)
    finally:
        a.close()
        b.close()


def test_recv_into_hashed_checks_sizes_and_writability():
    a, b = _pair()
    try:
        with pytest.raises(ValueError, match="nbytes"):
            codec.recv_into_hashed(b, bytearray(10), 11)
        with pytest.raises(ValueError, match="have"):
            codec.recv_into_hashed(b, bytearray(10), 5, 6)
        with pytest.raises((BufferError, TypeError)):
            codec.recv_into_hashed(b, bytes(10), 10)
    finally:
        a.close()
        b.close()


def test_recv_into_hashed_runs_signal_handlers_on_eintr():
    """A signal during the receive runs its Python handler (PEP 475, as recv_into):
    one that returns lets the receive go on; one that raises ends it."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals go to the main thread")
    a, b = _pair()
    seen = []

    def note(_sig, _frame):
        seen.append(1)

    def boom(_sig, _frame):
        raise KeyboardInterrupt("from the handler")
    old = signal.signal(signal.SIGALRM, note)
    try:
        b.settimeout(None)
        data = os.urandom(1000)
        timer = threading.Timer(0.3, a.sendall, (data,))
        timer.start()
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        assert codec.recv_into_hashed(b, bytearray(1000), 1000) == xxhash.xxh3_64_intdigest(data)
        timer.join()
        assert seen
        signal.signal(signal.SIGALRM, boom)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(KeyboardInterrupt, match="from the handler"):
            codec.recv_into_hashed(b, bytearray(10), 10)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        a.close()
        b.close()


def test_frame_reader_read_into_hashed_takes_the_buffered_part_first():
    a, b = _pair()
    try:
        value = os.urandom(600000)
        a.sendall(b"H" * 16 + value[:5000])
        reader = FrameReader(b, 64 * 1024)
        reader.poll(16 + 5000, 1.0)
        assert bytes(reader.read(16)) == b"H" * 16
        sender = _send_later(a, value[5000:] + b"NEXT")
        dest = bytearray(len(value))
        assert reader.read_into_hashed(memoryview(dest)) == xxhash.xxh3_64_intdigest(value)
        assert dest == value
        sender.join()
        assert bytes(reader.read(4)) == b"NEXT"      # what follows the value stays in order
        a.close()
        with pytest.raises(StreamEnded) as exc:
            reader.read_into_hashed(memoryview(bytearray(10)))
        assert isinstance(exc.value.__cause__, EOFError)
    finally:
        a.close()
        b.close()


# ---- frames ----

LIMITS = _native.FrameLimits(max_key_bytes=512, max_parent_bytes=512,
                             max_value_bytes=1 << 30, max_connect_bytes=4096,
                             max_message_bytes=4096)


@settings(max_examples=200, deadline=None)
@given(op=st.sampled_from([int(o) for o in Op]), key_len=st.integers(0, 512),
       parent_len=st.integers(0, 512), oid=st.integers(0, 2**64 - 1),
       size=st.integers(0, 1 << 30), ck=st.integers(0, 2**64 - 1))
def test_request_headers_round_trip_with_the_python_layout(op, key_len, parent_len, oid, size,
                                                           ck):
    flags = 2 if op in (Op.PUT, Op.SHM_ALLOC) else 0
    wire = REQUEST.pack(op, flags, key_len, parent_len, oid, size, ck)
    assert _native.encode_request(op, flags, key_len, parent_len, oid, size, ck) == wire
    assert _native.decode_request(wire, LIMITS) == ("ok", op, flags, key_len, parent_len, oid,
                                                    size, ck)


def test_response_headers_round_trip_with_the_python_layout():
    fields = (3, 0, 100, 0, 7, 1 << 20, 2**64 - 1, 4096, 9)
    wire = RESPONSE.pack(*fields)
    assert _native.encode_response(*fields) == wire
    assert _native.decode_response(wire, LIMITS) == ("ok", *fields)


@pytest.mark.parametrize("header, error", [
    (REQUEST.pack(Op.PUT, 0, 0, 0, 0, 0, 0)[:31], "short"),
    (REQUEST.pack(99, 0, 0, 0, 0, 0, 0), "unknown_op"),
    (REQUEST.pack(0, 0, 0, 0, 0, 0, 0), "unknown_op"),
    (REQUEST.pack(Op.GET, 1, 3, 0, 0, 0, 0), "bad_flags"),
    (REQUEST.pack(Op.GET, 0, 513, 0, 0, 0, 0), "key_too_long"),
    (REQUEST.pack(Op.PUT, 0, 10, 2**32 - 1, 0, 0, 0), "parent_too_long"),
    (REQUEST.pack(Op.PUT, 0, 10, 0, 0, (1 << 30) + 1, 0), "value_too_large"),
    (REQUEST.pack(Op.SHM_ALLOC, 0, 10, 0, 0, 2**64 - 1, 0), "value_too_large"),
    (REQUEST.pack(Op.AUTH_PROVE, 0, 0, 0, 0, (1 << 30) + 1, 0), "value_too_large"),
    (REQUEST.pack(32, 0, 0, 0, 0, 4097, 0), "value_too_large"),     # RDMA_CONNECT
])
def test_every_violation_has_its_own_error(header, error):
    assert _native.decode_request(header, LIMITS)[0] == error


def test_sizes_that_are_arguments_are_not_value_bounds():
    # PIN's size is a TTL in ms, PREFETCH's a deadline: not bytes to receive.
    for op in (Op.PIN, Op.PREFETCH, Op.GET):
        assert _native.decode_request(REQUEST.pack(op, 0, 5, 0, 0, 2**64 - 1, 0), LIMITS)[0] == "ok"


def test_overlong_response_message_is_refused():
    wire = RESPONSE.pack(5, 0, 4097, 0, 0, 0, 0, 0, 0)
    assert _native.decode_response(wire, LIMITS)[0] == "message_too_long"
    assert _native.decode_response(wire[:47], LIMITS)[0] == "short"


@pytest.mark.parametrize("isa", ["portable", "sse2", "avx2", "avx512"])
def test_every_build_of_the_stripe_loop_gives_the_same_hashes(isa):
    """xxh3.cpp picks the widest loop the CPU runs; KVSTORE_XXH3_ISA forces a
    narrower one (one the CPU lacks falls back to the next), so each is checked here."""
    code = """
import os, random, xxhash
from kvstore import _native
data = bytes(random.Random(5).getrandbits(8) for _ in range(9000))
for n in list(range(230, 2100)) + [4095, 4096, 4097, 9000]:
    assert _native.xxh3_64(data[:n]) == xxhash.xxh3_64_intdigest(data[:n]), n
    assert _native.xxh3_64(data[:n], 7) == xxhash.xxh3_64_intdigest(data[:n], 7), n
    dst = bytearray(n)
    assert _native.copy_hashed(dst, data[:n]) == xxhash.xxh3_64_intdigest(data[:n]) and dst == data[:n]
h = _native.Hasher()
for k in range(0, len(data), 333):
    h.update(data[k:k + 333])
assert h.intdigest() == xxhash.xxh3_64_intdigest(data)
"""
    import subprocess
    import sys
    env = dict(os.environ, KVSTORE_XXH3_ISA=isa)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
