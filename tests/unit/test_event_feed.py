"""The master's store-wide event log: sequences, the ring, resumes, epochs, following."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.errors import EventsLost, InvalidArgument
from kvstore.master.event_feed import EventFeed, StoreEventKind as K, check_prefixes


def feed_of(n: int, capacity: int = 8) -> EventFeed:
    feed = EventFeed(epoch=7, capacity=capacity, wall_ms=lambda: 1000)
    for i in range(n):
        feed.record(K.KEY_STORED, f"k{i}", i + 1, 10)
    return feed


def test_sequences_start_at_one_without_gaps():
    feed = feed_of(5)
    batch = feed.read(1)
    assert [e.seq for e in batch.events] == [1, 2, 3, 4, 5]
    assert batch.next_seq == 6 and batch.first_seq == 1
    assert batch.events[0].time_ms == 1000 and batch.events[0].kind is K.KEY_STORED


def test_the_ring_keeps_the_last_capacity_events_and_says_when_a_seq_is_gone():
    feed = feed_of(20, capacity=8)
    assert feed.first_seq == 13
    assert [e.seq for e in feed.read(13).events] == list(range(13, 21))
    with pytest.raises(EventsLost, match="no longer in the event log"):
        feed.read(12)
    with pytest.raises(EventsLost):
        feed.start(from_seq=5)
    assert feed.start(oldest=True) == 13
    assert feed.start() == 21                       # only what comes next
    assert feed.start(from_seq=21, epoch=7) == 21   # a resume at the head


def test_another_epoch_or_a_seq_past_the_end_is_refused():
    feed = feed_of(3)
    with pytest.raises(EventsLost, match="epoch 7, not 6"):
        feed.start(from_seq=2, epoch=6)
    with pytest.raises(EventsLost, match="past the end"):
        feed.start(from_seq=9)


def test_an_empty_log_says_it_holds_nothing_yet():
    with pytest.raises(EventsLost, match=r"holds no event yet \(the next is seq 1\)"):
        feed_of(0).start(from_seq=1, epoch=6)


def test_a_filter_skips_events_but_the_resume_point_moves_past_them():
    feed = EventFeed(epoch=1, capacity=16)
    for key in ("a/1", "b/1", "a/2", "c/1"):
        feed.record(K.KEY_REMOVED, key, 1, 1)
    batch = feed.read(1, ("a/",))
    assert [e.key for e in batch.events] == ["a/1", "a/2"] and batch.next_seq == 5
    assert check_prefixes(["a/", ""]) == ()         # "" matches every key
    with pytest.raises(InvalidArgument):
        check_prefixes(["x"] * 65)


def test_follow_replays_then_follows_live_and_sends_keepalives():
    async def run():
        feed = feed_of(3)
        got = []

        async def watch():
            async for batch in feed.follow(2, keepalive_s=0.05):
                got.append(batch)
                if sum(len(b.events) for b in got) >= 4:
                    return

        task = asyncio.create_task(watch())
        await asyncio.sleep(0.2)                       # a keepalive or more, nothing new
        feed.record(K.KEY_EVICTED, "k9", 9, 10, "node-1")
        feed.record(K.KEY_REMOVED, "k10", 10, 10)
        await asyncio.wait_for(task, 5)
        seqs = [e.seq for b in got for e in b.events]
        assert seqs == [2, 3, 4, 5]
        assert any(not b.events and b.next_seq == 4 for b in got)   # a keepalive at the head
        events = [e for b in got for e in b.events]
        assert [e.node_id for e in events[2:]] == ["node-1", ""]

    asyncio.run(run())


def test_a_subscriber_a_whole_ring_behind_is_told():
    feed = feed_of(4, capacity=4)
    for i in range(10):
        feed.record(K.KEY_STORED, f"n{i}", i, 1)
    with pytest.raises(EventsLost):
        feed.read(3)


def test_a_stop_reaches_a_watch_that_was_not_waiting_yet():
    """stop() between a watch's read and its wait (a lost wake-up: the watch slept its
    keep-alive out, past a stopping master's drain grace): it gets a batch at once."""
    async def run():
        feed = feed_of(2)
        follow = feed.follow(3, keepalive_s=30.0)
        task = asyncio.ensure_future(follow.__anext__())
        feed.stop()                                   # before the watch's first wait
        batch = await asyncio.wait_for(task, 1.0)
        assert batch.events == () and batch.next_seq == 3
        assert not await feed.wait(3, 30.0)           # and no wait after it
    asyncio.run(run())
