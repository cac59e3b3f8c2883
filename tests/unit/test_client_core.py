"""The client core (kvstore.client.core) without any I/O: failover actions, routing
with the one WRONG_SHARD refresh, replies decoded by name, the read plan, and the put
attempt's steps."""

from __future__ import annotations

import time

import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.core.failover import Action, MasterRetry, classify, leader_hint
from kvstore.transfer.framing import AnswerReader
from kvstore.client.core.placement import Grant, GrantedNode, GrantUse, grant_use
from kvstore.client.core.puts import (MAX_NODES_TRIED, Next, PutAttempt, Step, replica_count,
                                      settle, split_answers, waves)
from kvstore.client.core.reads import ReadPlan, read_order, report_node, stale
from kvstore.client.core.replies import Reply, exists_results, lookup_results, value_error
from kvstore.client.core.routing import Route
from kvstore.client.deadline import Deadline
from kvstore.errors import (AlreadyPresent, ChecksumMismatch, IndexIncomplete, NoLiveNode, NotLeader,
                            InvalidArgument, KeyConflict, NotFound, Unavailable, WrongShard)
from kvstore.keys import NUM_SLOTS, value_checksum
from kvstore.shardmap import ShardMap, ShardRange
from kvstore.transfer.protocol import RESPONSE, Op
from kvstore.types import NodeAddress, NodeId, ObjectMeta, Replica, TierKind


def _node(n: str, host: str = "h1") -> NodeAddress:
    return NodeAddress(NodeId(n), "127.0.0.1", 1, host_id=host)


def _dl(left_s: float = 10.0) -> Deadline:
    now = time.monotonic()
    return Deadline(now + left_s, now + left_s)


# ---- failover ----
def test_errors_are_classified_in_one_place():
    assert classify(NotFound("x")) is Action.FAIL
    assert classify(NoLiveNode("for the put")) is Action.FAIL
    assert classify(IndexIncomplete("2 nodes")) is Action.WAIT
    assert classify(NotLeader("not the leader", leader="b:1")) is Action.NEXT
    assert leader_hint(NotLeader("not the leader", leader="b:1")) == "b:1"


def test_an_attempt_loop_follows_the_named_leader_and_remembers_it():
    leaders: dict = {}
    retry = MasterRetry(("a:1", "b:1"), leaders, _dl(), timeout_s=2.0)
    attempts = iter(retry)
    first = next(attempts)
    assert first.address == "a:1" and 0 < first.timeout_s <= 2.0
    assert first.failed(NotLeader("not the leader", leader="b:1")) == 0.0
    assert next(attempts).address == "b:1"
    assert retry.answered("resp") == "resp" and leaders[("a:1", "b:1")] == 1
    with pytest.raises(NotFound):
        retry.failed(NotFound("gone"))


def test_a_spent_deadline_says_what_the_master_last_answered():
    # A call whose deadline is spent before an attempt says so; one that spent it
    # on attempts names the last answer (a log reader needs the cause, not only
    # that time ran out).
    with pytest.raises(Unavailable, match="no attempt was made"):
        MasterRetry(("a:1",), {}, _dl(-1.0)).timeout_s
    retry = MasterRetry(("a:1",), {}, _dl(0.05))
    retry.failed(IndexIncomplete("2 nodes syncing"))
    time.sleep(0.06)
    with pytest.raises(Unavailable, match="IndexIncomplete: 2 nodes syncing"):
        retry.timeout_s


# ---- routing ----
def _two_shards() -> ShardMap:
    half = NUM_SLOTS // 2
    return ShardMap(1, (ShardRange(0, half - 1, ("a:1",), 0),
                        ShardRange(half, NUM_SLOTS - 1, ("b:1",), 1)))


def test_a_route_refreshes_once_and_a_second_wrong_shard_is_the_keys_error():
    smap = _two_shards()
    keys = [f"k{i}" for i in range(40)] + [7]
    route = Route(keys)
    assert isinstance(route.out[-1], InvalidArgument)          # never sent
    calls = route.calls(smap)
    assert len(calls) == 2 and sum(len(c[1]) for c in calls) == 40
    route.answered(calls[0], [True] * len(calls[0][1]))
    route.failed(calls[1], WrongShard("moved", redirect="x"))
    assert route.wants_refresh(smap.version)
    again = route.calls(smap)
    assert [c[1] for c in again] == [calls[1][1]]
    route.failed(again[0], WrongShard("moved"))
    assert not route.wants_refresh()
    assert all(isinstance(route.out[i], WrongShard) for i in calls[1][1])


