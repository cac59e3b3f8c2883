"""Follow the store-wide event log of every master shard (WatchEvents).

Each shard keeps its own log (:mod:`kvstore.master.event_feed`): a key stored,
evicted or removed, numbered 1, 2, 3, ... per shard and epoch. An
:class:`EventWatcher` holds one stream per shard, each on a thread of its own;
a stream that breaks (a master restarting, a failover, a network cut) is
opened again from the last ``next_seq`` the shard sent, so the events come at
least once, in order, with no gap; the caller drops a repeat by its
``(shard_id, epoch, seq)``::

    with EventWatcher("127.0.0.1:50051", token=...) as w:
        for ev in w:                       # WatchedEvent, or a Lost marker
            ...

When a shard cannot give what was asked (the sequence left its ring, or the
shard's log is of a new epoch after a master restart) the watcher yields a
:class:`Lost` (``resume_after_loss``: then goes on from the oldest event the
new log holds) or raises :class:`~kvstore.errors.EventsLost`.

Needs a ``metrics`` or ``admin`` token on a cluster started with ``--auth``.

Thread safety: iterate from one thread; :meth:`EventWatcher.close` from any.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import grpc

from kvstore import rpc, wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import (EventsLost, Internal, InvalidArgument, KVStoreError, NotLeader,
                            PermissionDenied, Unauthenticated, Unavailable, from_rpc_error)
from kvstore.rpc import ClientCredentials
from kvstore.shardmap import ShardRange

log = logging.getLogger(__name__)

#: The names of the wire's StoreEventKind, as a watcher reports them.
KINDS = {pb.KEY_STORED: "STORED", pb.KEY_EVICTED: "EVICTED", pb.KEY_REMOVED: "REMOVED"}
#: Errors after which a shard's stream is not opened again.
_FINAL = (Unauthenticated, PermissionDenied, InvalidArgument)


@dataclass(frozen=True, slots=True)
class WatchedEvent:
    """One event of one shard's log."""

    shard_id: int
    epoch: int
    seq: int
    kind: str             # STORED, EVICTED, REMOVED
    key: str
    object_id: int
    size_bytes: int
    time_ms: int          # unix ms
    node_id: str = ""


@dataclass(frozen=True, slots=True)
class Lost:
    """Events of ``shard_id`` were missed (``reason``); the watch goes on from
    ``epoch``/``next_seq`` (the oldest event the shard still holds)."""

    shard_id: int
    reason: str
    epoch: int = 0
    next_seq: int = 0


@dataclass(slots=True)
class Cursor:
    """Where a shard's watch resumes: the epoch and the next sequence wanted."""

    epoch: int = 0
    next_seq: int = 0


def check_start(start: dict[int, Cursor], from_seq: int, key_prefixes: Sequence[str]) -> None:
    """Refuse what the wire cannot carry: an epoch or sequence outside [0, 2**64), a
    key prefix that is not UTF-8 text (what :class:`EventWatcher` checks before any call).

    Raises:
        InvalidArgument: naming the value.
    """
    values = [(from_seq, "from_seq")]
    for shard, c in start.items():
        values += [(c.epoch, f"shard {shard}'s epoch"), (c.next_seq, f"shard {shard}'s next_seq")]
    for value, what in values:
        if not 0 <= value <= wire.U64_MAX:
            raise InvalidArgument(f"{what} {value} is not in [0, 2**64)")
    for p in key_prefixes:
        try:
            p.encode("utf-8")
        except (AttributeError, UnicodeEncodeError):
            raise InvalidArgument(f"key prefix {p!r} is not text (a str of UTF-8 "
                                  f"characters)") from None


