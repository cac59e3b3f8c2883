"""Busy-polling is bounded and can be turned off: the data connections' poll window
(:mod:`kvstore.store.polling`); the report link's is in test_report_link_spin.py."""

from __future__ import annotations

import pytest

from kvstore.store.data_server import DataServer
from kvstore.store.node import StoreNode
from kvstore.store.polling import POLL_S, Pollers
from kvstore.store.tiers.dram import DramTier


def test_pollers_bound_how_many_poll_at_once():
    pollers = Pollers(2, 0.0)
    assert pollers.take() and pollers.take() and not pollers.take()
    pollers.give()
    assert pollers.take()


@pytest.mark.parametrize("limit,poll_s", [(0, POLL_S), (1, -1e-6), (1, 2.0)])
def test_pollers_refuse_what_cannot_be_meant(limit, poll_s):
    with pytest.raises(ValueError):
        Pollers(limit, poll_s)


def test_a_data_server_hands_its_window_to_every_connection():
    tier = DramTier(1 << 20)
    node = StoreNode(tier, start_mover=False)
    try:
        for poll_s, want in ((None, POLL_S), (0.0, 0.0), (50e-6, 50e-6)):
            kw = {} if poll_s is None else {"poll_s": poll_s}
            server = DataServer(node, **kw)
            try:
                assert server._pollers.poll_s == want
            finally:
                server.stop()
    finally:
        node.close()
        tier.close()
