"""The kvstore client SDK (synchronous).

Control goes to the master shard owning each key's hash slot (gRPC); value
bytes go straight between the caller's memory and the store nodes (same-host
shared memory when possible, else TCP). Batch forms take and return lists
in input order, with a per-key result: ``None`` / a value for success, a
:class:`~kvstore.errors.KVStoreError` instance for failure.

Thread safety: a client may be shared by threads. Master stubs are
thread-safe; data connections are kept per thread.

Example::

    from kvstore.client import KVClient
    with KVClient("127.0.0.1:50051") as kv:
        kv.put("greeting", b"hello")
        assert kv.get("greeting") == b"hello"
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import grpc

from kvstore.transfer.buffers import readable_view, writable_view
from kvstore.client.meta_cache import MetaCache
from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.errors import (RETRYABLE, InvalidArgument, KVStoreError, Unavailable,
                            WrongShard, error_for_code, from_rpc_error)
from kvstore.keys import validate_key, value_checksum
from kvstore import rpc, wire
from kvstore.shardmap import ShardMap
from kvstore.transfer.base import ReadItem, Transport, WriteItem
from kvstore.transfer.shm import ShmSegment, ShmTransport, host_id
from kvstore.transfer.protocol import Op, local_address
from kvstore.transfer.tcp import NodeConnection, TcpTransport
from kvstore.types import TransportKind

if TYPE_CHECKING:
    from kvstore.client.parts import PartsWriter

log = logging.getLogger(__name__)

#: Read preference among a node's tiers: DRAM serves directly; GPU and SSD are copied up first.
_TIER_READ_RANK = {pb.DRAM: 0, pb.GPU: 1, pb.SSD: 2}

#: Master RPC attempts on UNAVAILABLE (the only retryable error).
_MASTER_ATTEMPTS = 3


class _ThreadTransports:
    """One thread's data connections (node id -> Transport).

    Held in the client's thread-local storage: when the thread ends, its
    storage goes and the transports are closed (sockets, segment mappings),
    so short-lived threads do not pile up connections.
    """

    def __init__(self):
        self.map: dict[str, Transport] = {}
        weakref.finalize(self, _close_transports, self.map)

    def close_all(self) -> None:
        _close_transports(self.map)


def _close_transports(transports: dict[str, Transport]) -> None:
    for tr in list(transports.values()):
        tr.close()
    transports.clear()


class KVClient:
    """Client of a kvstore cluster.

    Args:
        master: address ``host:port`` of any master shard.
        prefer_shm: use shared memory with nodes on this host.
        verify_checksum: check each value read against its xxh3-64 checksum.
            None (default): verify what crossed a socket (TCP); shared-memory
            reads are trusted, since the node verified the bytes when the
            write was committed and the read holds a reference, so they
            cannot change while copied.
        replica_num: default number of replicas per put.
        timeout_s: deadline of each master RPC and data-plane socket operation.
        failover_wait_s: with a shard of several masters (``a|b``), how long
            a call keeps trying them while a new leader is elected.
        read_timeout_s: data-plane socket timeout (connect and each operation;
            default ``timeout_s``). Short (e.g. 2 s) bounds how long a read
            waits on a hung node (SIGSTOP) before it tries the next replica.
        put_wait_s: how long a put waits for another in-flight put of the same
            key to finish before failing with PutInProgress.
        meta_cache_entries: size of the client's metadata cache (0 = off); see
            :mod:`kvstore.client.meta_cache` for what it trades.
        rdma_device: move values with one-sided RDMA through this local device
            (e.g. ``mlx5_0``; needs pyverbs and nodes started with
            ``--rdma-device``) for nodes that shared memory cannot reach; a
            node that cannot do RDMA is used over TCP. None: no RDMA.
        rdma_port, rdma_gid_index: the device's port and GID index.

    Raises:
        Unavailable: the master cannot be reached.
    """

    def __init__(self, master: str, *, prefer_shm: bool = True, verify_checksum: bool | None = None,
                 replica_num: int = 1, timeout_s: float = 10.0, put_wait_s: float = 5.0,
                 meta_cache_entries: int = 65536, read_timeout_s: float | None = None,
                 failover_wait_s: float = 15.0, rdma_device: str | None = None,
                 rdma_port: int = 1, rdma_gid_index: int | None = None):
        self.prefer_shm = prefer_shm
        self.rdma = (rdma_device, rdma_port, rdma_gid_index) if rdma_device else None
        self.failover_wait_s = failover_wait_s
        self.suspect_s = 5.0                # a node that failed a transfer is tried last this long
        self._suspect: dict[str, float] = {}   # node id -> monotonic time it stops being suspect
        self._leader: dict[tuple[str, ...], int] = {}   # a shard's masters -> the last leader
        self.read_timeout_s = read_timeout_s or timeout_s
        self.verify_checksum = verify_checksum
        self.replica_num = replica_num
        self.timeout_s = timeout_s
        self.put_wait_s = put_wait_s
        self._host_id = host_id()
        self._meta = MetaCache(meta_cache_entries)
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.MasterStub] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        # Each thread's transports (see _ThreadTransports); weak, so that a
        # finished thread's go away with it.
        self._holders: weakref.WeakSet[_ThreadTransports] = weakref.WeakSet()
        self._closed = False
        self._seed = tuple(master.split("|"))    # "a|b": one shard's masters, tried in turn
        self.shard_map = self._fetch_shard_map(self._seed)

    # ---- master plumbing ----
    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("this KVClient is closed")

    def _stub(self, address: str) -> pb_grpc.MasterStub:
        self._check_open()
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                ch = rpc.channel(address)
                self._channels[address] = ch
                stub = self._stubs[address] = pb_grpc.MasterStub(ch)
            return stub

    def _rpc(self, address: tuple[str, ...], method: str, request):
        """Call a master RPC; retries only on UNAVAILABLE (RETRYABLE).

        ``address`` names a shard's masters (a leader and standbys): with
        several, the call goes to the one that answered last, and on
        UNAVAILABLE (down, not the leader, a new leader warming up) moves on
        to the next, for up to ``failover_wait_s``.
        """
        if len(address) > 1:
            return self._rpc_ha(address, method, request)
        return self._rpc_one(address[0], method, request)

    def _rpc_ha(self, address: tuple[str, ...], method: str, request):
        addrs = address
        start = self._leader.get(address, 0)
        deadline = time.monotonic() + self.failover_wait_s
        attempt = 0
        while True:
            addr = addrs[(start + attempt) % len(addrs)]
            try:
                resp = getattr(self._stub(addr), method)(request, timeout=self.timeout_s)
                self._leader[address] = (start + attempt) % len(addrs)
                return resp
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if not isinstance(err, RETRYABLE) or time.monotonic() > deadline:
                    raise err from None
            attempt += 1
            if attempt % len(addrs) == 0:
                time.sleep(0.1)

    def _rpc_one(self, address: str, method: str, request):
        for attempt in range(_MASTER_ATTEMPTS):
            try:
                return getattr(self._stub(address), method)(request, timeout=self.timeout_s)
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if not isinstance(err, RETRYABLE) or attempt == _MASTER_ATTEMPTS - 1:
                    raise err from None
                time.sleep(0.05 * 2 ** attempt)
        raise AssertionError("unreachable")

    def _fetch_shard_map(self, address: tuple[str, ...]) -> ShardMap:
        return wire.shard_map(self._rpc(address, "GetShardMap", pb.GetShardMapRequest()))

    def _group(self, keys: Sequence[str]) -> dict[tuple[str, ...], list[int]]:
        """Indices of ``keys`` by owning shard's masters (``str`` keys only)."""
        if len(self.shard_map.ranges) == 1:     # one shard: no per-key hashing
            return {self.shard_map.ranges[0].addresses:
                    [i for i, k in enumerate(keys) if isinstance(k, str)]}
        groups: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for i, k in enumerate(keys):
            if isinstance(k, str):
                groups[self.shard_map.shard_for_key(k).addresses].append(i)
        return groups

    def _routed(self, keys: Sequence[str], call, invalid=lambda err: err) -> list:
        """Run ``call(address, sub_keys) -> list`` per shard, reassembled in input order.

        A key that is not a ``str`` cannot be routed: its result is
        ``invalid(InvalidArgument)`` and no master sees it (the masters check
        every other rule of :func:`validate_key`). On WRONG_SHARD the shard
        map is refreshed once and the call repeated.
        """
        for attempt in range(2):
            out: list = [None if isinstance(k, str) else
                         invalid(InvalidArgument(f"key must be str, got {type(k).__name__}"))
                         for k in keys]
            try:
                for address, idxs in self._group(keys).items():
                    for i, r in zip(idxs, call(address, [keys[i] for i in idxs])):
                        out[i] = r
                return out
            except WrongShard:
                if attempt:
                    raise
                self.shard_map = self._fetch_shard_map(self._seed)
        raise AssertionError("unreachable")

    # ---- data plane plumbing ----
    def _transport(self, node: pb.NodeAddress) -> Transport:
        self._check_open()
        holder: _ThreadTransports | None = getattr(self._local, "transports", None)
        if holder is None:
            holder = self._local.transports = _ThreadTransports()
            with self._lock:
                self._holders.add(holder)
        cache = holder.map
        tr = cache.get(node.node_id)
        if tr is not None and not getattr(tr, "conn").broken:
            return tr
        if tr is not None:
            tr.close()
        tr = None
        if self.prefer_shm and node.shm_name and node.host_id == self._host_id:
            # Same host: map the node's segment, and send the control frames over
            # its Unix socket when it has one (a cheaper round trip than TCP).
            try:
                segment = ShmSegment(node.shm_name)
            except OSError as exc:
                log.info("shared memory %s not usable (%s); using TCP", node.shm_name, exc)
            else:
                try:
                    conn = NodeConnection(node.host, node.data_port, self.read_timeout_s,
                                          unix_address=local_address(node.shm_name))
                except Unavailable:
                    try:
                        conn = NodeConnection(node.host, node.data_port, self.read_timeout_s)
                    except Unavailable:
                        segment.close()
                        raise
                tr = ShmTransport(conn, segment)
        if tr is None and self.rdma is not None:
            tr = self._rdma_transport(node)
        if tr is None:
            tr = TcpTransport(NodeConnection(node.host, node.data_port, self.read_timeout_s))
        cache[node.node_id] = tr
        return tr

    def _rdma_transport(self, node: pb.NodeAddress) -> Transport | None:
        """An RDMA transport to ``node``, or None (logged) when either side cannot do it."""
        from kvstore.transfer.rdma import RdmaTransport

        device, port, gid_index = self.rdma
        conn = NodeConnection(node.host, node.data_port, self.read_timeout_s)
        try:
            return RdmaTransport(conn, device, port=port, gid_index=gid_index,
                                 timeout_s=self.read_timeout_s)
        except Unavailable as exc:     # RdmaTransport closed the connection
            log.info("RDMA to node %s not usable (%s); using TCP", node.node_id, exc.message)
            return None

    def _drop_transport(self, node_id: str) -> None:
        holder = getattr(self._local, "transports", None)
        tr = holder.map.pop(node_id, None) if holder is not None else None
        if tr is not None:
            tr.close()

    # ---- put ----
    def put(self, key: str, value: Any, *, replica_num: int | None = None,
            parent: str | None = None) -> bool:
        """Store ``value`` under ``key`` (objects are immutable).

        Args:
            key: non-empty str, at most 512 UTF-8 bytes.
            value: bytes-like, numpy array or CPU tensor (its raw bytes; 0 B allowed).
            replica_num: replicas on distinct nodes (default: the client's).
            parent: key of the previous block of this value's prefix chain;
                lets the nodes' eviction drop a chain's tail before its head.

        Returns:
            True if written, False if equal bytes were already stored.

        Raises:
            KeyConflict: the key holds different bytes.
            TooLarge: no node could ever hold the value.
            NoSpace: the store is full.
            PutInProgress: another put of the key did not finish within put_wait_s.
            InvalidArgument, Unavailable.
        """
        (res,) = self._put_many([key], [value], replica_num, [parent or ""])
        if isinstance(res, KVStoreError):
            raise res
        return res

    def batch_put(self, keys: Sequence[str], values: Sequence[Any], *,
                  replica_num: int | None = None, parents: Sequence[str | None] | None = None
                  ) -> list[KVStoreError | None]:
        """Put many values; per key ``None`` on success (written or already present) or the error.

        ``parents[i]`` is the previous block's key of ``keys[i]``'s prefix chain (see :meth:`put`).
        """
        parents = [p or "" for p in parents] if parents is not None else [""] * len(keys)
        return [r if isinstance(r, KVStoreError) else None
                for r in self._put_many(keys, values, replica_num, parents)]

    def put_tensor(self, key: str, tensor, *, replica_num: int | None = None) -> bool:
        """Store a contiguous CPU tensor's raw bytes (shape and dtype are the caller's to know)."""
        return self.put(key, tensor, replica_num=replica_num)

    def _put_many(self, keys: Sequence[str], values: Sequence[Any], replica_num: int | None,
                  parents: Sequence[str]) -> list[bool | KVStoreError]:
        if not len(keys) == len(values) == len(parents):
            raise InvalidArgument(f"{len(keys)} keys, {len(values)} values, {len(parents)} parents")
        n = len(keys)
        results: list[bool | KVStoreError] = [False] * n
        views: list[memoryview | None] = [None] * n
        checksums = [0] * n
        todo = []
        for i, (k, v) in enumerate(zip(keys, values)):
            try:
                validate_key(k)
                views[i] = readable_view(v)
                checksums[i] = value_checksum(views[i])
                todo.append(i)
            except KVStoreError as err:
                results[i] = err
        config = pb.PutConfig(replica_num=replica_num or self.replica_num)
        # A key repeated in one batch is put in waves, one occurrence per wave:
        # the first wins, later ones are "already present" or KeyConflict, as
        # for any second put (one PutStart request never names a key twice).
        waves: list[list[int]] = []
        seen: dict[str, int] = {}
        for i in todo:
            w = seen[keys[i]] = seen.get(keys[i], -1) + 1
            if w == len(waves):
                waves.append([])
            waves[w].append(i)
        for wave in waves:
            deadline = time.monotonic() + self.put_wait_s
            backoff = 0.005
            while wave:
                retry = self._put_round(keys, views, checksums, parents, wave, config, results,
                                        time.monotonic() < deadline)
                if not retry:
                    break
                time.sleep(backoff)
                backoff = min(backoff * 2, 0.2)
                wave = retry
        return results

    def _put_round(self, keys, views, checksums, parents, todo: list[int], config: pb.PutConfig,
                   results: list, may_wait: bool) -> list[int]:
        """One PutStart -> write -> PutEnd/PutRevoke round; returns indices to retry."""
        sub_keys = [keys[i] for i in todo]

        def start(address: tuple[str, ...], ks: list[str]) -> list[pb.PutStartResult]:
            pos = {k: j for j, k in enumerate(sub_keys)}
            items = [pb.PutStartItem(key=k, size_bytes=len(views[todo[pos[k]]]),
                                     checksum=checksums[todo[pos[k]]]) for k in ks]
            return list(self._rpc(address, "PutStart",
                                  pb.PutStartRequest(items=items, config=config)).results)

        starts = self._routed(sub_keys, start)
        retry: list[int] = []
        by_node: dict[str, list[tuple[int, pb.NodeAddress]]] = defaultdict(list)
        started: list[tuple[int, int]] = []   # (index, object_id)
        for i, r in zip(todo, starts):
            if r.status.code == pb.PUT_IN_PROGRESS and may_wait:
                retry.append(i)
            elif r.status.code != pb.OK:
                results[i] = error_for_code(r.status.code, r.status.message, key=keys[i])
            elif r.already_present:
                results[i] = False
            else:
                started.append((i, r.object_id))
                for t in r.targets:
                    by_node[t.node_id].append((i, t))
        object_ids = dict(started)
        written: dict[int, list[str]] = defaultdict(list)
        errors: dict[int, KVStoreError] = {}
        for node_id, lst in by_node.items():
            items = [WriteItem(keys[i], object_ids[i], views[i], checksums[i], parents[i])
                     for i, _ in lst]
            try:
                outcome = self._transport(lst[0][1]).write_many(items)
            except Unavailable as err:
                self._drop_transport(node_id)
                self._node_failed(lst[0][1], keys[lst[0][0]], err)
                outcome = [err] * len(items)
            for (i, _), err in zip(lst, outcome):
                if err is None:
                    written[i].append(node_id)
                else:
                    errors.setdefault(i, err)
        ends = [(i, oid) for i, oid in started if written[i]]
        revokes = [(i, oid) for i, oid in started if not written[i]]
        targets = {(i, t.node_id): t for lst in by_node.values() for i, t in lst}
        statuses = self._put_end([(keys[i], oid, checksums[i], written[i], False)
                                  for i, oid in ends])
        for (i, oid), err in zip(ends, statuses):
            results[i] = err or True
            if err is None:
                self._remember(keys[i], len(views[i]), checksums[i], oid,
                               [targets[(i, n)] for n in written[i]])
        self._put_revoke([(keys[i], oid) for i, oid in revokes])
        for i, _ in revokes:
            results[i] = errors.get(i) or Unavailable("no target node accepted the value",
                                                      key=keys[i])
        return retry

    def _put_end(self, items: list[tuple[str, int, int, list[str], bool]]
                 ) -> list[KVStoreError | None]:
        """PutEnd of ``(key, object_id, checksum, written node ids, checksum_at_end)``
        items (the checksum goes along only for checksum_at_end puts); per item
        None or the error."""
        if not items:
            return []
        by_key = {it[0]: it for it in items}

        def end(address: tuple[str, ...], ks: list[str]) -> list[pb.Status]:
            req = pb.PutEndRequest(items=[
                pb.PutEndItem(key=k, object_id=by_key[k][1], written_node_ids=by_key[k][3],
                              checksum=by_key[k][2] if by_key[k][4] else 0) for k in ks])
            return list(self._rpc(address, "PutEnd", req).statuses)

        return [None if st.code == pb.OK else error_for_code(st.code, st.message, key=it[0])
                for it, st in zip(items, self._routed([it[0] for it in items], end))]

    def _put_revoke(self, items: list[tuple[str, int]]) -> None:
        """PutRevoke of ``(key, object_id)`` items (their puts failed)."""
        if not items:
            return
        oids = dict(items)

        def revoke(address: tuple[str, ...], ks: list[str]) -> list[pb.Status]:
            req = pb.PutRevokeRequest(items=[pb.PutRevokeItem(key=k, object_id=oids[k])
                                             for k in ks])
            return list(self._rpc(address, "PutRevoke", req).statuses)

        self._routed([k for k, _ in items], revoke)

    def _remember(self, key: str, size: int, checksum: int, object_id: int,
                  nodes: list[pb.NodeAddress]) -> None:
        """Cache the metadata of a value this client just stored."""
        self._meta.put(pb.ObjectMeta(
            key=key, size_bytes=size, checksum=checksum, object_id=object_id,
            replicas=[pb.Replica(node=n, tier=pb.DRAM) for n in nodes]))

    def put_parts(self, keys: Sequence[str], sizes_bytes: Sequence[int], *,
                  parents: Sequence[str | None] | None = None,
                  replica_num: int | None = None) -> "PartsWriter":
        """Start values that are written part by part, in order, before they are
        complete (a layer-wise KV save); see :class:`kvstore.client.parts.PartsWriter`.

        Raises:
            InvalidArgument: lengths differ, or a size is negative.
            Unavailable: no master.
        """
        from kvstore.client.parts import PartsWriter

        return PartsWriter(self, keys, sizes_bytes, parents, replica_num or self.replica_num)

    # ---- get ----
    def lookup(self, keys: Sequence[str]) -> list[pb.ObjectMeta | KVStoreError]:
        """Metadata (size, checksum, live replicas) per key, or NotFound."""
        def call(address: tuple[str, ...], ks: list[str]) -> list:
            resp = self._rpc(address, "Lookup", pb.LookupRequest(keys=ks))
            return [r.meta if r.status.code == pb.OK else
                    error_for_code(r.status.code, r.status.message, key=k,
                                   redirect=r.status.redirect)
                    for k, r in zip(ks, resp.results)]
        keys = list(keys)
        out = self._routed(keys, call)
        if any(isinstance(r, WrongShard) for r in out):
            self.shard_map = self._fetch_shard_map(self._seed)
            out = self._routed(keys, call)
        for r in out:
            if isinstance(r, pb.ObjectMeta):
                self._meta.put(r)
        return out

    def _resolve(self, keys: Sequence[str]) -> tuple[list, list[bool]]:
        """Metadata per key from the cache, asking the master only for misses.

        Returns:
            (metas or errors, from_cache flags), in input order.
        """
        metas: list = [self._meta.get(k) if isinstance(k, str) else None for k in keys]
        cached = [m is not None for m in metas]
        miss = [i for i, m in enumerate(metas) if m is None]
        if miss:
            for i, r in zip(miss, self.lookup([keys[i] for i in miss])):
                metas[i] = r
        return metas, cached

    def _read_resolved(self, keys: Sequence[str], view_for) -> tuple[list, list]:
        """Resolve metadata, then read each object into ``view_for(i, meta)``.

        ``view_for`` returns the destination view for index ``i`` or raises a
        KVStoreError (e.g. a bad destination). A read through a cached entry
        that misses (removed, evicted, replaced) drops the entry and is tried
        once more with fresh metadata from the master.

        Returns:
            (metas or errors, per-index read error or None).
        """
        metas, cached = self._resolve(keys)
        idx = list(range(len(keys)))
        res: list = [None] * len(keys)
        for attempt in range(2):
            views: list[memoryview | None] = []
            for i in idx:
                views.append(None)
                if isinstance(metas[i], pb.ObjectMeta):
                    try:
                        views[-1] = view_for(i, metas[i])
                    except KVStoreError as err:
                        metas[i] = err
            for i, r in zip(idx, self._read([metas[i] for i in idx], views)):
                res[i] = r
            idx = [i for i in idx if cached[i] and res[i] is not None
                   and not isinstance(res[i], InvalidArgument)]
            if attempt or not idx:
                break
            for i in idx:
                self._meta.drop(keys[i])
                cached[i] = False
            for i, m in zip(idx, self.lookup([keys[i] for i in idx])):
                metas[i] = m
        return metas, res

    def get(self, key: str) -> bytearray:
        """The value of ``key`` as a new bytearray (b"" for a 0-byte value).

        Raises:
            NotFound: no such key (never an empty value instead).
            ChecksumMismatch, Unavailable.
        """
        (res,) = self.batch_get([key])
        if isinstance(res, KVStoreError):
            raise res
        return res

    def batch_get(self, keys: Sequence[str]) -> list[bytearray | KVStoreError]:
        """Values (new bytearrays) or errors per key, in input order."""
        bufs: list[bytearray | None] = [None] * len(keys)

        def view_for(i: int, meta: pb.ObjectMeta) -> memoryview:
            bufs[i] = bytearray(meta.size_bytes)
            return memoryview(bufs[i])

        metas, res = self._read_resolved(keys, view_for)
        return [r if isinstance(r, KVStoreError) else bufs[i] for i, r in enumerate(res)]

    def get_into(self, key: str, dest: Any) -> int:
        """Read ``key`` straight into ``dest`` (bytearray, memoryview, numpy array, CPU tensor).

        Returns:
            The value's size in bytes (``dest`` may be larger).

        Raises:
            NotFound, InvalidArgument (destination too small or read-only),
            ChecksumMismatch, Unavailable.
        """
        view = writable_view(dest)
        meta = self._meta.get(key) if type(key) is str else None
        if meta is not None:
            size = self._read_cached(meta, view)
            if size is not None:
                return size
        (res,) = self.batch_get_into([key], [view])
        if isinstance(res, KVStoreError):
            raise res
        return res

    def _read_cached(self, meta: pb.ObjectMeta, view: memoryview) -> int | None:
        """The single-key fast path: one read of the first replica named by a
        cached entry. Returns the size, or None when anything goes wrong (the
        entry is dropped and the caller takes the general path, which looks the
        key up again and falls back across replicas).

        Raises:
            InvalidArgument: ``view`` is too small (the same everywhere).
        """
        reps = meta.replicas
        if not reps:
            return None
        node = reps[0].node if len(reps) == 1 and not self._suspect else self._read_order(meta)[0].node
        item = ReadItem(meta.key, meta.object_id, meta.size_bytes, meta.checksum, view)
        try:
            tr = self._transport(node)
            verify = (tr.kind is TransportKind.TCP) if self.verify_checksum is None else self.verify_checksum
            (err,) = tr.read_many([item], verify)
        except Unavailable as exc:
            self._drop_transport(node.node_id)
            self._node_failed(node, meta.key, exc)
            err = exc
        if err is None:
            return meta.size_bytes
        if isinstance(err, InvalidArgument):
            raise err
        self._meta.drop(meta.key)
        return None

    def batch_get_into(self, keys: Sequence[str], dests: Sequence[Any]) -> list[int | KVStoreError]:
        """Read each key into its destination; per key the size in bytes or the error."""
        if len(keys) != len(dests):
            raise InvalidArgument(f"{len(keys)} keys but {len(dests)} destinations")
        metas, res = self._read_resolved(keys, lambda i, meta: writable_view(dests[i]))
        return [r if isinstance(r, KVStoreError) else metas[i].size_bytes for i, r in enumerate(res)]

    def get_tensor(self, key: str, out=None, *, shape: Sequence[int] | None = None, dtype=None):
        """Read a tensor stored with :meth:`put_tensor`.

        Args:
            out: a contiguous CPU tensor to fill (zero copy), or
            shape, dtype: to allocate a new one.

        Returns:
            The filled tensor.

        Raises:
            InvalidArgument: the stored size differs from the tensor's size, or no out/shape.
            NotFound, ChecksumMismatch, Unavailable.
        """
        import torch

        if out is None:
            if shape is None or dtype is None:
                raise InvalidArgument("get_tensor needs out= or shape= and dtype=")
            out = torch.empty(tuple(shape), dtype=dtype)
        size = self.get_into(key, out)
        expected = out.numel() * out.element_size()
        if size != expected:
            raise InvalidArgument(f"stored value is {size} B, tensor needs {expected} B", key=key)
        return out

    def _read(self, metas: list, views: list[memoryview | None]) -> list[KVStoreError | None]:
        """Read found objects into views, falling back across replicas."""
        out: list[KVStoreError | None] = [m if isinstance(m, KVStoreError) else None for m in metas]
        # Candidate replicas per index, same-host first, then the fastest tier.
        cands: dict[int, list[pb.NodeAddress]] = {}
        for i, m in enumerate(metas):
            if isinstance(m, KVStoreError):
                continue
            cands[i] = [r.node for r in self._read_order(m)]
        while cands:
            by_node: dict[str, list[int]] = defaultdict(list)
            addr: dict[str, pb.NodeAddress] = {}
            for i, nodes in cands.items():
                if not nodes:
                    out[i] = out[i] or Unavailable("no replica could be read", key=metas[i].key)
                    continue
                by_node[nodes[0].node_id].append(i)
                addr[nodes[0].node_id] = nodes[0]
            nxt: dict[int, list[pb.NodeAddress]] = {}
            for node_id, idxs in by_node.items():
                items = [ReadItem(metas[i].key, metas[i].object_id, metas[i].size_bytes,
                                  metas[i].checksum, views[i]) for i in idxs]
                try:
                    tr = self._transport(addr[node_id])
                    verify = (tr.kind is TransportKind.TCP) if self.verify_checksum is None else self.verify_checksum
                    res = tr.read_many(items, verify)
                except Unavailable as err:
                    self._drop_transport(node_id)
                    self._node_failed(addr[node_id], metas[idxs[0]].key, err)
                    res = [err] * len(items)
                for i, err in zip(idxs, res):
                    out[i] = err
                    # A bad destination fails the same way everywhere; anything else
                    # (node gone, object dropped, bad bytes) tries the next replica.
                    if err is not None and not isinstance(err, InvalidArgument) and len(cands[i]) > 1:
                        nxt[i] = cands[i][1:]
            cands = nxt
        return out

    def _read_order(self, meta: pb.ObjectMeta) -> list[pb.Replica]:
        """Replicas in the order reads try them: nodes that failed lately last,
        then same host first, then by tier speed."""
        now = time.monotonic()
        return sorted(meta.replicas, key=lambda r: (self._suspect.get(r.node.node_id, 0.0) > now,
                                                    r.node.host_id != self._host_id,
                                                    _TIER_READ_RANK.get(r.tier, len(_TIER_READ_RANK))))

    def _node_failed(self, node: pb.NodeAddress, key: str, err: KVStoreError) -> None:
        """A transfer with ``node`` failed (down, hung, broken): try it last for a
        while, and tell the master shard of ``key`` (which quarantines a node
        that keeps failing while it heartbeats)."""
        self._suspect[node.node_id] = time.monotonic() + self.suspect_s
        try:
            self._rpc(self.shard_map.shard_for_key(key).addresses, "ReportFailure",
                      pb.ReportFailureRequest(node_ids=[node.node_id], reason=str(err)[:200]))
        except KVStoreError as exc:
            log.debug("could not report failure of %s: %s", node.node_id, exc)

    # ---- tiers: where objects are, queue lookahead, pins ----
    def locate(self, keys: Sequence[str]) -> list[list[tuple[str, str]] | KVStoreError]:
        """Per key its replicas as ``(node_id, tier name)`` in read order ("DRAM", "GPU",
        "SSD"), fresh from the master, or the error (NotFound)."""
        return [m if isinstance(m, KVStoreError) else
                [(r.node.node_id, pb.Tier.Name(r.tier)) for r in self._read_order(m)]
                for m in self.lookup(keys)]

    def prefetch(self, keys: Sequence[str], deadline_ms: int) -> list[KVStoreError | None]:
        """Queue lookahead: these keys will be read within ``deadline_ms``.

        The node a get would read each key from promotes it to DRAM when it
        is only on a slower tier (in the background: this call does not wait
        for the copy) and protects it from eviction until its first read or
        until the deadline passes. Nodes count prefetches used and wasted.

        Returns:
            Per key None (accepted) or the error (NotFound, Unavailable).

        Raises:
            InvalidArgument: ``deadline_ms`` is not positive.
        """
        if deadline_ms <= 0:
            raise InvalidArgument(f"deadline_ms must be > 0, got {deadline_ms}")
        metas = self.lookup(list(keys))
        targets = [(i, self._read_order(m)[0].node, m.key, m.object_id)
                   for i, m in enumerate(metas) if not isinstance(m, KVStoreError)]
        return self._node_ops(Op.PREFETCH, deadline_ms, targets,
                              [m if isinstance(m, KVStoreError) else None for m in metas])

    def pin(self, key: str, *, ttl_ms: int = 0) -> None:
        """Pin ``key`` on every node holding it.

        Args:
            ttl_ms: 0 for a hard pin (never evicted until :meth:`unpin`);
                > 0 for a soft pin, which makes it go last, for ``ttl_ms``.

        Raises:
            NotFound, Unavailable.
        """
        err = self.batch_pin([key], ttl_ms=ttl_ms)[0]
        if err is not None:
            raise err

    def batch_pin(self, keys: Sequence[str], *, ttl_ms: int = 0) -> list[KVStoreError | None]:
        """Pin each key on every node holding it; per key None or the first error."""
        if ttl_ms < 0:
            raise InvalidArgument(f"ttl_ms must be >= 0, got {ttl_ms}")
        return self._on_all_replicas(list(keys), Op.PIN, ttl_ms)

    def unpin(self, key: str, *, soft: bool = False) -> None:
        """Drop one hard pin of ``key`` (or, with ``soft``, its soft pin) on every node holding it.

        Raises:
            NotFound, Unavailable.
        """
        err = self.batch_unpin([key], soft=soft)[0]
        if err is not None:
            raise err

    def batch_unpin(self, keys: Sequence[str], *, soft: bool = False) -> list[KVStoreError | None]:
        return self._on_all_replicas(list(keys), Op.UNPIN, int(soft))

    def node_stats(self) -> dict[str, dict]:
        """Each live node's own stats, straight from the node (data-plane STATS op):
        node_id -> dict with per-tier ``tiers`` (used, free, evictable, ...) and ``counters``."""
        out: dict[str, dict] = {}
        for st in self.stat():
            for n in st.nodes:
                if not n.alive or n.address.node_id in out:
                    continue
                try:
                    conn = self._transport(n.address).conn
                    conn.send(Op.STATS, "")
                    code, _oid, size, _ck, _off, msg = conn.recv_header()
                    if code != pb.OK:
                        raise error_for_code(code, msg)
                    buf = bytearray(size)
                    conn.recv_value_into(size, memoryview(buf))
                except Unavailable:
                    self._drop_transport(n.address.node_id)
                    raise
                out[n.address.node_id] = json.loads(buf)
        return out

    def _on_all_replicas(self, keys: list[str], op: Op, size: int) -> list[KVStoreError | None]:
        metas = self.lookup(keys)
        targets = [(i, r.node, m.key, m.object_id) for i, m in enumerate(metas)
                   if not isinstance(m, KVStoreError) for r in m.replicas]
        return self._node_ops(op, size, targets,
                              [m if isinstance(m, KVStoreError) else None for m in metas])

    def _node_ops(self, op: Op, size: int, targets: list,
                  out: list[KVStoreError | None]) -> list[KVStoreError | None]:
        """Send one value-less ``op`` frame per (index, node, key, object_id), pipelined per
        node; sets ``out[index]`` to the first error an index gets, and returns ``out``."""
        by_node: dict[str, list] = defaultdict(list)
        for t in targets:
            by_node[t[1].node_id].append(t)
        for node_id, lst in by_node.items():
            try:
                conn = self._transport(lst[0][1]).conn
                for _i, _node, key, oid in lst:
                    conn.send(op, key, oid, size)
                replies = [conn.recv_header() for _ in lst]
            except Unavailable as err:
                self._drop_transport(node_id)
                replies = [(err,)] * len(lst)
            for (i, _node, key, _oid), reply in zip(lst, replies):
                if isinstance(reply[0], KVStoreError):
                    err = reply[0]
                elif reply[0] != pb.OK:
                    err = error_for_code(reply[0], reply[-1], key=key)
                else:
                    continue
                out[i] = out[i] or err
        return out

    # ---- other ops ----
    def exists(self, key: str) -> bool:
        """True iff ``get(key)`` would return a value (never pins or refreshes it)."""
        return self.batch_exists([key])[0]

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Existence per key, in input order (one RPC per shard)."""
        keys = list(keys)

        def call(address: tuple[str, ...], ks: list[str]) -> list[bool]:
            resp = self._rpc(address, "Exists", pb.ExistsRequest(keys=ks))
            for st in resp.statuses:
                if st.code == pb.WRONG_SHARD:
                    raise WrongShard(st.message, redirect=st.redirect)
            return list(resp.exists)
        return self._routed(keys, call, invalid=lambda err: False)

    def remove(self, key: str, *, reason: str = "remove") -> None:
        """Delete ``key``; its memory is freed on the nodes once no reader holds it.

        Raises:
            NotFound: no such key.
        """
        err = self.batch_remove([key], reason=reason)[0]
        if err is not None:
            raise err

    def batch_remove(self, keys: Sequence[str], *, reason: str = "remove") -> list[KVStoreError | None]:
        keys = list(keys)

        for k in keys:
            if isinstance(k, str):
                self._meta.drop(k)

        def call(address: tuple[str, ...], ks: list[str]) -> list:
            resp = self._rpc(address, "Remove", pb.RemoveRequest(keys=ks, reason=reason))
            return [None if s.code == pb.OK else error_for_code(s.code, s.message, key=k)
                    for k, s in zip(ks, resp.statuses)]
        return self._routed(keys, call)

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[pb.ObjectMeta]:
        """Every visible object whose key starts with ``prefix``, in key order, all shards."""
        for r in self.shard_map.ranges:
            cursor = ""
            while True:
                resp = self._rpc(r.addresses, "List", pb.ListRequest(prefix=prefix, start_after=cursor,
                                                                   limit=page_size))
                yield from resp.objects
                if not resp.next_cursor:
                    break
                cursor = resp.next_cursor

    def stat(self) -> list[pb.StatResponse]:
        """Each master shard's stats (nodes, objects, counters)."""
        return [self._rpc(r.addresses, "Stat", pb.StatRequest()) for r in self.shard_map.ranges]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            for holder in list(self._holders):
                holder.close_all()
            for ch in self._channels.values():
                ch.close()

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
