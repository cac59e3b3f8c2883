"""A same-host put copies a value whose checksum is not known yet into the node's
segment and hashes each piece as it lands (kvstore.transfer.codec.copy_hashed, used by
kvstore.transfer.shm): the bytes and the checksum must be exactly those of the value,
at every size, and around the native core's 64 KiB pieces."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.keys import value_checksum
from kvstore.transfer.codec import copy_hashed

PIECE_BYTES = 64 * 1024      # kvstore/native/io.hpp kPieceBytes


@pytest.mark.parametrize("size", [0, 1, PIECE_BYTES, PIECE_BYTES + 1, 3 * PIECE_BYTES - 7,
                                  4 << 20])
def test_copy_hashed_copies_and_returns_the_values_checksum(size):
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    dest = bytearray(size + 16)
    assert copy_hashed(memoryview(dest)[:size], memoryview(src)) == value_checksum(src)
    assert bytes(dest[:size]) == src and dest[size:] == bytes(16)
