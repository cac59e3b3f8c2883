"""The node's lease on serving (kvstore.store.lease): it ends before its master may
declare the node dead, per shard."""

from __future__ import annotations

import time

import pytest

from kvstore.client.core.failover import leader_hint as _leader_hint
from kvstore.errors import Unavailable
from kvstore.store.lease import MARGIN, MasterLease


def test_never_granted_refuses():
    lease = MasterLease()
    with pytest.raises(Unavailable, match="fenced"):
        lease.check("k")
    assert not lease.held_all()


def test_lease_runs_from_the_send_time_and_ends_before_the_ttl():
    lease = MasterLease()
    sent = time.monotonic()
    lease.renew(0, sent, ttl_ms=400)
    lease.check("k")
    assert lease.held_all()
    time.sleep(0.4 * (1 - MARGIN) + 0.02)         # past sent + ttl - margin
    with pytest.raises(Unavailable, match="fenced"):
        lease.check("k")


def test_an_older_acknowledgement_never_shortens_the_lease():
    lease = MasterLease()
    now = time.monotonic()
    lease.renew(0, now, ttl_ms=10_000)
    lease.renew(0, now - 9.9, ttl_ms=10_000)     # a late reply to an old heartbeat
    lease.check("k")


def test_per_shard_leases():
    lease = MasterLease()
    lease.reset(2)
    lease.shard_of = lambda key: 0 if key.startswith("a") else 1
    lease.renew(0, time.monotonic(), ttl_ms=10_000)
    lease.check("a-key")
    with pytest.raises(Unavailable):
        lease.check("b-key")
    assert lease.held(0) and not lease.held(1) and not lease.held_all()


def test_leader_hint_parsing():
    assert _leader_hint("not the leader of shard 0 (leader: 10.0.0.1:7001)") == "10.0.0.1:7001"
    assert _leader_hint("not the leader of shard 0") == ""
