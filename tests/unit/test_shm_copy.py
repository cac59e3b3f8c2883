"""A same-host put copies a value whose checksum is not known yet into the node's
segment and hashes each piece as it lands (kvstore.transfer.codec.copy_hashed, used by
kvstore.transfer.shm): the bytes and the checksum must be exactly those of the value,
at every size, around the XXH3 stripes (64 B) and blocks (1024 B) it copies by."""

from __future__ import annotations

import numpy as np
import pytest

from kvstore.keys import value_checksum
from kvstore.transfer.codec import copy_hashed

@pytest.mark.parametrize("size", [0, 1, 240, 241, 255, 256, 257, 1024, 1025, 65536, 65537,
                                  3 * 65536 - 7, 4 << 20])
def test_copy_hashed_copies_and_returns_the_values_checksum(size):
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    dest = bytearray(size + 16)
    assert copy_hashed(memoryview(dest)[:size], memoryview(src)) == value_checksum(src)
    assert bytes(dest[:size]) == src and dest[size:] == bytes(16)
