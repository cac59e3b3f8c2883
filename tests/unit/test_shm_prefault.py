"""ShmSegment.prefault maps a segment's pages ahead of its copies (no page fault per
first touch); DramTier does it on a background thread unless told not to."""

from __future__ import annotations

import os
import uuid

from kvstore.store.tiers.dram import DramTier
from kvstore.transfer.shm import ShmSegment
from kvtest import wait_for


def rss_kib(path: str) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1])
    return total


def test_prefault_maps_every_page():
    name = f"kvstore-test-{uuid.uuid4().hex[:8]}"
    seg = ShmSegment(name, 16 << 20, create=True)
    try:
        assert rss_kib(seg.path) == 0
        assert seg.prefault(limit_bytes=8 << 20) == 8 << 20
        assert rss_kib(seg.path) == 8 << 10
        assert seg.prefault() == 16 << 20
        assert rss_kib(seg.path) == 16 << 10
        other = ShmSegment(name)          # a client's mapping: its own page tables
        try:
            assert rss_kib(seg.path) == 16 << 10
            other.prefault()
            assert rss_kib(seg.path) == 32 << 10     # both mappings now resident
        finally:
            other.close()
    finally:
        seg.close()
    assert not os.path.exists(seg.path)


def test_prefault_stops_at_close():
    seg = ShmSegment(f"kvstore-test-{uuid.uuid4().hex[:8]}", 8 << 20, create=True)
    seg.close()
    assert seg.prefault() == 0            # a closed segment: nothing, no error


def test_dram_tier_prefaults_unless_told_not_to():
    warm = DramTier(16 << 20, name=f"kvstore-test-{uuid.uuid4().hex[:8]}", prefault=True)
    cold = DramTier(16 << 20, name=f"kvstore-test-{uuid.uuid4().hex[:8]}")
    try:
        # Every page, the read-slot table behind the capacity included; a cold
        # tier has touched only the page of the table's trailer.
        pages_kib = -(-warm.segment.size_bytes // 4096) * 4
        wait_for(lambda: rss_kib(warm.segment.path) == pages_kib)
        assert rss_kib(cold.segment.path) <= 4
    finally:
        warm.close()
        cold.close()