class EventWatcher:
    """Follows the event logs of every shard of a cluster.

    Args:
        master: any master's address (``"a|b"``: a shard's masters).
        creds: a ``metrics`` or ``admin`` token, and TLS files.
        start: per shard id, where to start (``Cursor(epoch, seq)``; epoch 0: the
            current log's). A shard not listed starts at ``from_seq``, else at its
            oldest retained event with ``oldest``, else at its next one.
        from_seq: where shards not in ``start`` start (0: see ``oldest``).
        oldest: start shards not in ``start`` at the oldest event they hold.
        key_prefixes: only keys starting with one of these (none: every key).
        resume_after_loss: on lost events yield :class:`Lost` and go on (else raise).
        timeout_s: deadline of the shard-map call and of opening each stream.

    Raises:
        Unavailable: no master answers for the shard map.
        InvalidArgument: a sequence or epoch outside [0, 2**64), a prefix that is
            not text (UTF-8), a shard id in ``start`` that the cluster has not.
    """

    def __init__(self, master: str, *, creds: ClientCredentials | None = None,
                 start: dict[int, Cursor] | None = None, from_seq: int = 0,
                 oldest: bool = False,
                 key_prefixes: Sequence[str] = (), resume_after_loss: bool = False,
                 timeout_s: float = 5.0):
        check_start(start or {}, from_seq, key_prefixes)
        self.creds = creds or ClientCredentials.resolve()
        self.key_prefixes = tuple(key_prefixes)
        self.resume_after_loss = resume_after_loss
        self.timeout_s = timeout_s
        self._queue: queue.Queue = queue.Queue(maxsize=4096)
        self._closed = threading.Event()
        self._calls: dict[int, grpc.Future] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()
        shard_map = wire.shard_map(self._shard_map(tuple(master.split("|"))))
        unknown = sorted(set(start or {}) - {r.shard_id for r in shard_map.ranges})
        if unknown:
            self._close_channels()
            have = ", ".join(str(r.shard_id) for r in shard_map.ranges)
            raise InvalidArgument(f"no shard {', '.join(map(str, unknown))} in this cluster "
                                  f"(its shards: {have})")
        self.cursors: dict[int, Cursor] = {}
        self._opened: set[int] = set()        # shards whose stream sent its header
        self._opened_cv = threading.Condition()
        self._threads = []
        for r in shard_map.ranges:
            cursor = (start or {}).get(r.shard_id, Cursor(0, from_seq))
            self.cursors[r.shard_id] = Cursor(cursor.epoch, cursor.next_seq)
            t = threading.Thread(target=self._follow, args=(r, oldest and not from_seq and
                                                            r.shard_id not in (start or {})),
                                 name=f"kvstore-events-{r.shard_id}", daemon=True)
            self._threads.append(t)
            t.start()

    def _stub(self, address: str) -> pb_grpc.MasterStub:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._channels[address] = rpc.channel(address, self.creds)
            return pb_grpc.MasterStub(ch)

    def _shard_map(self, seeds: tuple[str, ...]) -> pb.ShardMap:
        err: KVStoreError = Unavailable("no master address")
        for address in seeds:
            try:
                return self._stub(address).GetShardMap(pb.GetShardMapRequest(),
                                                       timeout=self.timeout_s)
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
        raise err

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Wait until every shard's stream is open (its header came).

        Raises:
            Unavailable: some shard's stream did not open within ``timeout_s``.
        """
        with self._opened_cv:
            if not self._opened_cv.wait_for(lambda: len(self._opened) == len(self.cursors),
                                            timeout_s):
                missing = sorted(set(self.cursors) - self._opened)
                raise Unavailable(f"the event streams of shard(s) {missing} did not open "
                                  f"within {timeout_s} s")

    def _follow(self, shard: ShardRange, oldest: bool) -> None:
        """One shard's stream, opened again after each break until closed."""
        addresses, at, pause = list(shard.addresses), 0, 0.1
        cursor = self.cursors[shard.shard_id]
        first = True
        while not self._closed.is_set():
            req = pb.WatchEventsRequest(from_seq=cursor.next_seq, epoch=cursor.epoch,
                                        oldest=oldest and not cursor.next_seq,
                                        key_prefixes=self.key_prefixes)
            try:
                call = self._stub(addresses[at % len(addresses)]).WatchEvents(req)
                with self._lock:
                    self._calls[shard.shard_id] = call
                if self._closed.is_set():
                    call.cancel()
                for resp in call:
                    pause = 0.1
                    cursor.epoch, cursor.next_seq = resp.epoch, resp.next_seq
                    if first:
                        first = False
                        with self._opened_cv:
                            self._opened.add(shard.shard_id)
                            self._opened_cv.notify_all()
                    for e in resp.events:
                        self._put(WatchedEvent(resp.shard_id, resp.epoch, e.seq,
                                               KINDS.get(e.kind, str(e.kind)), e.key, e.object_id,
                                               e.size_bytes, e.time_ms, e.node_id))
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                err = from_rpc_error(exc)
                if isinstance(err, EventsLost):
                    if not self.resume_after_loss:
                        self._put(err)
                        return
                    self._put(Lost(shard.shard_id, err.message))
                    cursor.epoch, cursor.next_seq, oldest = 0, 0, True
                    continue
                if isinstance(err, _FINAL):
                    self._put(err)
                    return
                if isinstance(err, NotLeader) and err.leader in addresses:
                    at = addresses.index(err.leader)
                else:
                    at += 1
                log.info("event stream of shard %d broke (%s); reopening from seq %d",
                         shard.shard_id, err, cursor.next_seq)
            except Exception as exc:      # a bug: the reader hears of it, never waits for ever
                self._put(Internal(f"shard {shard.shard_id}'s event stream failed: {exc!r}"))
                return
            self._closed.wait(pause)
            pause = min(2.0, pause * 2)

    def _put(self, item) -> None:
        while not self._closed.is_set():
            try:
                self._queue.put(item, timeout=0.2)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[WatchedEvent | Lost]:
        return self.events()

    def events(self, timeout_s: float | None = None) -> Iterator[WatchedEvent | Lost]:
        """Events of every shard as they come (each shard's in its order).

        Args:
            timeout_s: stop after this long without an event (None: never).

        Raises:
            EventsLost: a shard lost events (without ``resume_after_loss``).
            Unauthenticated, PermissionDenied: the token may not watch.
            InvalidArgument: ``timeout_s`` below 0 (or NaN).
        """
        if timeout_s is not None and not timeout_s >= 0:
            raise InvalidArgument(f"timeout_s must be >= 0 or None, got {timeout_s}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._closed.is_set():
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=max(0.0, wait))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return
                continue
            if isinstance(item, KVStoreError):
                raise item
            yield item
            if timeout_s is not None:
                deadline = time.monotonic() + timeout_s

    def close(self) -> None:
        """End every stream; iteration stops."""
        self._closed.set()
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call.cancel()
        for t in self._threads:
            t.join(timeout=5)
        self._close_channels()

    def _close_channels(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    def __enter__(self) -> "EventWatcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