def test_a_route_without_per_key_errors_raises_a_shards_failure():
    route = Route(["k"], invalid=lambda err: False, per_key_errors=False)
    (call,) = route.calls(ShardMap.single("a:1"))
    with pytest.raises(Unavailable):
        route.failed(call, Unavailable("down"))


# ---- replies ----
def test_replies_are_read_by_name_and_decoded_once():
    ok = Reply(pb.OK, 5, 3, value_checksum(b"abc"), "", bytearray(b"abc"))
    meta = ObjectMeta("k", 3, value_checksum(b"abc"), 5, ())
    assert ok.ok and ok.error("k") is None and value_error(ok, meta) is None
    assert isinstance(value_error(Reply(pb.OK, 5, 3, 0, "", bytearray(b"abd")), meta),
                      ChecksumMismatch)
    assert isinstance(Reply(pb.NOT_FOUND, message="gone").error("k"), NotFound)
    resp = pb.LookupResponse(results=[pb.LookupResult(status=pb.Status(code=pb.WRONG_SHARD,
                                                                        redirect="r"))])
    (err,) = lookup_results(["k"], resp)
    assert isinstance(err, WrongShard) and err.key == "k" and err.redirect == "r"
    ex = pb.ExistsResponse(exists=[False], statuses=[pb.Status(code=pb.WRONG_SHARD)])
    assert isinstance(exists_results(["k"], ex)[0], WrongShard)


# ---- reads ----
def _meta(*nodes: tuple[str, str, TierKind]) -> ObjectMeta:
    return ObjectMeta("k", 10, 1, 7, tuple(Replica(_node(n, h), t) for n, h, t in nodes))


def test_replica_order_suspects_last_then_same_host_then_tier():
    meta = _meta(("a", "h2", TierKind.DRAM), ("b", "h1", TierKind.SSD),
                 ("c", "h1", TierKind.DRAM), ("d", "h1", TierKind.DRAM))
    now = time.monotonic()
    order = read_order(meta, {NodeId("d"): now + 5}, "h1", now)
    assert [r.node.node_id for r in order] == ["c", "b", "a", "d"]


def test_a_read_plan_falls_back_and_drops_the_failed_replica_from_the_entry():
    meta = _meta(("a", "h1", TierKind.DRAM), ("b", "h1", TierKind.DRAM))
    plan = ReadPlan(meta, meta.replicas)
    assert plan.has_fallback and plan.wait_s(_dl(), 1.0, 4.0) == 1.0
    plan.answered(Unavailable("hung"))
    assert not plan.done and plan.node.node_id == "b" and plan.wait_s(_dl(), 1.0, 4.0) == 4.0
    plan.answered(None)
    assert plan.done and plan.error is None and plan.stale_replicas() == {"a"}


def test_a_read_plan_ends_on_a_bad_destination_a_spent_deadline_or_no_replica():
    meta = _meta(("a", "h1", TierKind.DRAM), ("b", "h1", TierKind.DRAM))
    assert isinstance(ReadPlan(meta, meta.replicas, dest_bytes=3).error, InvalidArgument)
    plan = ReadPlan(meta, meta.replicas)
    assert plan.wait_s(_dl(-1), 1.0, 4.0) == 0.0 and plan.done
    plan = ReadPlan(meta, meta.replicas)
    plan.answered(NotFound("evicted"))
    plan.answered(NotFound("evicted"))
    assert plan.done and isinstance(plan.error, NotFound) and not plan.stale_replicas()
    assert isinstance(ReadPlan(NotFound("x")).error, NotFound)
    assert report_node(Unavailable("down"), _dl()) and not report_node(Unavailable("x"), _dl(-1))
    assert not report_node(NotFound("x"), _dl())
    assert stale([True, True, False, True], [NotFound("x"), b"v", NotFound("y"),
                                             InvalidArgument("small")]) == [0]


# ---- placement and puts ----
def test_grant_use_fetches_refreshes_or_uses():
    now = time.monotonic()
    g = Grant(1, 4097, (GrantedNode(_node("a"), 1 << 30, 1 << 20),), now, 60.0)
    assert grant_use(None, "k", now) is GrantUse.FETCH
    assert grant_use(g, "k", now) is GrantUse.USE
    assert grant_use(g, "k", now + 31) is GrantUse.REFRESH
    assert grant_use(g, "k", now + 61) is GrantUse.FETCH


def test_settle_answers_an_enum():
    a, b = _node("a"), _node("b")
    assert settle("k", [a], [(b, Unavailable("x"))]) == (True, Next.DONE)
    assert settle("k", [], [(a, AlreadyPresent("same"))]) == (False, Next.DONE)
    assert settle("k", [], [(a, NotFound("id"))])[1] is Next.REGRANT
    assert settle("k", [], [(a, Unavailable("x"))])[1] is Next.ELSEWHERE
    assert isinstance(settle("k", [], [(a, KeyConflict("other"))])[0], KeyConflict)


