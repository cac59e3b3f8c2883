"""``AsyncKVClient``: the SDK for asyncio programs, many operations in flight.

The same operations as :class:`~kvstore.client.client.KVClient` (put, get,
get_into, batch forms, exists, lookup, remove), awaitable: ``grpc.aio`` for the masters
(shard map, Lookup, Exists, Remove, GrantPlacement), and one pipelined TCP
connection per node for the data (:mod:`kvstore.client.aio_data`), so a
program that starts 64 gets or puts at once keeps 64 frames in flight on
that connection. Puts follow the one-round-trip protocol of the sync SDK
(placement grants, :mod:`kvstore.client.placement`; the same choice of
targets and the same rules, :func:`kvstore.client.puts.settle`); reads
verify checksums and fall back across replicas in the sync SDK's order.
Shared memory is the sync client's (``prefer_shm``); this one speaks TCP
(with TLS and tokens, as configured).

    async with AsyncKVClient("127.0.0.1:7001") as kv:
        await kv.put("k", b"v")
        values = await asyncio.gather(*(kv.get(k) for k in keys))

Every call has one deadline, ``max(timeout_s, failover_wait_s)`` after it
starts, that bounds its whole time, retries included, and the master calls
follow the sync SDK's one retry rule (:mod:`kvstore.client.deadline`,
:class:`kvstore.client.control.MasterRetry`).

Thread safety: one event loop (the one the client was entered in).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import defaultdict
from typing import Any, Sequence

import grpc

from kvstore import wire
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.aio_data import AsyncNodeConnection
from kvstore.client.control import MasterRetry
from kvstore.client.deadline import Deadline, call_scope, of_call, unscoped_context
from kvstore.client.meta_cache import MetaCache
from kvstore.client.placement import IDS_PER_GRANT, Grant, grant_of, take
from kvstore.client.puts import settle
from kvstore.client.suspects import Suspects, fallback_after_s
from kvstore.errors import (InvalidArgument, KVStoreError, NotFound,
                            Unavailable, WrongShard, error_for_code, from_rpc_error)
from kvstore.keys import key_list, validate_key, value_checksum
from kvstore.rpc import MAX_KEYS_PER_CALL, ClientCredentials, aio_channel, check_replica_num
from kvstore.shardmap import ShardMap
from kvstore.tls import client_context
from kvstore.transfer.buffers import readable_view, writable_view
from kvstore.transfer.protocol import Op
from kvstore.types import NodeAddress, NodeId, ObjectMeta, RemoveReason, Replica, TierKind

_MAX_NODES_TRIED = 6


def _one_deadline(method):
    """Run an AsyncKVClient call under one deadline (:mod:`kvstore.client.deadline`)."""
    @functools.wraps(method)
    async def bounded(self: "AsyncKVClient", *args, **kwargs):
        with call_scope(self.timeout_s, self.failover_wait_s):
            return await method(self, *args, **kwargs)
    return bounded


class AsyncKVClient:
    """An asyncio client of a kvstore cluster; use ``async with`` (or :meth:`start`
    and :meth:`close`).

    Args:
        master: a shard's masters, ``"host:port"`` or ``"a:p|b:p"`` (leader and standbys).
        replica_num: replicas per put by default.
        timeout_s: deadline of each master call attempt and of each data answer
            (a read with another replica to try waits a quarter of it, at least
            1 s, for each; a node that failed is tried last, longer at each
            failure in a row, as in the sync SDK).
        failover_wait_s: how long after it started a call may still start new
            attempts (another master, a master warming up, a new grant). Every
            call ends by one deadline, ``max(timeout_s, failover_wait_s)`` after
            it started, as the sync SDK's (:mod:`kvstore.client.deadline`).
        meta_cache_entries: the metadata cache (as the sync SDK's; 0: off).
        token, tls: credentials (default: ``$KVSTORE_TOKEN``, ``$KVSTORE_TLS_*``).
    """

    def __init__(self, master: str, *, replica_num: int = 1, timeout_s: float = 10.0,
                 failover_wait_s: float = 15.0,
                 meta_cache_entries: int = 65536, token: str | None = None, tls=None):
        self.seeds = tuple(master.split("|"))
        self.replica_num = replica_num
        self.timeout_s = timeout_s
        self.failover_wait_s = failover_wait_s
        self.creds = ClientCredentials.resolve(token, tls=tls)
        self._tls = client_context(self.creds.tls) if self.creds.tls is not None else None
        self._stubs: dict[str, pb_grpc.MasterStub] = {}
        self._channels: list = []
        self._leader: dict[tuple[str, ...], int] = {}
        self._conns: dict[NodeId, AsyncNodeConnection] = {}
        self._opening: dict[NodeId, asyncio.Future] = {}
        self._grants: dict[tuple[tuple[str, ...], int], Grant] = {}
        self._granting: dict[tuple[tuple[str, ...], int], asyncio.Task] = {}
        self._grant_error: KVStoreError | None = None   # why the last grant fetch failed
        self.shard_map: ShardMap | None = None
        self._meta = MetaCache(meta_cache_entries)
        self._suspects = Suspects()
        self._fallback_after_s = fallback_after_s(timeout_s)

    async def __aenter__(self) -> "AsyncKVClient":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        """Fetch the shard map. Raises: Unavailable: no seed master answers."""
        self.shard_map = wire.shard_map(await self._call(self.seeds, "GetShardMap",
                                                         pb.GetShardMapRequest()))

    async def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        for ch in self._channels:
            await ch.close()
        self._channels.clear()

    # ---- master calls ----
    def _stub(self, address: str) -> pb_grpc.MasterStub:
        stub = self._stubs.get(address)
        if stub is None:
            ch = aio_channel(address, self.creds)
            self._channels.append(ch)
            stub = self._stubs[address] = pb_grpc.MasterStub(ch)
        return stub

    async def _call(self, addresses: tuple[str, ...], method: str, request):
        """One master RPC, by the sync SDK's one retry rule
        (:class:`~kvstore.client.control.MasterRetry`), within the call's deadline."""
        retry = MasterRetry(addresses, self._leader.get(addresses, 0),
                            of_call(self.timeout_s, self.failover_wait_s))
        while True:
            at = retry.at
            try:
                resp = await getattr(self._stub(addresses[at]), method)(
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
            await asyncio.sleep(pause)

    def _by_shard(self, keys: Sequence[str]) -> dict[tuple[str, ...], list[int]]:
        groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for i, k in enumerate(keys):
            groups[self.shard_map.shard_for_key(k).addresses].append(i)
        return groups

    async def _per_key(self, keys: Sequence[str], method: str, make_request, parse) -> list:
        """``method`` per shard (calls of at most MAX_KEYS_PER_CALL keys); results in order."""
        out: list = [None] * len(keys)

        async def one(addresses, idxs):
            ks = [keys[i] for i in idxs]
            resp = await self._call(addresses, method, make_request(ks))
            for i, r in zip(idxs, parse(ks, resp)):
                out[i] = r

        calls = [one(a, idxs[j:j + MAX_KEYS_PER_CALL]) for a, idxs in self._by_shard(keys).items()
                 for j in range(0, len(idxs), MAX_KEYS_PER_CALL)]
        await asyncio.gather(*calls)
        return out

    @_one_deadline
    async def lookup(self, keys: Sequence[str]) -> list[ObjectMeta | KVStoreError]:
        """Per key its metadata (replicas, size, checksum) or the error (NotFound)."""
        keys = key_list(keys)                   # one str is no batch; each key checked

        def parse(ks, resp):
            return [wire.object_meta(r.meta) if r.status.code == pb.OK else
                    error_for_code(r.status.code, r.status.message, key=k)
                    for k, r in zip(ks, resp.results)]
        return await self._per_key(keys, "Lookup", lambda ks: pb.LookupRequest(keys=ks), parse)

    @_one_deadline
    async def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """As :meth:`kvstore.client.KVClient.batch_exists`."""
        return await self._per_key(key_list(keys, validate=False), "Exists", lambda ks: pb.ExistsRequest(keys=ks),
                                   lambda ks, resp: list(resp.exists))

    @_one_deadline
    async def exists(self, key: str) -> bool:
        """True iff ``get(key)`` would return a value.

        Raises:
            InvalidArgument: a bad key (as ``get`` raises; :meth:`batch_exists`
                answers False for it).
            Unavailable.
        """
        validate_key(key)
        return (await self.batch_exists([key]))[0]

    # ---- data connections ----
    async def _conn(self, node: NodeAddress) -> AsyncNodeConnection:
        conn = self._conns.get(node.node_id)
        if conn is not None and conn.broken is None:
            return conn
        pending = self._opening.get(node.node_id)
        if pending is None:
            pending = self._opening[node.node_id] = asyncio.ensure_future(
                AsyncNodeConnection.open(node.host, node.data_port, timeout_s=self.timeout_s,
                                         token=self.creds.token,
                                         tls=self._tls if node.tls else None))
        try:
            conn = await asyncio.shield(pending)
        finally:
            if self._opening.get(node.node_id) is pending and pending.done():
                del self._opening[node.node_id]
        self._conns[node.node_id] = conn
        return conn

    async def _request(self, node: NodeAddress, *args, timeout_s: float | None = None, **kw):
        """One data request; the answer, or the error (KVStoreError) it failed with.
        With ``timeout_s`` under ``timeout_s`` of the client, connecting and the answer
        together wait that long at most. A node that cannot be reached or does not
        answer in time is suspect (unless the call's deadline is what ran out); one
        that answers is not."""
        try:
            if timeout_s is None or timeout_s >= self.timeout_s:
                answer = await (await self._conn(node)).request(*args, **kw)
            else:
                end = time.monotonic() + timeout_s
                try:
                    async with asyncio.timeout(max(0.0, timeout_s)):
                        conn = await self._conn(node)
                except TimeoutError:
                    raise Unavailable(f"cannot connect to store node {node.node_id} "
                                      f"within {timeout_s:.1f} s") from None
                answer = await conn.request(*args, timeout_s=end - time.monotonic(), **kw)
        except Unavailable as err:
            if of_call(self.timeout_s, self.failover_wait_s).left_s() > 0:
                self._suspects.failed(node.node_id)
            return err
        except KVStoreError as err:
            return err
        self._suspects.ok(node.node_id)
        return answer

    # ---- reads ----
    @_one_deadline
    async def get(self, key: str) -> bytearray:
        """The value of ``key`` as a new bytearray (empty for a 0-byte value), as
        :meth:`KVClient.get`.

        Raises:
            NotFound, ChecksumMismatch, Unavailable (no replica answered).
        """
        meta = self._meta.get(key) if type(key) is str else None
        if meta is not None:                 # the fast path: one read, no lists, no gather
            got = await self._read(meta)
            if not isinstance(got, KVStoreError):
                return got
            self._meta.drop(key)
        (got,) = await self.batch_get([key])
        if isinstance(got, KVStoreError):
            raise got
        return got

    @_one_deadline
    async def batch_get(self, keys: Sequence[str]) -> list[bytearray | KVStoreError]:
        """Values (new bytearrays) or errors per key, in input order: through the metadata
        cache, one Lookup per shard for the misses; a cached entry whose read
        fails (removed, evicted, replaced) is looked up once more."""
        keys = key_list(keys, validate=False)   # one str is no batch
        return await self._get_many(keys, [None] * len(keys))

    async def _get_many(self, keys: Sequence[str], dests: Sequence[memoryview | None]
                        ) -> list[bytearray | memoryview | KVStoreError]:
        metas: list = [self._meta.get(k) if isinstance(k, str) else None for k in keys]
        cached = [m is not None for m in metas]
        miss = [i for i, m in enumerate(metas) if m is None]
        if miss:
            for i, m in zip(miss, await self.lookup_cached([keys[i] for i in miss])):
                metas[i] = m
        got = list(await asyncio.gather(*(self._read(m, d) for m, d in zip(metas, dests))))
        stale = [i for i, g in enumerate(got) if cached[i] and isinstance(g, KVStoreError)
                 and not isinstance(g, InvalidArgument)]
        if stale:
            for i in stale:
                self._meta.drop(keys[i])
            fresh = await self.lookup_cached([keys[i] for i in stale])
            for i, g in zip(stale, await asyncio.gather(*(self._read(m, dests[i])
                                                          for i, m in zip(stale, fresh)))):
                got[i] = g
        return got

    @_one_deadline
    async def lookup_cached(self, keys: Sequence[str]) -> list[ObjectMeta | KVStoreError]:
        """:meth:`lookup`, and what it finds goes into the metadata cache."""
        metas = await self.lookup(keys)
        for m in metas:
            if isinstance(m, ObjectMeta):
                self._meta.put(m)
        return metas

    @_one_deadline
    async def get_into(self, key: str, dest: Any) -> int:
        """Read ``key`` straight into ``dest`` (bytearray, memoryview, numpy array, CPU
        tensor), as :meth:`KVClient.get_into`: the value is received into it, no copy.

        Returns:
            The value's size in bytes (``dest`` may be larger).

        Raises:
            NotFound, InvalidArgument (destination too small or read-only),
            ChecksumMismatch, Unavailable.
        """
        meta = self._meta.get(key) if type(key) is str else None
        if meta is not None:                 # the fast path, as get's
            got = await self._read(meta, writable_view(dest))
            if not isinstance(got, KVStoreError):
                return len(got)
            if isinstance(got, InvalidArgument):
                raise got
            self._meta.drop(key)
        (got,) = await self.batch_get_into([key], [dest])
        if isinstance(got, KVStoreError):
            raise got
        return got

    @_one_deadline
    async def batch_get_into(self, keys: Sequence[str], dests: Sequence[Any]
                             ) -> list[int | KVStoreError]:
        """Read each key into its destination; per key the size in bytes or the error
        (as :meth:`batch_get`: cached entries first, one lookup for the rest)."""
        keys = key_list(keys, validate=False)   # one str is no batch
        if len(keys) != len(dests):
            raise InvalidArgument(f"{len(keys)} keys but {len(dests)} destinations")
        views = [writable_view(d) for d in dests]
        got = await self._get_many(keys, views)
        return [g if isinstance(g, KVStoreError) else len(g) for g in got]

    async def _read(self, meta, dest: memoryview | None = None) -> bytearray | KVStoreError:
        """The value (a new bytearray, or ``dest[:size]`` when given) from the first
        replica of ``meta`` that answers it whole and intact, or the last error.

        Replicas go in the entry's order, suspect nodes last; while another is left,
        one is waited for only ``fallback_after_s``, and all within the call's
        deadline. Replicas that failed where a later one answered leave the cached
        entry (as the sync SDK's reads)."""
        if isinstance(meta, KVStoreError):
            return meta
        if dest is not None and len(dest) < meta.size_bytes:
            return InvalidArgument(f"destination of {len(dest)} B for a value of "
                                   f"{meta.size_bytes} B", key=meta.key)
        replicas = meta.replicas
        if len(replicas) > 1 and self._suspects.until:
            now = time.monotonic()
            replicas = sorted(replicas, key=lambda r: self._suspects.suspect(r.node.node_id, now))
        dl = of_call(self.timeout_s, self.failover_wait_s)
        err: KVStoreError | None = None
        failed: set[NodeId] = set()
        for j, r in enumerate(replicas):
            wait_s = dl.bound(self._fallback_after_s if j + 1 < len(replicas) else self.timeout_s)
            if wait_s <= 0:
                err = err or Unavailable("the call's deadline passed before a replica answered",
                                         key=meta.key)
                break
            answer = await self._request(r.node, Op.GET, meta.key, meta.object_id,
                                         max_value_bytes=meta.size_bytes, into=dest,
                                         timeout_s=wait_s)
            if isinstance(answer, KVStoreError):
                err = answer
            elif answer[0] != pb.OK:
                err = error_for_code(answer[0], answer[4], key=meta.key)
            elif answer[2] != meta.size_bytes or value_checksum(answer[5]) != meta.checksum:
                err = error_for_code(pb.CHECKSUM_MISMATCH, "value read does not match its "
                                     "checksum", key=meta.key)
            else:
                if failed:
                    self._meta.drop_replicas(meta.key, meta.object_id, failed)
                return answer[5]
            failed.add(r.node.node_id)
        return err or Unavailable("no replica could be read", key=meta.key)

    # ---- puts ----
    @_one_deadline
    async def put(self, key: str, value: Any, *, replica_num: int | None = None) -> bool:
        """Store ``value`` (bytes-like) under ``key``; one round trip to its nodes.

        Returns:
            True if written, False if equal bytes were already stored.

        Raises:
            KeyConflict (other bytes stored), TooLarge, NoSpace, Unavailable,
            InvalidArgument.
        """
        replicas = replica_num or self.replica_num
        check_replica_num(replicas)
        res = await self._put_one(key, value, replicas)    # no gather, no task of its own
        if isinstance(res, KVStoreError):
            raise res
        return res

    @_one_deadline
    async def batch_put(self, keys: Sequence[str], values: Sequence[Any], *,
                        replica_num: int | None = None) -> list[KVStoreError | None]:
        """Put many values; per key ``None`` on success (written or already present)
        or the error, as :meth:`kvstore.client.KVClient.batch_put`."""
        return [r if isinstance(r, KVStoreError) else None
                for r in await self._put_many(key_list(keys, validate=False), values,
                                              replica_num)]

    async def _put_many(self, keys: Sequence[str], values: Sequence[Any],
                        replica_num: int | None) -> list[bool | KVStoreError]:
        """Per key True (written), False (already present) or the error."""
        if len(keys) != len(values):
            raise InvalidArgument(f"{len(keys)} keys but {len(values)} values")
        replicas = replica_num or self.replica_num
        check_replica_num(replicas)
        return await asyncio.gather(*(self._put_one(k, v, replicas) for k, v in zip(keys, values)))

    async def _put_one(self, key: str, value: Any, replica_num: int) -> bool | KVStoreError:
        try:
            validate_key(key)
            view = readable_view(value)
        except KVStoreError as err:
            return err
        checksum = value_checksum(view)
        shard = (self.shard_map.shard_for_key(key).addresses, replica_num)
        dl = of_call(self.timeout_s, self.failover_wait_s)
        failed: set[NodeId] = set()
        regranted = False
        result: bool | KVStoreError = Unavailable("no target node accepted the value", key=key)
        refreshed = False
        while True:
            try:
                oid, targets = await self._place(shard, key, len(view), replica_num, failed, dl)
            except WrongShard as err:
                if refreshed:
                    err.key = err.key or key
                    return err
                refreshed = True                  # a stale map: refreshed once, as routed calls
                await self.start()
                shard = (self.shard_map.shard_for_key(key).addresses, replica_num)
                continue
            except KVStoreError as err:
                if not failed:
                    # The shard's own answer (no live node, TooLarge, ...), or its
                    # masters could not be asked (their retries spent): it stands.
                    return err
                # Every node failed the value. Unreachable (as KVClient): ask the shard
                # again, with a fresh grant, until its view changes or the call's
                # deadline ends the retries; any other answer (NoSpace, ...) stands.
                if not isinstance(err, Unavailable) or not isinstance(result, Unavailable) \
                        or not dl.may_retry():
                    return result
                g = self._grants.get(shard)
                if g is not None and any(n.address.node_id in failed for n in g.nodes):
                    del self._grants[shard]       # not a newer one, without those nodes
                failed.clear()
                await asyncio.sleep(min(0.1, max(0.0, dl.left_s())))
                continue
            wait_s = dl.bound(self.timeout_s)
            if len(targets) == 1:                 # no task for a single target
                answers = [await self._request(targets[0], Op.PUT, key, oid, len(view),
                                               checksum, view, flags=replica_num,
                                               timeout_s=wait_s)]
            else:
                answers = await asyncio.gather(*(self._request(
                    t, Op.PUT, key, oid, len(view), checksum, view, flags=replica_num,
                    timeout_s=wait_s) for t in targets))
            written, failures = [], []
            for t, a in zip(targets, answers):
                if isinstance(a, KVStoreError):
                    failures.append((t, a))
                elif a[0] != pb.OK:
                    failures.append((t, error_for_code(a[0], a[4], key=key)))
                else:
                    written.append(t)
            result, then = settle(key, written, failures)
            if written:
                self._meta.put(ObjectMeta(key, len(view), checksum, oid,
                                          tuple(Replica(n, TierKind.DRAM) for n in written)))
            if not then or not dl.may_retry():
                return result
            if then == "regrant":
                if regranted:
                    return result
                regranted = True
                self._grants.pop(shard, None)
            failed |= {t.node_id for t, e in failures if not isinstance(e, NotFound)}
            if len(failed) >= _MAX_NODES_TRIED:
                return result

    async def _place(self, slot, key: str, size_bytes: int, replica_num: int,
                     failed: set[NodeId], dl: Deadline) -> tuple[int, list[NodeAddress]]:
        """An object id and targets for one value, from the shard's grant. Many puts
        wait on one fetch and share its ids; those that find them used up when their
        turn comes wait on the next fetch (each brings IDS_PER_GRANT more), within
        the call's deadline.

        Raises:
            WrongShard, TooLarge, Unavailable (as :func:`~kvstore.client.placement.take`,
            or the grant's fetch).
        """
        while True:
            g = await self._grant(slot, key, dl)
            # No await between the check and the take: no other put can take in between.
            if g.usable(time.monotonic()) or not dl.may_retry():
                return take(g, key, size_bytes, replica_num, frozenset(failed), None)

    async def _grant(self, slot, key: str, dl: Deadline) -> Grant:
        """The shard's grant: the one held when usable, else one fetched now (one fetch
        per shard at a time, which every put that needs it waits on, within its
        call's deadline)."""
        g = self._grants.get(slot)
        now = time.monotonic()
        if g is not None and g.usable(now) and g.serves(key):
            if g.wants_refresh(now, IDS_PER_GRANT) and slot not in self._granting:
                self._granting[slot] = self._background(self._fetch_grant(slot))
            return g
        task = self._granting.get(slot)
        if task is None:
            task = self._granting[slot] = self._background(self._fetch_grant(slot, key))
        try:
            async with asyncio.timeout(max(0.0, dl.left_s())):
                await asyncio.shield(task)
        except TimeoutError:
            raise Unavailable("no placement grant within the call's deadline", key=key) from None
        g = self._grants.get(slot)
        if g is None or not g.serves(key):
            raise self._grant_error or Unavailable("no placement grant", key=key)
        return g

    @staticmethod
    def _background(coro) -> asyncio.Task:
        """A task that works for several calls: none of their deadlines applies in it."""
        return asyncio.get_running_loop().create_task(coro, context=unscoped_context())

    async def _fetch_grant(self, slot, key: str = "") -> None:
        addresses, replica_num = slot
        try:
            resp = await self._call(addresses, "GrantPlacement", pb.GrantPlacementRequest(
                replica_num=replica_num, num_ids=IDS_PER_GRANT, key=key))
            self._grants[slot] = grant_of(resp)
        except KVStoreError as err:
            self._grants.pop(slot, None)
            self._grant_error = err
        finally:
            self._granting.pop(slot, None)

    # ---- remove ----
    @_one_deadline
    async def remove(self, key: str, *, reason: RemoveReason | str = RemoveReason.REMOVE) -> None:
        """Delete ``key``; no reader gets the value once this returns.

        Raises:
            NotFound, InvalidArgument (an unknown reason).
        """
        try:
            reason = RemoveReason(reason)
        except ValueError:
            raise InvalidArgument(f"unknown remove reason {reason!r}") from None
        validate_key(key)
        self._meta.drop(key)

        def parse(ks, resp):
            return [wire.object_meta(m) if st.code == pb.OK else
                    error_for_code(st.code, st.message, key=k)
                    for k, st, m in zip(ks, resp.statuses, resp.removed)]
        (removed,) = await self._per_key(
            [key], "Remove", lambda ks: pb.RemoveRequest(keys=ks, reason=reason.value), parse)
        if isinstance(removed, KVStoreError):
            raise removed
        # The nodes drop the version before this returns (as the sync SDK does).
        wait_s = of_call(self.timeout_s, self.failover_wait_s).bound(self.timeout_s)
        await asyncio.gather(*(self._request(r.node, Op.DROP, key, removed.object_id,
                                             timeout_s=wait_s)
                               for r in removed.replicas))
        self._meta.drop(key)             # again: a concurrent get may have cached it
