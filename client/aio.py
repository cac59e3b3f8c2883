"""``AsyncKVClient``: the SDK for asyncio programs, many operations in flight.

:class:`~kvstore.client.client.KVClient`'s operations, awaitable, by the same rules:
a driver of the client core (:mod:`kvstore.client.core`: failover, routing, reads,
placement, the put's steps), one deadline per call (:mod:`kvstore.client.deadline`).
Masters through ``grpc.aio``; data through one pipelined TCP connection per node
(:mod:`kvstore.transfer.aio_tcp`, the asyncio transport), and the values of a
node on this host through its shared-memory segment (:mod:`kvstore.transfer.aio_shm`,
the control frames on that connection)::

    async with AsyncKVClient("127.0.0.1:7001") as kv:
        await kv.put("k", b"v")
        values = await asyncio.gather(*(kv.get(k) for k in keys))

Thread safety: one event loop (the one the client was entered in).
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, Sequence

import grpc

from kvstore import wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.core import replies
from kvstore.client.core.failover import MasterRetry
from kvstore.client.core.placement import IDS_PER_GRANT, GrantUse, grant_of, grant_use, take
from kvstore.client.core.puts import WAIT_S, PutAttempt, Step, replica_count, split_answers, waves
from kvstore.client.core.reads import ReadPlan, from_cache, read_order, report_node, stale
from kvstore.client.core.routing import Route
from kvstore.client.connections import CLIENT_PREFAULT_BYTES
from kvstore.client.deadline import call_scope, of_call, unscoped_context
from kvstore.client.forks import in_forked_child
from kvstore.client.meta_cache import MetaCache
from kvstore.client.stubs import MasterStubs
from kvstore.client.suspects import Suspects, fallback_after_s
from kvstore.errors import (InvalidArgument, KVStoreError, NoSpace, Unavailable, from_rpc_error,
                            unwrap)
from kvstore.keys import key_list, validate_key
from kvstore.rpc import ClientCredentials, aio_channel
from kvstore.tls import client_context
from kvstore.transfer import codec
from kvstore.transfer.aio_call_link import AsyncCallLink
from kvstore.transfer.aio_shm import PUT_MIN_BYTES as SHM_PUT_MIN_BYTES
from kvstore.transfer.aio_shm import AsyncShms
from kvstore.transfer.aio_tcp import AsyncConnections
from kvstore.transfer.buffers import readable_view, writable_view
from kvstore.transfer.call_link import CALL_METHODS, port_retry
from kvstore.transfer.protocol import MAX_UNANSWERED, Op
from kvstore.transfer.report_link import LinkBroken
from kvstore.transfer.shm import host_id
from kvstore.types import NodeAddress, ObjectMeta, RemoveReason


def _one_deadline(method):
    @functools.wraps(method)
    async def bounded(self: "AsyncKVClient", *args, **kwargs):
        scope = call_scope(self.timeout_s, self.failover_wait_s)
        try:
            with scope:
                return await method(self, *args, **kwargs)
        finally:
            scope.leave()     # again: a signal handler's exception may have cut __exit__ short
    return bounded


async def _all(awaitables) -> list:
    """The results of ``awaitables`` in order, run concurrently (``asyncio.gather``);
    one alone is awaited in place: a gather costs a task and a future (12 µs here)."""
    aws = list(awaitables)
    if len(aws) == 1:
        return [await aws[0]]
    return list(await asyncio.gather(*aws))


class AsyncKVClient:
    """An asyncio client of a kvstore cluster; use ``async with`` (or :meth:`start`, :meth:`close`).

    Args: as :class:`~kvstore.client.client.KVClient`'s (``timeout_s`` is also each data
    answer's: there is no ``read_timeout_s``); ``prefer_local``: a value's first replica
    goes to a node on this host when it fits; ``prefer_shm``: values of a node on this
    host are copied through its shared memory (as the sync client's ``prefer_shm``).
    """

    def __init__(self, master: str, *, replica_num: int = 1, timeout_s: float = 10.0,
                 failover_wait_s: float = 15.0, meta_cache_entries: int = 65536,
                 token: str | None = None, tls=None, prefer_local: bool = True,
                 prefer_shm: bool = True):
        self.seeds = tuple(master.split("|"))
        self.replica_num, self.timeout_s, self.failover_wait_s = replica_num, timeout_s, failover_wait_s
        self.creds = ClientCredentials.resolve(token, tls=tls)
        self._stubs = MasterStubs(self.creds, aio_channel)
        self._leader: dict[tuple[str, ...], int] = {}
        self._tls = client_context(self.creds.tls) if self.creds.tls is not None else None
        self._conns = AsyncConnections(timeout_s, self.creds.token, self._tls)
        #: A master's address -> the opening of its socket port's link, once it named one.
        self._links: dict[str, asyncio.Future] = {}
        self._port_failed: dict[str, float] = {}   # address -> monotonic s of its link's failure
        in_forked_child(self.forked)
        self._grants: dict = {}            # (shard's masters, replica_num) -> Grant
        self._granting: dict = {}          # ... -> its fetch (a task)
        self._grant_error: dict = {}       # ... -> why its last fetch failed
        here = host_id()
        self._host_id = here if prefer_local else None
        self._shms = AsyncShms(here, CLIENT_PREFAULT_BYTES) if prefer_shm else None
        self.shard_map = None
        self._meta = MetaCache(meta_cache_entries)
        self._suspects = Suspects()
        self._fallback_after_s = fallback_after_s(timeout_s)

    async def __aenter__(self) -> "AsyncKVClient":
        return await self.start() or self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        """Fetch the shard map. Raises: Unavailable: no seed master answers."""
        self.shard_map = wire.shard_map(await self._call(self.seeds, "GetShardMap",
                                                         pb.GetShardMapRequest()))

    def forked(self) -> None:
        """In a forked child: leave the parent its master links, data connections and gRPC
        channels (their sockets are shared with it: the child's requests would be
        answered to the parent), untouched: closing a transport here would take its
        socket out of the event loop's epoll set, which the parent shares. The
        child's next call opens its own (gRPC's asyncio API may not work in a child
        at all: a child's event loop is best served by a client made there)."""
        self._links = {}
        self._conns = AsyncConnections(self.timeout_s, self.creds.token, self._tls)
        self._stubs = MasterStubs(self.creds, aio_channel)

    async def close(self) -> None:
        self._conns.close()
        if self._shms is not None:
            self._shms.close()
        for opening in self._links.values():
            if not opening.done():
                opening.cancel()
            elif not opening.cancelled() and opening.exception() is None:
                opening.result().close()
        self._links.clear()
        for ch in self._stubs.take_channels():
            await ch.close()

    async def warm_up(self, timeout_s: float = 60.0) -> bool:
        """As :meth:`KVClient.warm_up`: connect to every live node now, and wait (off the
        loop) until each same-host node's segment is mapped here.

        Returns:
            True when every prefault ended within ``timeout_s`` (s).

        Raises:
            Unavailable: a master or a node cannot be reached.
        """
        stats = await asyncio.gather(*(self._call(r.addresses, "Stat", pb.StatRequest())
                                       for r in self.shard_map.ranges))
        for node in {n.address.node_id: n.address for st in map(wire.shard_status, stats)
                     for n in st.nodes if n.alive}.values():
            conn = await self._conns.get(node, self.timeout_s)
            if self._shms is not None:
                self._shms.of(node, conn)
        if self._shms is None:
            return True
        return await asyncio.to_thread(self._shms.wait_prefaulted, timeout_s)

    def _deadline(self):
        return of_call(self.timeout_s, self.failover_wait_s)

    # ---- masters ----
    async def _call(self, addresses: tuple[str, ...], method: str, request):
        """One master RPC by the core's retry rule (:class:`MasterRetry`); Lookup, Exists
        and GrantPlacement on the master's socket port once it named one
        (:mod:`kvstore.transfer.aio_call_link`), else, and when that link broke, gRPC."""
        on_port = method in CALL_METHODS
        for attempt in MasterRetry(addresses, self._leader, self._deadline(), self.timeout_s):
            opening = self._links.get(attempt.address) if on_port else None
            if opening is not None:
                response, err = await self._on_link(opening, attempt, method, request)
                if err is not None:
                    await asyncio.sleep(attempt.failed(err))
                    continue
                if response is not None:
                    return attempt.answered(response)
            try:
                response = await getattr(self._stubs.get(attempt.address), method)(
                    request, timeout=attempt.timeout_s)
            except grpc.RpcError as exc:
                await asyncio.sleep(attempt.failed(from_rpc_error(exc)))
                continue
            if on_port and response.call_port and port_retry(self._links, self._port_failed,
                                                             attempt.address):
                self._links[attempt.address] = asyncio.ensure_future(AsyncCallLink.open(
                    attempt.address.rsplit(":", 1)[0], response.call_port, self.creds.token,
                    self._tls, self.timeout_s))
            return attempt.answered(response)

    async def _on_link(self, opening: asyncio.Future, attempt: MasterRetry, method: str,
                       request):
        """One attempt on the master's socket port, as :meth:`Control._on_link`."""
        timeout_s = attempt.timeout_s
        try:
            link = opening.result() if opening.done() else await asyncio.shield(opening)
            return await link.call(method, request, timeout_s), None
        except LinkBroken as broken:
            if self._links.get(attempt.address) is opening:
                del self._links[attempt.address]
                self._port_failed[attempt.address] = time.monotonic()
            return None, (broken if broken.timed_out else None)
        except KVStoreError as err:
            return None, err

    async def _routed(self, keys, method: str, request, decode, **route) -> list:
        """``method`` per shard, routed by the core (:class:`Route`); results in order."""
        async def one(c):
            try:
                answers = decode(c[2], await self._call(c[0], method, request(c[2])))
            except KVStoreError as err:
                return route_.failed(c, err)
            route_.answered(c, answers)
        route_ = Route(keys, **route)
        while True:
            await asyncio.gather(*map(one, route_.calls(self.shard_map)))
            if not route_.wants_refresh(self.shard_map.version):
                return route_.out
            await self.start()

    @_one_deadline
    async def lookup(self, keys: Sequence[str]) -> list[ObjectMeta | KVStoreError]:
        """As :meth:`KVClient.lookup`."""
        return await self._routed(key_list(keys), "Lookup", lambda ks: pb.LookupRequest(keys=ks),
                                  replies.lookup_results)

    @_one_deadline
    async def lookup_cached(self, keys: Sequence[str]) -> list[ObjectMeta | KVStoreError]:
        """:meth:`lookup`, and what it finds goes into the metadata cache."""
        metas = await self.lookup(keys)
        self._meta.put_found(metas)
        return metas

    @_one_deadline
    async def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """As :meth:`kvstore.client.KVClient.batch_exists`."""
        out = await self._routed(key_list(keys, validate=False), "Exists",
                                 lambda ks: pb.ExistsRequest(keys=ks), replies.exists_results,
                                 invalid=lambda err: False, per_key_errors=False)
        return [unwrap(r) for r in out]

    @_one_deadline
    async def exists(self, key: str) -> bool:
        """As :meth:`KVClient.exists`."""
        validate_key(key)
        return (await self.batch_exists([key]))[0]

    async def _request(self, node: NodeAddress, op: Op, key: str, *args, timeout_s: float, **kw):
        """One data request: its :class:`~kvstore.transfer.reply.Reply` or its error;
        connecting and the answer wait ``timeout_s`` at most. A node that fails (by
        :func:`report_node`) is suspect and reported to the key's shard."""
        try:
            conn = self._conns.ready(node) or await self._conns.get(node, timeout_s)
            answer = await conn.request(op, key, *args, timeout_s=timeout_s, **kw)
        except KVStoreError as err:
            answer = err
        return await self._answered(node, key, answer)

    async def _answered(self, node: NodeAddress, key: str, answer):
        """``answer`` (a node's, or the error its request failed with); a node that
        failed (by :func:`report_node`) is suspect and reported to the key's shard."""
        if not isinstance(answer, Unavailable):
            self._suspects.ok(node.node_id)
        elif report_node(answer, self._deadline()):
            self._suspects.failed(node.node_id)
            try:
                await self._call(self.shard_map.shard_for_key(key).addresses, "ReportFailure",
                                 pb.ReportFailureRequest(node_ids=[node.node_id],
                                                         reason=str(answer)[:200]))
            except KVStoreError:
                pass                       # the report is advice; the read goes on
        return answer

    # ---- reads ----
    @_one_deadline
    async def get(self, key: str) -> bytearray:
        """As :meth:`KVClient.get`. Raises: NotFound, ChecksumMismatch, Unavailable."""
        return await self._get_one(key, None)

    @_one_deadline
    async def get_into(self, key: str, dest: Any) -> int:
        """As :meth:`KVClient.get_into`."""
        return len(await self._get_one(key, writable_view(dest)))

    @_one_deadline
    async def batch_get(self, keys: Sequence[str]) -> list[bytearray | KVStoreError]:
        """Values (new bytearrays) or errors per key, in input order."""
        keys = key_list(keys, validate=False)
        return await self._get_many(keys, [None] * len(keys))

    @_one_deadline
    async def batch_get_into(self, keys: Sequence[str], dests: Sequence[Any]
                             ) -> list[int | KVStoreError]:
        """Read each key into its destination; per key the size in bytes or the error."""
        keys = key_list(keys, validate=False)
        if len(keys) != len(dests):
            raise InvalidArgument(f"{len(keys)} keys but {len(dests)} destinations")
        got = await self._get_many(keys, [writable_view(d) for d in dests])
        return [g if isinstance(g, KVStoreError) else len(g) for g in got]

    async def _get_one(self, key: str, dest: memoryview | None):
        meta = self._meta.get(key) if type(key) is str else None
        if meta is not None and len(meta.replicas) == 1:
            # The fast path: one cached replica, read in place (no lists, no gather). A
            # failure reads once more with fresh metadata, a destination too small for
            # the cached size too (another client may have put a smaller value since).
            got = await self._read(meta, dest, meta.replicas)
            if not isinstance(got, KVStoreError):
                return got
            self._meta.drop(key)
        (got,) = await self._get_many([key], [dest])
        return unwrap(got)

    async def _get_many(self, keys: Sequence[str], dests: Sequence[memoryview | None]) -> list:
        metas, cached, miss = from_cache(self._meta, keys)
        for i, m in zip(miss, await self.lookup_cached([keys[i] for i in miss]) if miss else ()):
            metas[i] = m
        got = await _all(map(self._read, metas, dests))
        again = stale(cached, got)
        for i in again:
            self._meta.drop(keys[i])
        fresh = await self.lookup_cached([keys[i] for i in again]) if again else ()
        for i, g in zip(again, await _all(map(self._read, fresh, [dests[i] for i in again]))):
            got[i] = g
        return got

    async def _read(self, meta, dest: memoryview | None = None, order=None):
        """The value from the first replica that answers it whole and intact (by the
        core's :class:`ReadPlan`), or the read's error. ``order``: the replicas to try
        when known (one replica), else :func:`read_order`'s."""
        if order is None and isinstance(meta, ObjectMeta):
            order = read_order(meta, self._suspects.until, self._host_id)
        plan = ReadPlan(meta, order or (), None if dest is None else len(dest))
        while not plan.done:
            wait_s = plan.wait_s(self._deadline(), self._fallback_after_s, self.timeout_s)
            if wait_s > 0:
                got = await self._get_from(plan.node, meta, dest, wait_s)
                plan.answered(got if isinstance(got, KVStoreError) else None)
        if plan.stale_replicas():
            self._meta.drop_replicas(meta.key, meta.object_id, plan.stale_replicas())
        return plan.error or got

    async def _get_from(self, node: NodeAddress, meta: ObjectMeta, dest: memoryview | None,
                        wait_s: float):
        """``meta``'s value from ``node`` (into ``dest`` when given), or the error: through
        the node's segment when it is on this host, else (and for an object the node
        cannot bring into DRAM: NO_SPACE) over its TCP connection, hashed."""
        if self._shms is not None and self._shms.local(node):
            shm = await self._shm_path(node, meta.key, wait_s)
            if isinstance(shm, KVStoreError):
                return shm
            if shm is not None:
                got = shm.read_known(meta.key, meta.object_id, meta.size_bytes, dest)
                if got is not None:
                    if shm.conn.unanswered() >= MAX_UNANSWERED:
                        await asyncio.sleep(0)     # the loop reads the SHM_TOUCH answers
                    return got
                try:
                    got = await shm.read(meta.key, meta.object_id, meta.size_bytes, dest, wait_s)
                except KVStoreError as err:
                    got = err
                got = await self._answered(node, meta.key, got)
                if not isinstance(got, NoSpace):
                    return got
        reply = await self._request(node, Op.GET, meta.key, meta.object_id, timeout_s=wait_s,
                                    max_value_bytes=meta.size_bytes, into=dest)
        if isinstance(reply, KVStoreError):
            return reply
        return replies.value_error(reply, meta) or reply.value

    async def _shm_path(self, node: NodeAddress, key: str, wait_s: float):
        """``node``'s segment path on its connection now (connected within ``wait_s``),
        None (TCP then), or the error connecting failed with (reported)."""
        try:
            conn = self._conns.ready(node) or await self._conns.get(node, wait_s)
        except KVStoreError as err:
            return await self._answered(node, key, err)
        return self._shms.of(node, conn)

    # ---- puts ----
    @_one_deadline
    async def put(self, key: str, value: Any, *, replica_num: int | None = None,
                  parent: str | None = None) -> bool:
        """As :meth:`KVClient.put`: True if written, False if equal bytes were already stored."""
        res = await self._put_one(key, value, replica_count(replica_num, self.replica_num),
                                  parent or "")
        return unwrap(res)

    @_one_deadline
    async def batch_put(self, keys: Sequence[str], values: Sequence[Any], *,
                        replica_num: int | None = None,
                        parents: Sequence[str | None] | None = None) -> list[KVStoreError | None]:
        """Put many values; per key None (written or already present) or the error."""
        keys = key_list(keys, validate=False)
        parents = list(parents) if parents is not None else [None] * len(keys)
        if not len(keys) == len(values) == len(parents):
            raise InvalidArgument(f"{len(keys)} keys, {len(values)} values, {len(parents)} parents")
        n = replica_count(replica_num, self.replica_num)
        res: list = [None] * len(keys)
        for wave in waves(keys, range(len(keys))):     # a repeated key: the first wins
            for i, r in zip(wave, await asyncio.gather(*(self._put_one(
                    keys[i], values[i], n, parents[i] or "") for i in wave))):
                res[i] = r if isinstance(r, KVStoreError) else None
        return res

    async def _put_one(self, key: str, value: Any, replica_num: int, parent: str):
        """One value's put, step by step as its :class:`PutAttempt` says."""
        try:
            validate_key(key)
            view = readable_view(value)
        except KVStoreError as err:
            return err
        # A value for this host's segment alone is hashed as it is copied there
        # (the node's answer names the checksum); any other target needs it first.
        checksum = None if self._shm_bound(len(view)) else codec.value_hash(view)
        dl, attempt = self._deadline(), PutAttempt(key)
        while True:
            slot = (self.shard_map.shard_for_key(key).addresses, replica_num)
            try:
                placed = self._placed(slot, key, len(view), attempt.exclude)
                oid, targets = placed or await self._place(slot, key, len(view), attempt.exclude, dl)
            except KVStoreError as err:
                step = attempt.place_failed(err, dl)
            else:
                if checksum is None and (len(targets) > 1 or not self._shms.local(targets[0])):
                    checksum = codec.value_hash(view)
                answers = await _all(self._put_to(t, key, oid, view, checksum, parent,
                                                  replica_num, dl.bound(self.timeout_s))
                                     for t in targets)
                written, failures = split_answers(key, targets, answers)
                if checksum is None and written:
                    checksum = answers[0].checksum
                if written:
                    self._meta.put_written(key, len(view), checksum, oid, written)
                step = attempt.answered(written, failures, dl)
            if step is Step.DONE:
                return attempt.result
            if step is Step.REFRESH_MAP:
                await self.start()
            elif step is Step.WAIT:
                await asyncio.sleep(min(WAIT_S, max(0.0, dl.left_s())))
                attempt.waited()
            if step is not Step.AGAIN:
                self._grants.pop(slot, None)

    def _shm_bound(self, size_bytes: int) -> bool:
        """Whether a value of ``size_bytes`` goes through a same-host node's segment."""
        return self._shms is not None and size_bytes >= SHM_PUT_MIN_BYTES

    async def _put_to(self, node: NodeAddress, key: str, oid: int, view: memoryview,
                      checksum: int | None, parent: str, replica_num: int, timeout_s: float):
        """One replica's write: its answer (a Reply) or its error; through the node's
        segment when it is on this host (``checksum`` None: hashed on the way), else
        its TCP connection."""
        if self._shm_bound(len(view)) and self._shms.local(node):
            shm = await self._shm_path(node, key, timeout_s)
            if isinstance(shm, KVStoreError):
                return shm
            if shm is not None:
                try:
                    answer = await shm.write(key, oid, view, checksum, parent, replica_num,
                                             timeout_s)
                except KVStoreError as err:
                    answer = err
                return await self._answered(node, key, answer)
        if checksum is None:      # the segment could not be mapped after all
            checksum = codec.value_hash(view)
        return await self._request(node, Op.PUT, key, oid, len(view), checksum, view,
                                   parent, replica_num, timeout_s=timeout_s)

    def _placed(self, slot, key: str, size_bytes: int, exclude):
        """An object id and targets while the shard's grant serves the put (a refresh
        due starts in the background), else None (:meth:`_place` fetches one): no
        coroutine on the common path."""
        g = self._grants.get(slot)
        use = grant_use(g, key, time.monotonic())
        if use is GrantUse.FETCH:
            return None
        if use is GrantUse.REFRESH:
            self._fetch(slot, "")
        return take(g, key, size_bytes, slot[1], exclude, self._host_id)

    async def _place(self, slot, key: str, size_bytes: int, exclude, dl):
        """An object id and targets from the shard's grant (:func:`grant_use`); a fetch
        that several puts wait on, within each one's deadline."""
        fetched = False
        while True:
            placed = self._placed(slot, key, size_bytes, exclude)
            if placed is not None:
                return placed
            g = self._grants.get(slot)
            if fetched and (g is None or not g.serves(key)):
                raise self._grant_error.get(slot) or Unavailable("no placement grant", key=key)
            if fetched and not dl.may_retry():
                return take(g, key, size_bytes, slot[1], exclude, self._host_id)
            fetched = True
            try:
                async with asyncio.timeout(max(0.0, dl.left_s())):
                    await asyncio.shield(self._fetch(slot, key))
            except TimeoutError:
                raise Unavailable("no placement grant within the call's deadline", key=key) from None

    def _fetch(self, slot, key: str) -> asyncio.Task:
        """The shard's grant fetch in flight, started now if none is: a task that works
        for several calls, so none of their deadlines applies in it."""
        async def fetch():
            try:
                self._grants[slot] = grant_of(await self._call(slot[0], "GrantPlacement",
                    pb.GrantPlacementRequest(replica_num=slot[1], num_ids=IDS_PER_GRANT, key=key)))
            except KVStoreError as err:
                self._grants.pop(slot, None)
                self._grant_error[slot] = err
            finally:
                self._granting.pop(slot, None)
        if slot not in self._granting:
            self._granting[slot] = asyncio.get_running_loop().create_task(
                fetch(), context=unscoped_context())
        return self._granting[slot]

    # ---- remove ----
    @_one_deadline
    async def remove(self, key: str, *, reason: RemoveReason | str = RemoveReason.REMOVE) -> None:
        """As :meth:`KVClient.remove`: no reader gets the value once this returns."""
        reason = replies.remove_reason(reason)
        validate_key(key)
        self._meta.drop(key)
        removed = unwrap((await self._routed([key], "Remove", lambda ks: pb.RemoveRequest(
            keys=ks, reason=reason.value), replies.remove_results))[0])
        wait_s = self._deadline().bound(self.timeout_s)      # the nodes drop it first
        await asyncio.gather(*(self._request(r.node, Op.DROP, key, removed.object_id,
                                             timeout_s=wait_s) for r in removed.replicas))
        self._meta.drop(key)             # again: a concurrent get may have cached it
