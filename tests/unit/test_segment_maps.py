"""SegmentMaps: a client's threads share one mapping per node segment (real /dev/shm)."""

from __future__ import annotations

import uuid

from kvstore.transfer.shm import SegmentMaps, ShmSegment


def test_threads_share_one_mapping_and_a_replaced_segment_is_mapped_anew():
    name = f"kvstore-test-{uuid.uuid4().hex[:8]}"
    node = ShmSegment(name, 1 << 20, create=True)
    maps = SegmentMaps(prefault_bytes=1 << 20)
    try:
        a, b = maps.acquire(name), maps.acquire(name)
        assert a is b
        node.view[:5] = b"hello"
        assert bytes(a.view[:5]) == b"hello"
        maps.release(a)
        assert bytes(b.view[:5]) == b"hello"          # still mapped for its other user
        # The node restarts: same name, another file. New users get the new file.
        node.close()
        node = ShmSegment(name, 1 << 20, create=True)
        node.view[:5] = b"world"
        c = maps.acquire(name)
        assert c is not b and bytes(c.view[:5]) == b"world"
        maps.release(b)
        maps.release(c)
        d = maps.acquire(name)
        assert d is not c                              # the last release unmapped it
        maps.release(d)
    finally:
        node.close()
