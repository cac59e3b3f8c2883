"""Target choice from a placement grant (kvstore.client.core.placement.take), without a network."""

from __future__ import annotations

import logging
import time

import pytest

from kvstore.client.core import placement
from kvstore.client.core.placement import Grant, GrantedNode, take
from kvstore.errors import TooLarge, Unavailable
from kvstore.types import NodeAddress, NodeId

MiB = 1 << 20


def _grant(*nodes: tuple[str, str, int]) -> Grant:
    """A fresh grant of (node id, host id, free MiB) nodes, each keeping 8 MiB values."""
    return Grant(1, 100, tuple(GrantedNode(NodeAddress(NodeId(n), "127.0.0.1", 1, host_id=h),
                                           free * MiB, 8 * MiB) for n, h, free in nodes),
                 time.monotonic(), 60.0)


def test_replicas_land_on_distinct_nodes_a_local_one_first():
    g = _grant(("a", "h1", 64), ("b", "h2", 64), ("c", "h3", 64))
    oid, targets = take(g, "k", MiB, 2, frozenset(), "h3")
    assert oid == 1 and g.next_id == 2
    assert len({t.node_id for t in targets}) == 2 and targets[0].node_id == "c"


def test_failed_nodes_are_left_out_and_too_large_is_refused():
    g = _grant(("a", "h1", 64), ("b", "h2", 64))
    _, targets = take(g, "k", MiB, 1, frozenset({NodeId("a")}), None)
    assert [t.node_id for t in targets] == ["b"]
    with pytest.raises(Unavailable, match="failed it"):
        take(g, "k", MiB, 1, frozenset({NodeId("a"), NodeId("b")}), None)
    with pytest.raises(TooLarge):
        take(g, "k", 9 * MiB, 1, frozenset(), None)


def test_more_replicas_than_nodes_places_one_per_node_and_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(placement, "_WARNED", set())
    g = _grant(("a", "h1", 64), ("b", "h2", 64))
    with caplog.at_level(logging.WARNING, logger=placement.__name__):
        for _ in range(3):
            _, targets = take(g, "k", MiB, 3, frozenset(), None)
            assert sorted(t.node_id for t in targets) == ["a", "b"]
    said = [r for r in caplog.records if "replica_num 3" in r.getMessage()]
    assert len(said) == 1 and "2 live node(s)" in said[0].getMessage()
