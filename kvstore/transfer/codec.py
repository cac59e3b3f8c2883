"""The per-byte codec of the data path: value checksums, copies and receives fused
with them, in the native core (``kvstore._native``, kvstore/native/{xxh3,io}.cpp).

Every checksum of a value is XXH3-64 with seed 0, bit-identical to
python-xxhash's ``xxh3_64_intdigest`` (the core's XXH3 is written from the
xxHash specification, doc/xxhash_spec.md of the xxHash project, and tested
against python-xxhash). What the core adds over python-xxhash, which is C
too: the copy and the hash in one pass over cache-sized pieces, the hash of a
value while it is received, and the GIL released around all of it, so the
node's other connections and the client's other threads run meanwhile.

Callers use this module, never ``kvstore._native`` directly. Buffers are any
C-contiguous object with the buffer protocol (bytes, bytearray, memoryview,
mmap, numpy arrays; torch CPU tensors through ``memoryview(t.numpy())``).
Keys keep python-xxhash (:mod:`kvstore.keys`): they are short and not per-byte hot.
"""

from __future__ import annotations

import errno
import socket

from kvstore import _native

#: Streaming XXH3-64: ``Hasher().update(piece)`` ..., then ``.intdigest()``
#: (python-xxhash's ``xxh3_64`` interface; pieces of 16 KiB and more release the GIL).
Hasher = _native.Hasher


def value_hash(data) -> int:
    """XXH3-64 (seed 0) of a value: the checksum kept with every object.

    Args:
        data: any C-contiguous buffer; its bytes as laid out in memory.

    Returns:
        The checksum, an unsigned 64-bit int.

    Raises:
        TypeError, BufferError: not a C-contiguous buffer.
    """
    return _native.xxh3_64(data)


def copy_hashed(dest, src) -> int:
    """Copy ``src`` into ``dest`` and return the XXH3-64 of the bytes, in one pass.

    Each 64-byte stripe of ``src`` is loaded once, stored to ``dest`` and hashed
    from the same registers: the bytes are read once, not twice as a copy and
    then a hash would. The GIL is released from 16 KiB on.

    Args:
        dest: a writable buffer of exactly ``len(src)`` bytes, not overlapping ``src``.
        src: the bytes to copy.

    Returns:
        The checksum of the bytes copied.

    Raises:
        ValueError: the lengths differ, or the buffers overlap.
        TypeError, BufferError: ``dest`` is not writable, or a buffer is not C-contiguous.
    """
    return _native.copy_hashed(dest, src)


def recv_into_hashed(sock: socket.socket, dest, nbytes: int, have: int = 0) -> int:
    """Receive ``dest[have:nbytes]`` from ``sock`` (the first ``have`` bytes are
    already there) and return the XXH3-64 of ``dest[:nbytes]``, each piece hashed
    as soon as it arrived; the GIL is released throughout.

    Plain (not TLS) stream sockets only: the bytes are read from the file
    descriptor. The socket's timeout applies to each piece as in
    ``sock.recv_into``: with none, the fd's own (SO_RCVTIMEO) ends in
    BlockingIOError; EINTR runs the signal handlers and goes on.

    Raises:
        EOFError: the peer closed the connection first.
        TimeoutError: no byte came within the socket's timeout.
        BlockingIOError: the kernel's receive timeout ran out (no socket timeout).
        OSError: the receive failed (ConnectionResetError, ...).
        ValueError: ``nbytes > len(dest)`` or ``have > nbytes``.
    """
    fd = sock.fileno()
    if fd < 0:                       # what sock.recv_into says of a closed socket
        raise OSError(errno.EBADF, "Bad file descriptor")
    return _native.recv_into_hashed(fd, dest, nbytes, have, sock.gettimeout())
