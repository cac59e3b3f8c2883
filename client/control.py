"""The client's control plane: master channels, HA failover, the shard map, routing.

Every master call of the SDK goes through :class:`Control`. A shard is served
by one or more masters (a leader and standbys): a call goes to the one that
answered last and moves on to the next on UNAVAILABLE, by one retry rule
(:class:`MasterRetry`, the asyncio SDK's too) and within the deadline of the
SDK call it is part of (:mod:`kvstore.client.deadline`). Calls about keys are
routed by each key's hash slot (:meth:`Control.routed`), and WRONG_SHARD is
handled there, once, the same way for every routed call: the keys a master
disowns (a per-key status, or a whole call) are routed again after one
refresh of the shard map from the seed masters; a second WRONG_SHARD is the
error of those keys.

The typed calls here (Lookup, Exists, Remove, List, Stat, ReportFailure)
return :mod:`kvstore.types` records, converted by :mod:`kvstore.wire`:
protobuf goes no further into the SDK. The put protocol's calls live in
:mod:`kvstore.client.puts`, on top of :meth:`Control.call` and
:meth:`Control.routed`.

Thread safety: a Control may be shared by threads. gRPC stubs are
thread-safe; the stub table is guarded by a lock; the shard map and the
last-leader table are replaced or updated whole (one assignment each).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Callable, Iterator, Sequence, TypeVar

import grpc

from kvstore import rpc, wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.deadline import Deadline, of_call
from kvstore.errors import (RETRYABLE, IndexIncomplete, InvalidArgument, KVStoreError, NodesLate,
                            NoLiveNode, NotFound, NotLeader, Unavailable, WrongShard,
                            error_for_code, from_rpc_error)
from kvstore.keys import validate_key
from kvstore.rpc import MAX_KEYS_PER_CALL, ClientCredentials
from kvstore.shardmap import ShardMap, ShardRange
from kvstore.types import NodeId, ObjectMeta, RemoveReason, ShardStatus

log = logging.getLogger(__name__)

#: Master RPC attempts on UNAVAILABLE (the only retryable error) with a one-master shard
#: (a master asking to be waited on, :func:`waits`, is not counted).
_MASTER_ATTEMPTS = 3

R = TypeVar("R")


def _as_is(err: KVStoreError) -> KVStoreError:
    return err


def retryable(err: KVStoreError) -> bool:
    """Whether a master call that failed with ``err`` is tried again: an Unavailable,
    except a master's answer that no store node is alive (:class:`NoLiveNode`)."""
    return isinstance(err, RETRYABLE) and not isinstance(err, NoLiveNode)


def next_master(addresses: tuple[str, ...], at: int, err: KVStoreError) -> int:
    """Which of a shard's masters an HA call tries after ``addresses[at]`` answered the
    retryable ``err``: the same one when it asked to be waited on (:func:`waits`), the
    leader a standby named (:attr:`NotLeader.leader`), else the next."""
    if waits(err):
        return at
    hint = err.leader if isinstance(err, NotLeader) else ""
    if hint in addresses and hint != addresses[at]:
        return addresses.index(hint)
    return (at + 1) % len(addresses)


def waits(err: KVStoreError) -> bool:
    """Whether ``err`` is a leading master's answer to wait on at the same master:
    "index incomplete" (it just started or won the election and is warming up: not
    left for a cut-off old leader and a whole RPC deadline) or "nodes late" (its
    nodes missed their heartbeats just now, and may be back any moment)."""
    return isinstance(err, (IndexIncomplete, NodesLate))


