"""A same-host put copies a value whose checksum is not known yet piece by piece into
the node's segment and hashes each piece as it lands (kvstore.transfer.shm): the
bytes and the checksum must be exactly those of the value, at every size."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.keys import value_checksum
from kvstore.transfer.shm import COPY_PIECE_BYTES, copy_hashing


@pytest.mark.parametrize("size", [0, 1, COPY_PIECE_BYTES, COPY_PIECE_BYTES + 1,
                                  3 * COPY_PIECE_BYTES - 7])
def test_copy_hashing_copies_and_returns_the_values_checksum(size):
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    dest = bytearray(size + 16)
    assert copy_hashing(memoryview(dest)[:size], memoryview(src)) == value_checksum(src)
    assert bytes(dest[:size]) == src and dest[size:] == bytes(16)
