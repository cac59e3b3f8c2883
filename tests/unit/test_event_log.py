"""The node's event log: ordered tickets, delivery by the waiting writer, timeouts."""

from __future__ import annotations

import threading

from kvstore.errors import NotFound
from kvstore.store.events import EventLog
from kvstore.types import EventKind, NodeEvent


def ev(i: int, kind: EventKind = EventKind.STORED) -> NodeEvent:
    return NodeEvent(kind, f"k{i}", i)


def test_events_are_taken_in_order_and_subscribers_woken():
    log = EventLog()
    ready = log.subscribe()
    assert not ready.is_set()
    tickets = [log.append(ev(i)) for i in range(3)]
    assert ready.is_set()
    assert [t.event.key for t in log.take()] == ["k0", "k1", "k2"]
    assert log.take() == [] and not any(t.done for t in tickets)


def test_without_a_delivery_a_wait_resolves_at_once():
    log = EventLog()
    t = log.append(ev(1))
    assert log.wait([t], 1.0) and t.done and t.error is None


def test_the_waiting_writer_delivers_and_concurrent_writers_share_a_report():
    log = EventLog()
    reports: list[list[str]] = []
    lock = threading.Lock()

    asked: list[tuple[list[str], float]] = []

    def deliver(tickets, timeout_s: float) -> None:
        asked.append(([t.event.key for t in tickets], timeout_s))
        with lock:                           # an agent delivers one report at a time
            batch = log.take()
            if batch:
                reports.append([t.event.key for t in batch])
                log.resolve((t, NotFound("revoked") if t.event.key == "k2" else None)
                            for t in batch)

    log.set_delivery(deliver)
    tickets = [log.append(ev(i)) for i in range(4)]
    assert log.wait(tickets[:1], 1.0)
    assert reports == [["k0", "k1", "k2", "k3"]]     # one report for everything pending
    assert asked[0][0] == ["k0"] and 0 < asked[0][1] <= 1.0   # what it waits for, bounded
    assert log.wait(tickets, 1.0)
    assert isinstance(tickets[2].error, NotFound) and tickets[3].error is None


def test_a_delivery_that_keeps_failing_times_out_and_keeps_the_ticket_open():
    log = EventLog()
    calls = []
    log.set_delivery(lambda tickets, timeout_s: calls.append(timeout_s))   # never answers
    t = log.append(ev(1))
    assert log.wait([t], 0.2) is False
    assert not t.done and len(calls) >= 2           # retried while waiting