class MasterRetry:
    """The one retry rule of a master call, for both SDKs: which of a shard's masters
    the next attempt goes to, after what pause, and when the call gives up.

    Only a retryable error (:func:`retryable`) is tried again, and only while the
    call's deadline lets a new attempt start (:meth:`Deadline.may_retry`). A master
    that asks to be waited on (:func:`waits`) is asked again after a short pause.
    Otherwise, with several masters, the call moves on (:func:`next_master`),
    pausing after each round over all of them; with one, it is tried
    ``_MASTER_ATTEMPTS`` times in all, with a short backoff: a master that cannot
    be reached fails the call within a fraction of a second, as it would fail the
    next one.

    Args:
        addresses: the shard's masters.
        at: the index of the one tried first (the last that answered).
        deadline: the call's.

    Attributes:
        at: the index of the master the next attempt goes to.
    """

    def __init__(self, addresses: tuple[str, ...], at: int, deadline: Deadline):
        self.addresses = addresses
        self.at = at
        self.deadline = deadline
        self._failures = 0     # answers that were neither waited on nor the last

    def attempt_s(self, timeout_s: float) -> float:
        """The gRPC deadline of the next attempt: ``timeout_s`` cut to what the call has left.

        Raises:
            Unavailable: nothing is left.
        """
        t = self.deadline.bound(timeout_s)
        if t <= 0.0:
            raise Unavailable(f"the call's deadline passed before master "
                              f"{self.addresses[self.at]} could be asked")
        return t

    def after(self, err: KVStoreError) -> float | None:
        """The pause before the next attempt after ``err`` (:attr:`at` now names
        where it goes), or None: the call fails with ``err``."""
        if not retryable(err) or not self.deadline.may_retry():
            return None
        if waits(err):
            return self._pause(0.05)
        self._failures += 1
        if len(self.addresses) == 1:
            if self._failures >= _MASTER_ATTEMPTS:
                return None
            return self._pause(0.05 * 2 ** (self._failures - 1))
        self.at = next_master(self.addresses, self.at, err)
        return self._pause(0.1 if self._failures % len(self.addresses) == 0 else 0.0)

    def _pause(self, s: float) -> float:
        return min(s, max(0.0, self.deadline.left_s()))


def _unroutable(key) -> InvalidArgument | None:
    """Why ``key`` cannot be routed or sent to a master, or None."""
    if not isinstance(key, str):
        return InvalidArgument(f"key must be str, got {type(key).__name__}")
    try:
        key.encode()
    except UnicodeEncodeError:
        return InvalidArgument("key is not valid UTF-8 (a lone surrogate)", key=repr(key))
    return None


