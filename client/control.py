"""The client's control plane: master channels, HA failover, the shard map, routing.

Every master call of the sync SDK goes through :class:`Control`, the blocking
driver of the client core's rules: a shard's masters are tried by the one
retry rule (:class:`kvstore.client.core.failover.MasterRetry`) within the
deadline of the SDK call (:mod:`kvstore.client.deadline`); calls about keys
are routed by :class:`kvstore.client.core.routing.Route` (by hash slot, with
the one WRONG_SHARD refresh of the shard map).

The typed calls here (Lookup, Exists, Remove, List, Stat, ReportFailure)
return :mod:`kvstore.types` records, decoded by :mod:`kvstore.client.core.replies`:
protobuf goes no further into the SDK. The put protocol's calls live in
:mod:`kvstore.client.puts`, on top of :meth:`Control.call` and
:meth:`Control.routed`.

Lookup, Exists and GrantPlacement go to a master's socket port once one of
its gRPC answers named it (:mod:`kvstore.transfer.call_link`: a single-key
Lookup costs the master 55-90 us of CPU there, 250-390 through gRPC).

Thread safety: a Control may be shared by threads. gRPC stubs are
thread-safe; the stub table (:class:`~kvstore.client.stubs.MasterStubs`) takes a lock; the shard map and the
last-leader table are replaced or updated whole (one assignment each). A
master's link serves one call at a time: a thread that finds it busy calls
through gRPC.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, Sequence

import grpc

from kvstore import rpc, wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.core import replies
from kvstore.client.core.failover import MasterRetry
from kvstore.client.core.routing import Route
from kvstore.client.deadline import of_call
from kvstore.client.forks import in_forked_child
from kvstore.client.stubs import MasterStubs
from kvstore.errors import KVStoreError, NotFound, Unavailable, from_rpc_error
from kvstore.keys import validate_key
from kvstore.rpc import ClientCredentials
from kvstore.shardmap import ShardMap, ShardRange
from kvstore.transfer.call_link import CALL_METHODS, CallLink, port_retry
from kvstore.transfer.report_link import LinkBroken
from kvstore.types import NodeId, ObjectMeta, RemoveReason, ShardStatus, TenantStatus

log = logging.getLogger(__name__)


def sum_tenants(per_shard: list[list[TenantStatus]]) -> list[TenantStatus]:
    """Each tenant's figures summed over the shards (its limits: the shards' parts added
    up), by name."""
    out: dict[str, TenantStatus] = {}
    for shard in per_shard:
        for t in shard:
            was = out.get(t.tenant)
            if was is None:
                out[t.tenant] = t
                continue
            counters = dict(was.counters)
            for k, v in t.counters.items():
                counters[k] = counters.get(k, 0) + v
            out[t.tenant] = TenantStatus(t.tenant, was.objects + t.objects, was.bytes + t.bytes,
                                         was.max_objects + t.max_objects,
                                         was.max_bytes + t.max_bytes, counters)
    return [out[k] for k in sorted(out)]


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
        self._stubs = MasterStubs(self.creds, rpc.channel)
        self._leader: dict[tuple[str, ...], int] = {}   # a shard's masters -> the last leader
        #: A master's address -> the link to its socket port (kvstore.transfer.call_link),
        #: once one of its answers named the port.
        self._links: dict[str, CallLink] = {}
        self._port_failed: dict[str, float] = {}   # address -> monotonic s of its link's failure
        in_forked_child(self.forked)
        self.call_port = True     # Lookup, Exists, GrantPlacement on the port once named
        self.shard_map: ShardMap = self._fetch_shard_map()

    def check_open(self) -> None:
        """Raises: Unavailable: the client was closed."""
        if self.closed:
            raise Unavailable("this KVClient is closed")

    def close(self) -> None:
        """Close every master channel; later calls raise Unavailable."""
        self.closed = True
        for ch in self._stubs.take_channels():
            ch.close()
        for link in list(self._links.values()):
            link.close()

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
        self.check_open()
        dl = of_call(self.timeout_s, self.failover_wait_s)
        on_port = method in CALL_METHODS and self.call_port
        for attempt in MasterRetry(addresses, self._leader, dl, self.timeout_s):
            link = self._links.get(attempt.address) if on_port else None
            if link is not None:
                response, err = self._on_link(link, attempt, method, request)
                if err is not None:
                    time.sleep(attempt.failed(err))
                    continue
                if response is not None:
                    return attempt.answered(response)
            try:
                response = getattr(self._stub(attempt.address), method)(
                    request, timeout=attempt.timeout_s)
            except grpc.RpcError as exc:
                time.sleep(attempt.failed(from_rpc_error(exc)))
                continue
            if on_port and response.call_port and port_retry(self._links, self._port_failed,
                                                             attempt.address):
                self._links[attempt.address] = CallLink(attempt.address.rsplit(":", 1)[0],
                                                        response.call_port, self.creds)
            return attempt.answered(response)

    def _on_link(self, link: CallLink, attempt: MasterRetry, method: str, request):
        """One attempt on the master's socket port: (its response, None), (None, the
        master's error: as gRPC's, or no answer in time: the next attempt goes to
        the next master, as after a gRPC deadline), or (None, None) when the link is
        busy or broke (the attempt goes through gRPC). A link that broke or timed out
        is dropped, and its master asked through gRPC for PORT_RETRY_S."""
        timeout_s = attempt.timeout_s
        taken = False
        try:
            # Taken inside the try: an exception from a signal handler must not leave
            # the link locked for good.
            taken = link.lock.acquire(blocking=False)
            if not taken:
                return None, None
            return link.call(method, request, timeout_s), None
        except LinkBroken as broken:
            self._links.pop(attempt.address, None)
            self._port_failed[attempt.address] = time.monotonic()
            return None, (broken if broken.timed_out else None)
        except KVStoreError as err:
            return None, err
        finally:
            if taken:
                link.lock.release()

    def forked(self) -> None:
        """In a forked child: forget the parent's links (their sockets are shared with
        it: an answer would reach either process), each closed in this process only,
        and its gRPC channels (a child that used them hung in gRPC when the parent had
        threads calling at the fork: new channels did not)."""
        links, self._links = self._links, {}
        for link in links.values():
            link.close()
        self._stubs = MasterStubs(self.creds, rpc.channel)

    def _stub(self, address: str) -> pb_grpc.MasterStub:
        self.check_open()
        return self._stubs.get(address)

    # ---- the shard map and routing ----
    def _fetch_shard_map(self) -> ShardMap:
        return wire.shard_map(self.call(self.seeds, "GetShardMap", pb.GetShardMapRequest()))

    def refresh_shard_map(self) -> None:
        """Fetch the shard map from the seed masters again (after a WRONG_SHARD)."""
        self.shard_map = self._fetch_shard_map()

    def shard_for_key(self, key: str) -> ShardRange:
        """The shard owning ``key``'s slot in the current map."""
        return self.shard_map.shard_for_key(key)

    def routed(self, keys: Sequence[str],
               call: Callable[[tuple[str, ...], list[str]], list],
               invalid: Callable[[KVStoreError], object] = lambda err: err,
               per_key_errors: bool = True) -> list:
        """Run ``call(addresses, sub_keys)`` once per shard; results in input order, by
        the rules of :class:`~kvstore.client.core.routing.Route` (the one WRONG_SHARD
        refresh; a shard's failure its keys' results unless ``per_key_errors`` is False).
        """
        route = Route(keys, invalid, per_key_errors)
        while True:
            for c in route.calls(self.shard_map):
                try:
                    route.answered(c, call(c[0], c[2]))
                except KVStoreError as err:
                    route.failed(c, err)
            if not route.wants_refresh(self.shard_map.version):
                return route.out
            self.refresh_shard_map()

    # ---- typed calls ----
    def lookup(self, keys: Sequence[str]) -> list[ObjectMeta | KVStoreError]:
        """Lookup (counts an access): per key its metadata or the error (NotFound)."""
        def call(addresses: tuple[str, ...], ks: list[str]) -> list[ObjectMeta | KVStoreError]:
            return replies.lookup_results(ks, self.call(addresses, "Lookup",
                                                        pb.LookupRequest(keys=ks)))
        return self.routed(keys, call)

    def exists(self, keys: Sequence[str]) -> list[bool | KVStoreError]:
        """Exists: per key its visibility, False for a non-``str`` key, or the error
        (WrongShard when no shard owns it after the refresh)."""
        def call(addresses: tuple[str, ...], ks: list[str]) -> list[bool | KVStoreError]:
            return replies.exists_results(ks, self.call(addresses, "Exists",
                                                        pb.ExistsRequest(keys=ks)))
        return self.routed(keys, call, invalid=lambda err: False, per_key_errors=False)

    def remove(self, keys: Sequence[str], reason: RemoveReason) -> list[ObjectMeta | KVStoreError]:
        """Remove: per key the removed object (version, replicas) or the error (NotFound)."""
        def call(addresses: tuple[str, ...], ks: list[str]) -> list[ObjectMeta | KVStoreError]:
            return replies.remove_results(ks, self.call(
                addresses, "Remove", pb.RemoveRequest(keys=ks, reason=reason.value)))
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

    def tenant_stats(self) -> list[list[TenantStatus]]:
        """Per shard, in shard map order, the figures of the tenants the caller may see."""
        return [[wire.tenant_status(t) for t in
                 self.call(r.addresses, "TenantStats", pb.TenantStatsRequest()).tenants]
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