def test_a_put_attempt_moves_on_regrants_once_and_waits_when_every_node_failed():
    a, b = _node("a"), _node("b")
    p = PutAttempt("k")
    assert p.answered([], [(a, Unavailable("down"))], _dl()) is Step.AGAIN
    assert p.exclude == {"a"}
    assert p.answered([], [(b, NotFound("no grant"))], _dl()) is Step.REGRANT
    assert p.answered([], [(b, NotFound("no grant"))], _dl()) is Step.DONE
    p = PutAttempt("k")
    p.answered([], [(a, Unavailable("down"))], _dl())
    assert p.place_failed(Unavailable("every node failed it"), _dl()) is Step.WAIT
    p.waited()
    assert not p.exclude
    assert p.answered([a], [], _dl()) is Step.DONE and p.result is True


def test_a_put_attempt_refreshes_the_map_once_and_keeps_the_shards_answer():
    p = PutAttempt("k")
    assert p.place_failed(WrongShard("moved"), _dl()) is Step.REFRESH_MAP
    assert p.place_failed(WrongShard("moved"), _dl()) is Step.DONE
    assert isinstance(p.result, WrongShard) and p.result.key == "k"
    p = PutAttempt("k")
    assert p.place_failed(NoLiveNode("no live store node"), _dl()) is Step.DONE   # nothing tried
    p = PutAttempt("k")
    for n in range(MAX_NODES_TRIED):
        step = p.answered([], [(_node(f"n{n}"), Unavailable("down"))], _dl())
    assert step is Step.DONE
    p = PutAttempt("k")
    assert p.answered([], [(_node("a"), Unavailable("down"))], _dl(-1)) is Step.DONE


def test_puts_helpers():
    assert waves(["a", "b", "a", "a"], [0, 1, 2, 3]) == [[0, 1], [2], [3]]
    assert replica_count(None, 2) == 2
    with pytest.raises(InvalidArgument):
        replica_count(99, 1)
    a, b = _node("a"), _node("b")
    written, failures = split_answers("k", [a, b], [Reply(pb.OK), Unavailable("down")])
    assert written == [a] and failures[0][0] == b


# ---- framing ----
def _feed(reader: AnswerReader, data: bytes, piece: int = 3) -> list:
    """Hand ``data`` to ``reader`` as a transport would: at most ``piece`` bytes and
    at most what its buffer takes at a time."""
    out, at = [], 0
    while at < len(data):
        buf = reader.buffer()
        n = min(piece, len(buf), len(data) - at)
        buf[:n] = data[at:at + n]
        at += n
        out += reader.received(n)
    return out


def test_answers_are_decoded_in_request_order_however_they_are_split():
    reader = AnswerReader()
    into = memoryview(bytearray(8))
    reader.expect("ping", Op.PING, 0, None)
    reader.expect("get", Op.GET, 16, None)
    reader.expect("into", Op.GET, 0, into)
    data = (RESPONSE.pack(pb.OK, 0, 0, 0, 7, 0, 0, 0, 0)
            + RESPONSE.pack(pb.OK, 0, 0, 0, 9, 5, 42, 0, 0) + b"hello"
            + RESPONSE.pack(pb.NOT_FOUND, 0, 4, 0, 0, 0, 0, 0, 0) + b"gone")
    got = dict(_feed(reader, data))
    assert got["ping"].ok and got["get"].value == bytearray(b"hello")
    assert got["get"].object_id == 9 and got["get"].checksum == 42
    assert isinstance(got["into"].error("k"), NotFound) and got["into"].message == "gone"
    assert not reader.pending and reader.malformed is None


def test_what_no_node_sends_is_malformed_and_answers_before_it_still_arrive():
    reader = AnswerReader()
    reader.expect("a", Op.GET, 4, None)
    assert _feed(reader, RESPONSE.pack(pb.OK, 0, 0, 0, 1, 99, 0, 0, 0), 64) == []
    assert "at most 4 B" in str(reader.malformed)
    reader = AnswerReader()
    reader.expect("a", Op.PING, 0, None)
    ok = RESPONSE.pack(pb.OK, 0, 0, 0, 0, 0, 0, 0, 0)
    assert [t for t, _r in _feed(reader, ok + ok, 64)] == ["a"]
    assert "not sent" in str(reader.malformed)


def test_a_sync_header_becomes_a_reply():
    reply = Reply.of_header((pb.NO_SPACE, 3, 10, 7, 0, "full"))
    assert reply.object_id == 3 and reply.error("k").message == "full"