class Control:
    """Channels to the masters, and the routing of calls to them.

    Args:
        seeds: one shard's masters (``"a|b"`` split), asked for the shard map
            at start and whenever a master answers WRONG_SHARD.
        timeout_s: deadline of each master RPC attempt (cut to what is left of
            the SDK call's deadline).
        failover_wait_s: how long after an SDK call started it may still start
            new attempts (another master while a new leader is elected, a master
            warming up); its deadline is ``max(timeout_s, failover_wait_s)``
            (:mod:`kvstore.client.deadline`).
        creds: the token and TLS files every master call carries.

    Attributes:
        shard_map: the map calls are routed by (replaced whole on refresh).

    Raises:
        Unavailable: no seed master answers.
    """

    def __init__(self, seeds: tuple[str, ...], *, timeout_s: float, failover_wait_s: float,
                 creds: ClientCredentials | None = None):
        self.seeds = seeds
        self.creds = creds
        self.timeout_s = timeout_s
        self.failover_wait_s = failover_wait_s
        self.closed = False
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.MasterStub] = {}
        self._leader: dict[tuple[str, ...], int] = {}   # a shard's masters -> the last leader
        self._lock = threading.Lock()
        self.shard_map: ShardMap = self._fetch_shard_map()

    def check_open(self) -> None:
        """Raises: Unavailable: the client was closed."""
        if self.closed:
            raise Unavailable("this KVClient is closed")

    def close(self) -> None:
        """Close every master channel; later calls raise Unavailable."""
        self.closed = True
        with self._lock:
            for ch in self._channels.values():
                ch.close()

    # ---- calls ----
    def call(self, addresses: tuple[str, ...], method: str, request):
        """Call the master RPC ``method`` of the shard served by ``addresses``.

        Only UNAVAILABLE is retried (:data:`kvstore.errors.RETRYABLE`), by the rule
        of :class:`MasterRetry`: the call goes to the master that answered last and,
        with several, moves on to the next on UNAVAILABLE (down, not the leader)
        while a new leader is elected; with one, it is tried ``_MASTER_ATTEMPTS``
        times; a master warming up is waited on. All of it within the deadline of
        the SDK call it is part of (:mod:`kvstore.client.deadline`), or, outside
        any, a deadline of its own.

        Returns:
            The response message.

        Raises:
            KVStoreError: the call's error (Unavailable once the retries are spent
                or the deadline passed).
        """
        retry = MasterRetry(addresses, self._leader.get(addresses, 0),
                            of_call(self.timeout_s, self.failover_wait_s))
        while True:
            at = retry.at
            try:
                resp = getattr(self._stub(addresses[at]), method)(
                    request, timeout=retry.attempt_s(self.timeout_s))
                self._leader[addresses] = at
                return resp
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
            pause = retry.after(err)
            if pause is None:
                raise err from None
            if retry.at == at and len(addresses) > 1:
                self._leader[addresses] = at     # it won the election and is warming up
            time.sleep(pause)

    def _stub(self, address: str) -> pb_grpc.MasterStub:
        self.check_open()
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                ch = rpc.channel(address, self.creds)
                self._channels[address] = ch
                stub = self._stubs[address] = pb_grpc.MasterStub(ch)
            return stub

    # ---- the shard map and routing ----
    def _fetch_shard_map(self) -> ShardMap:
        return wire.shard_map(self.call(self.seeds, "GetShardMap", pb.GetShardMapRequest()))

    def refresh_shard_map(self) -> None:
        """Fetch the shard map from the seed masters again (after a WRONG_SHARD)."""
        self.shard_map = self._fetch_shard_map()

    def shard_for_key(self, key: str) -> ShardRange:
        """The shard owning ``key``'s slot in the current map."""
        return self.shard_map.shard_for_key(key)

    def _group(self, keys: Sequence[str],
               idxs: list[int]) -> list[tuple[tuple[str, ...], list[int]]]:
        """``idxs`` (of ``str`` keys) by the masters of the shard owning each key, in
        calls of at most :data:`~kvstore.rpc.MAX_KEYS_PER_CALL` keys."""
        ranges = self.shard_map.ranges
        if len(ranges) == 1:     # one shard: no per-key hashing
            groups = {ranges[0].addresses: idxs}
        else:
            groups = defaultdict(list)
            for i in idxs:
                groups[self.shard_map.shard_for_key(keys[i]).addresses].append(i)
        n = MAX_KEYS_PER_CALL
        return [(addresses, part[j:j + n]) for addresses, part in groups.items()
                for j in range(0, len(part), n)]

    def routed(self, keys: Sequence[str],
               call: Callable[[tuple[str, ...], list[str]], list[R | KVStoreError]],
               invalid: Callable[[KVStoreError], R | KVStoreError] = _as_is,
               per_key_errors: bool = True) -> list[R | KVStoreError]:
        """Run ``call(addresses, sub_keys)`` once per shard; results in input order.

        ``call`` returns one result per sub-key: a value, or the key's error.
        WRONG_SHARD, as a :class:`WrongShard` result or raised for the whole
        call, sends those keys round once more after one refresh of the shard
        map; a second WRONG_SHARD is their result. Any other error a shard's
        call raises (its masters unreachable) becomes the result of that
        shard's keys, so the other shards' keys are still answered; with
        ``per_key_errors`` False (results that cannot hold an error: exists)
        it propagates.

        A key that is not a ``str``, or not UTF-8 (a lone surrogate), cannot be
        routed nor sent: its result is ``invalid(InvalidArgument)`` and no
        master sees it (the masters check every other rule of
        :func:`kvstore.keys.validate_key`).
        """
        out: list = [_unroutable(k) for k in keys]
        todo = [i for i, r in enumerate(out) if r is None]
        for i, r in enumerate(out):
            if r is not None:
                out[i] = invalid(r)
        for attempt in range(2):
            moved: list[int] = []
            for addresses, idxs in self._group(keys, todo):
                sub_keys = [keys[i] for i in idxs]
                try:
                    results = call(addresses, sub_keys)
                except WrongShard as err:
                    results = [WrongShard(err.message, key=k, redirect=err.redirect)
                               for k in sub_keys]
                except KVStoreError as err:
                    if not per_key_errors:
                        raise
                    results = [type(err)(err.message, key=k) for k in sub_keys]
                for i, r in zip(idxs, results):
                    out[i] = r
                    if isinstance(r, WrongShard):
                        moved.append(i)
            if not moved or attempt:
                break
            log.info("WRONG_SHARD for %d key(s) on shard map v%d: refreshing it",
                     len(moved), self.shard_map.version)
            self.refresh_shard_map()
            todo = moved
        return out

    # ---- typed calls ----
    def lookup(self, keys: Sequence[str]) -> list[ObjectMeta | KVStoreError]:
        """Lookup (counts an access): per key its metadata or the error (NotFound)."""
        def call(addresses: tuple[str, ...], ks: list[str]) -> list[ObjectMeta | KVStoreError]:
            resp = self.call(addresses, "Lookup", pb.LookupRequest(keys=ks))
            return [wire.object_meta(r.meta) if r.status.code == pb.OK else
                    error_for_code(r.status.code, r.status.message, key=k,
                                   redirect=r.status.redirect)
                    for k, r in zip(ks, resp.results)]
        return self.routed(keys, call)

    def exists(self, keys: Sequence[str]) -> list[bool | KVStoreError]:
        """Exists: per key its visibility, False for a non-``str`` key, or the error
        (WrongShard when no shard owns it after the refresh)."""
        def call(addresses: tuple[str, ...], ks: list[str]) -> list[bool | KVStoreError]:
            resp = self.call(addresses, "Exists", pb.ExistsRequest(keys=ks))
            out: list[bool | KVStoreError] = list(resp.exists)
            for j, st in enumerate(resp.statuses):
                if st.code == pb.WRONG_SHARD:
                    out[j] = WrongShard(st.message, key=ks[j], redirect=st.redirect)
            return out
        return self.routed(keys, call, invalid=lambda err: False, per_key_errors=False)

    def remove(self, keys: Sequence[str], reason: RemoveReason) -> list[ObjectMeta | KVStoreError]:
        """Remove: per key the removed object (version, replicas) or the error (NotFound)."""
        def call(addresses: tuple[str, ...], ks: list[str]) -> list[ObjectMeta | KVStoreError]:
            resp = self.call(addresses, "Remove", pb.RemoveRequest(keys=ks, reason=reason.value))
            removed = list(resp.removed) or [pb.ObjectMeta(key=k) for k in ks]   # older masters
            return [wire.object_meta(m) if s.code == pb.OK else
                    error_for_code(s.code, s.message, key=k, redirect=s.redirect)
                    for k, s, m in zip(ks, resp.statuses, removed)]
        return self.routed(keys, call)

    def list(self, prefix: str, page_size: int) -> Iterator[ObjectMeta]:
        """List every shard in turn, ``page_size`` objects per call (no access counted)."""
        for r in self.shard_map.ranges:
            cursor = ""
            while True:
                resp = self.call(r.addresses, "List", pb.ListRequest(
                    prefix=prefix, start_after=cursor, limit=page_size))
                for m in resp.objects:
                    yield wire.object_meta(m)
                if not resp.next_cursor:
                    break
                cursor = resp.next_cursor

    def inspect(self, key: str) -> ObjectMeta:
        """One key's metadata through List on its shard, which counts no access.

        Raises:
            InvalidArgument: a bad key. NotFound: no such (visible) key.
        """
        validate_key(key)
        resp = self.call(self.shard_for_key(key).addresses, "List",
                         pb.ListRequest(prefix=key, limit=1))
        # A key sorts before every longer key it prefixes: if present, it comes first.
        if not resp.objects or resp.objects[0].key != key:
            raise NotFound("no such key", key=key)
        return wire.object_meta(resp.objects[0])

    def stat(self) -> list[ShardStatus]:
        """Stat of every shard, in shard map order."""
        return [wire.shard_status(self.call(r.addresses, "Stat", pb.StatRequest()))
                for r in self.shard_map.ranges]

    def answering(self, addresses: tuple[str, ...]) -> str:
        """Which of a shard's masters ``addresses`` answered its latest call (the
        first before any call): the one the next call tries first."""
        return addresses[self._leader.get(addresses, 0)]

    def report_failure(self, key: str, node_id: NodeId, reason: str) -> None:
        """Tell the shard of ``key`` that a transfer with ``node_id`` failed.

        Raises:
            KVStoreError: the report did not go through.
        """
        self.call(self.shard_for_key(key).addresses, "ReportFailure",
                  pb.ReportFailureRequest(node_ids=[node_id], reason=reason))
