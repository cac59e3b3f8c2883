"""The SDK's pure rules for time (issue 31): one deadline per call, the one retry
rule of master calls, suspect nodes, and cached entries that lose a failed replica."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvstore.client.core.failover import MASTER_ATTEMPTS as _MASTER_ATTEMPTS
from kvstore.client.core.failover import MasterRetry
from kvstore.client.deadline import Deadline, call_scope, current, of_call, unscoped_context
from kvstore.client.meta_cache import MetaCache
from kvstore.client.suspects import MAX_SUSPECT_S, Suspects, fallback_after_s
from kvstore.errors import (IndexIncomplete, NodesLate, NoLiveNode, NotFound, NotLeader,
                            Unavailable)
from kvstore.types import NodeAddress, ObjectMeta, Replica, TierKind


def test_a_deadline_ends_at_the_longer_of_the_two_and_stops_retries_at_failover_wait():
    dl = Deadline.after(timeout_s=10.0, failover_wait_s=4.0)
    assert dl.end - dl.retry_until == pytest.approx(6.0)
    assert dl.may_retry() and dl.bound(30.0) == pytest.approx(10.0, abs=0.1)
    assert dl.bound(2.0) == 2.0
    passed = Deadline(time.monotonic() - 1, time.monotonic() - 1)
    assert not passed.may_retry() and passed.bound(5.0) == 0.0 and passed.left_s() < 0


def test_calls_inside_a_call_share_its_deadline_and_background_work_has_none():
    assert current() is None
    with call_scope(1.0, 2.0):
        outer = current()
        with call_scope(50.0, 50.0):
            assert current() is outer                    # nested: the same deadline
        assert unscoped_context().run(current) is None
        assert of_call(1.0, 2.0) is outer

        async def in_a_task():
            return current()
        assert asyncio.run(in_a_task()) is outer       # tasks copy the context
    assert current() is None
    assert of_call(1.0, 2.0) is not None               # outside any call: a new one


def _unavailable(msg: str = "down") -> Unavailable:
    return Unavailable(msg)


def test_a_deadline_left_behind_long_spent_is_no_running_calls():
    from kvstore.client import deadline
    spent = time.monotonic() - 2 * deadline.STALE_AFTER_S
    token = deadline._CURRENT.set(Deadline(spent, spent))     # a scope that never reset it
    try:
        assert current() is None
        with call_scope(1.0, 2.0):
            assert current().left_s() > 0                        # a call of its own
        assert of_call(1.0, 2.0).left_s() > 0
    finally:
        deadline._CURRENT.reset(token)
    just = Deadline(time.monotonic() - 0.1, time.monotonic() - 0.1)
    token = deadline._CURRENT.set(just)                        # a call over its time: kept
    try:
        with call_scope(1.0, 2.0):
            assert current() is just
    finally:
        deadline._CURRENT.reset(token)


def test_a_scope_whose_exit_was_cut_short_is_left_by_leave():
    scope = call_scope(1.0, 2.0)
    scope.__enter__()
    assert current() is not None       # __exit__ never ran (a signal handler raised first)
    scope.leave()
    assert current() is None
    scope.leave()                      # idempotent
    assert current() is None


def test_one_master_is_tried_a_few_times_then_the_call_fails():
    retry = MasterRetry(("a:1",), {("a:1",): 0}, Deadline.after(10.0, 15.0))
    pauses = [retry.after(_unavailable()) for _ in range(_MASTER_ATTEMPTS)]
    assert pauses[:-1] == [0.05, 0.1][:_MASTER_ATTEMPTS - 1] and pauses[-1] is None
    assert MasterRetry(("a:1",), {("a:1",): 0}, Deadline.after(10.0, 15.0)).after(NotFound("x")) is None


def test_a_master_asking_to_be_waited_on_is_waited_on_until_retries_end():
    retry = MasterRetry(("a:1", "b:1"), {("a:1", "b:1"): 1}, Deadline.after(10.0, 15.0))
    for err in (IndexIncomplete("warming"), NodesLate("retry")) * 5:
        assert retry.after(err) == 0.05 and retry.at == 1
    over = MasterRetry(("a:1",), {("a:1",): 0}, Deadline(time.monotonic() - 0.1, time.monotonic() + 5))
    assert over.after(IndexIncomplete("warming")) is None      # past failover_wait_s


def test_no_live_node_is_an_answer_never_retried():
    retry = MasterRetry(("a:1", "b:1"), {("a:1", "b:1"): 0}, Deadline.after(10.0, 15.0))
    assert retry.after(NoLiveNode("no live store node")) is None


def test_several_masters_follow_the_leader_hint_and_pause_after_each_round():
    retry = MasterRetry(("a:1", "b:1", "c:1"), {("a:1", "b:1", "c:1"): 0}, Deadline.after(10.0, 15.0))
    # the text names no leader: the field does (a message is for people)
    assert retry.after(NotLeader("not the leader of shard 0", leader="c:1")) == 0.0
    assert retry.at == 2
    assert retry.after(NotLeader("not the leader of shard 0")) == 0.0 and retry.at == 0
    assert retry.after(NotLeader("not the leader of shard 0")) == 0.1   # a round over all


def test_no_attempt_starts_once_the_deadline_passed():
    retry = MasterRetry(("a:1",), {("a:1",): 0}, Deadline(time.monotonic() - 1, time.monotonic() - 0.5))
    with pytest.raises(Unavailable, match="deadline passed"):
        retry.attempt_s(10.0)


def test_suspicion_doubles_at_each_failure_in_a_row_and_ends_at_a_success():
    s = Suspects(suspect_s=5.0)
    assert [s.failed("n0") for _ in range(3)] == [5.0, 10.0, 20.0]
    assert s.suspect("n0", time.monotonic())
    assert max(s.failed("n0") for _ in range(20)) == MAX_SUSPECT_S
    s.ok("n0")
    assert not s.suspect("n0", time.monotonic()) and s.failed("n0") == 5.0


def test_a_read_with_another_replica_waits_a_fraction_of_the_read_timeout():
    assert fallback_after_s(10.0) == 2.5
    assert fallback_after_s(2.0) == 1.0 and fallback_after_s(0.5) == 0.5


def _node(node_id: str) -> NodeAddress:
    return NodeAddress(node_id=node_id, host="127.0.0.1", data_port=1)


def test_a_failed_replica_leaves_the_cached_entry_of_its_version_only():
    cache = MetaCache(10)
    meta = ObjectMeta("k", 3, 7, 42, (Replica(_node("n0"), TierKind.DRAM),
                                      Replica(_node("n1"), TierKind.DRAM)))
    cache.put(meta)
    cache.drop_replicas("k", 41, {"n0"})                # another version: untouched
    assert cache.get("k") == meta
    cache.drop_replicas("k", 42, {"n0"})
    assert [r.node.node_id for r in cache.get("k").replicas] == ["n1"]
    cache.drop_replicas("k", 42, {"n1"})                # none left: the entry goes
    assert cache.get("k") is None
