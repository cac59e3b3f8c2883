"""A node whose master is unreachable says so once, then every OUTAGE_LOG_S, then
that it is back: not a line per retry (about 50 a second)."""

from __future__ import annotations

import logging

from kvstore.store.agent import OUTAGE_LOG_S, _Outage


def test_an_outage_is_logged_once_then_periodically_then_its_end(caplog):
    caplog.set_level(logging.WARNING, logger="kvstore.store.agent")
    outage = _Outage("127.0.0.1:50051")
    for _ in range(200):                       # four seconds of retries
        outage.failed("UNAVAILABLE")
    assert [r.getMessage() for r in caplog.records] == [
        "master 127.0.0.1:50051: UNAVAILABLE; retrying"]
    outage.logged -= OUTAGE_LOG_S              # as if the period went by
    outage.failed("UNAVAILABLE")
    assert "still UNAVAILABLE" in caplog.records[-1].getMessage()
    assert "(201 attempts)" in caplog.records[-1].getMessage()
    outage.ended()
    assert "reachable again" in caplog.records[-1].getMessage()
    outage.ended()                             # nothing more while it stays up
    assert len(caplog.records) == 3
    outage.failed("UNAVAILABLE")               # a new outage starts over
    assert caplog.records[-1].getMessage().endswith("UNAVAILABLE; retrying")
