"""SegmentMaps: a client's threads share one mapping per node segment (real /dev/shm)."""

from __future__ import annotations

import uuid

import pytest

from kvstore.errors import Unavailable
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


def _mapped(name: str) -> bool:
    """Whether this process maps /dev/shm/``name`` (deleted or not)."""
    with open("/proc/self/maps") as f:
        return any(f"/dev/shm/{name}" in line for line in f)


def test_a_restarted_nodes_old_segment_is_unmapped_though_idle_users_hold_it():
    # A node restarts under a new segment name (its pid changed). Idle threads'
    # transports still hold the old mapping; the new mapping retires it.
    old_name, new_name = (f"kvstore-test-{uuid.uuid4().hex[:8]}" for _ in range(2))
    old = ShmSegment(old_name, 1 << 20, create=True)
    maps = SegmentMaps(prefault_bytes=0)
    new = None
    try:
        idle = maps.acquire(old_name, "n0")
        busy = maps.acquire(old_name, "n0")
        assert idle is busy and _mapped(old_name)
        old.close()                                    # the node died: the file is unlinked
        new = ShmSegment(new_name, 1 << 20, create=True)
        with maps.using(busy) as view:                 # an operation still in the old one
            fresh = maps.acquire(new_name, "n0")
            assert bytes(view[:1]) == b"\0"            # stays mapped until it ends
            assert _mapped(old_name) and not busy.closed
        assert busy.closed and not _mapped(old_name)   # ... then goes, held or not
        with pytest.raises(Unavailable, match="unmapped"):
            with maps.using(idle):
                pass
        maps.release(idle)                             # its holders let go later: harmless
        maps.release(busy)
        with maps.using(fresh) as view:
            view[:2] = b"ok"
        maps.release(fresh)
    finally:
        old.close()
        if new is not None:
            new.close()


def test_a_failed_node_retires_its_mapping_and_the_next_user_maps_it_again():
    name = f"kvstore-test-{uuid.uuid4().hex[:8]}"
    node = ShmSegment(name, 1 << 20, create=True)
    maps = SegmentMaps(prefault_bytes=0)
    try:
        held = maps.acquire(name, "n0")
        maps.retire_node("n0")                         # a transport to n0 failed
        assert held.closed
        again = maps.acquire(name, "n0")               # the node is back: mapped anew
        assert again is not held and not again.closed
        node.view[:3] = b"abc"
        with maps.using(again) as view:
            assert bytes(view[:3]) == b"abc"
        maps.release(held)
        maps.release(again)
    finally:
        node.close()
