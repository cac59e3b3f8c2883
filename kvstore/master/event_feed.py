"""A master shard's store-wide event log: what routers and engines learn of keys.

Node events (STORED, EVICTED, DEMOTED, ...) say what one node holds; the log
says what the *store* holds, one event per key that became readable or went
away, in the order the shard applied them::

    KEY_STORED    a new key is readable (its first replica's STORED applied)
    KEY_EVICTED   the store gave it up: its last replica evicted, or an admin evict
    KEY_REMOVED   a client removed it

Each event gets the next sequence number of the log, 1, 2, 3, ... with no gap.
The log keeps the last ``capacity`` events in a ring (fixed memory: about
``capacity`` x (210 B + the key): 29 MB for 100 000 events of 32-character
keys, measured); a subscriber replays from any sequence still
in the ring, then follows live (:meth:`EventFeed.follow`), and resumes after a
disconnect from the last ``next_seq`` it saw: at least once, in order, no gap.

Epochs: the log lives in the leader's memory, so a new term of the shard (a
master restart, a failover to a standby) starts a new log at seq 1 under a
larger ``epoch`` (the etcd revision of the win; without etcd, the start time
in unix ms). A resume that names another epoch, or a sequence older than the
ring, is refused with :class:`~kvstore.errors.EventsLost`, never answered
with silence: the subscriber knows it missed events and resyncs.

Not in the log: keys lost with a node (a node forgotten after its
``--node-forget-ms``, or one that re-registered without them): a node's death
is not an event of each of its keys; a reader finds them missing.

Thread safety: owned by the master's event loop, like the index it follows.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, NamedTuple, Sequence

from kvstore.errors import EventsLost, InvalidArgument
from kvstore.keys import MAX_KEY_BYTES

#: Events a log keeps by default (``kvstore master --event-log``).
DEFAULT_CAPACITY = 100_000
#: Events in one response of a stream at most.
MAX_BATCH = 512
#: Key prefixes one watch may filter on at most.
MAX_PREFIXES = 64
#: An empty response this often while nothing happens (the subscriber sees the
#: stream alive, and its resume point moves past events its filter skipped).
KEEPALIVE_S = 5.0


class StoreEventKind(enum.IntEnum):
    """What happened to a key (the wire's ``StoreEventKind``)."""

    KEY_STORED = 1
    KEY_EVICTED = 2
    KEY_REMOVED = 3


class StoreEvent(NamedTuple):
    """One entry of the log. The ring holds plain tuples of these fields, made into
    StoreEvents only when read: one is recorded per put on the master's event loop,
    where a frozen dataclass cost 2.5 us and a plain tuple costs about 0.1."""

    seq: int
    kind: StoreEventKind
    key: str
    object_id: int        # the version
    size_bytes: int
    time_ms: int          # unix ms, when the shard applied it
    node_id: str = ""     # STORED: the holder; EVICTED by node pressure: the evicting node


@dataclass(frozen=True, slots=True)
class Batch:
    """What a watch gets at once: ``events`` (maybe none), and where to resume."""

    events: tuple[StoreEvent, ...]
    next_seq: int
    first_seq: int        # the oldest event the log holds now


class EventFeed:
    """The event log of one term of a shard.

    Args:
        epoch: names this log (see the module doc); larger for a later term.
        capacity: events kept for replay (the ring), at least 1.
        wall_ms: the clock events are dated by (unix ms; None: the system's).

    The ring, with ``first_seq`` the oldest event held::

        seq:   first_seq ................ next_seq - 1 | next_seq (the next event)
        slot:  seq % capacity
    """

    def __init__(self, epoch: int, capacity: int = DEFAULT_CAPACITY,
                 wall_ms: Callable[[], int] | None = None):
        if capacity < 1:
            raise InvalidArgument(f"the event log needs a capacity of 1 or more, got {capacity}")
        self.epoch = epoch
        self.capacity = capacity
        self._wall_ms = wall_ms           # None: the system's wall clock (the fast path)
        self._ring: list[tuple | None] = [None] * capacity
        self.next_seq = 1
        self._grew = asyncio.Event()      # set (and replaced) on an event, when watched
        self._waiting = 0                 # watches waiting on it
        self.stopped = False              # stop() was called: no watch waits again

    @property
    def first_seq(self) -> int:
        """The oldest sequence the ring holds (``next_seq`` when it is empty)."""
        return max(1, self.next_seq - self.capacity)

    def record(self, kind: StoreEventKind, key: str, object_id: int, size_bytes: int,
               node_id: str = "") -> None:
        """Append an event (the index calls it as it applies a change)."""
        seq = self.next_seq
        self._ring[seq % self.capacity] = (seq, kind, key, object_id, size_bytes,
                                           time.time_ns() // 1_000_000 if self._wall_ms is None
                                           else self._wall_ms(), node_id)
        self.next_seq = seq + 1
        if self._waiting:
            self.wake()

    def stop(self) -> None:
        """The master is stopping: wake every waiting watch, and let none wait again (a
        watch between two waits at this moment would otherwise miss the wake-up and
        sleep its keep-alive out)."""
        self.stopped = True
        self.wake()

    def wake(self) -> None:
        """Wake every waiting watch (an event, or the master stopping: each gets a batch)."""
        grew, self._grew = self._grew, asyncio.Event()
        grew.set()

    def start(self, from_seq: int = 0, epoch: int = 0, oldest: bool = False) -> int:
        """Where a watch starts: ``from_seq`` (a resume), the oldest event held
        (``oldest``), or the next event (neither).

        Raises:
            EventsLost: ``epoch`` is not 0 and not this log's, or ``from_seq`` is
                older than the ring or later than the next event.
        """
        if epoch and epoch != self.epoch:
            raise EventsLost(f"the event log is of epoch {self.epoch}, not {epoch} (the shard's "
                             f"master restarted or changed): events may have been missed; "
                             f"it holds {self._held()}")
        if oldest and not from_seq:
            return self.first_seq
        if not from_seq:
            return self.next_seq
        self._check(from_seq)
        return from_seq

    def _held(self) -> str:
        """The sequences the ring holds, in words."""
        if self.next_seq <= self.first_seq:
            return f"no event yet (the next is seq {self.next_seq})"
        return f"seq {self.first_seq}..{self.next_seq - 1}"

    def _check(self, seq: int) -> None:
        if seq < self.first_seq:
            raise EventsLost(f"seq {seq} is no longer in the event log of epoch {self.epoch}: "
                             f"it holds {self._held()} (the last "
                             f"{self.capacity}; kvstore master --event-log)")
        if seq > self.next_seq:
            raise EventsLost(f"seq {seq} is past the end of the event log of epoch {self.epoch} "
                             f"(next is {self.next_seq}): a resume from another log?")

    def read(self, from_seq: int, prefixes: Sequence[str] = (),
             limit: int = MAX_BATCH) -> Batch:
        """The events from ``from_seq`` on, at most ``limit`` of them before filtering,
        those whose key starts with one of ``prefixes`` (none: all).

        Raises:
            EventsLost: ``from_seq`` is no longer held (the ring went past it).
        """
        self._check(from_seq)
        end = min(self.next_seq, from_seq + limit)
        ring, cap = self._ring, self.capacity
        make = StoreEvent._make
        events = [make(ring[s % cap]) for s in range(from_seq, end)]
        if prefixes:
            events = [e for e in events if e.key.startswith(tuple(prefixes))]
        return Batch(tuple(events), end, self.first_seq)

    async def wait(self, seq: int, timeout_s: float) -> bool:
        """Wait until event ``seq`` exists, at most ``timeout_s``; returns whether it does."""
        if seq < self.next_seq:
            return True
        if self.stopped:
            return False
        self._waiting += 1
        try:
            await asyncio.wait_for(self._grew.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiting -= 1
        return seq < self.next_seq

    async def follow(self, from_seq: int, prefixes: Sequence[str] = (),
                     keepalive_s: float = KEEPALIVE_S) -> AsyncIterator[Batch]:
        """Batches from ``from_seq`` on, forever: events as they come, an empty batch
        after ``keepalive_s`` of quiet (the caller stops iterating to end).

        Raises:
            EventsLost: the subscriber fell a whole ring behind (it read too slowly).
        """
        seq = from_seq
        while True:
            batch = self.read(seq, prefixes)
            seq = batch.next_seq
            if batch.events:
                yield batch
                continue
            if not await self.wait(seq, keepalive_s):
                yield batch


def check_prefixes(prefixes: Sequence[str]) -> tuple[str, ...]:
    """A watch's key prefixes, bounded (they come off the wire).

    Raises:
        InvalidArgument: more than MAX_PREFIXES, or one longer than a key.
    """
    if len(prefixes) > MAX_PREFIXES:
        raise InvalidArgument(f"{len(prefixes)} key prefixes; at most {MAX_PREFIXES}")
    for p in prefixes:
        if len(p.encode()) > MAX_KEY_BYTES:
            raise InvalidArgument(f"a key prefix of {len(p.encode())} B; keys have at most "
                                  f"{MAX_KEY_BYTES} B")
    return () if "" in prefixes else tuple(prefixes)     # "" matches every key
