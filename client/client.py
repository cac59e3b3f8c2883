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

import functools
from typing import Any, Iterator, Sequence

from kvstore.client.core import replies
from kvstore.client.connections import Connections
from kvstore.client.control import Control, sum_tenants
from kvstore.client.deadline import call_scope
from kvstore.client.meta_cache import MetaCache
from kvstore.client.parts import PartsWriter
from kvstore.client.puts import PutProtocol
from kvstore.client.reads import Reads
from kvstore.errors import InvalidArgument, KVStoreError, unwrap
from kvstore.keys import key_list, validate_key
from kvstore.rpc import ClientCredentials
from kvstore.shardmap import ShardMap
from kvstore.tls import TlsFiles
from kvstore.transfer.buffers import writable_view
from kvstore.transfer.protocol import Op
from kvstore.types import NodeAddress, ObjectMeta, RemoveReason, ShardStatus, TenantStatus


def _one_deadline(method):
    """Run a KVClient call under one deadline (:mod:`kvstore.client.deadline`):
    its master calls, retries, waits and transfers all end by it."""
    @functools.wraps(method)
    def bounded(self: "KVClient", *args, **kwargs):
        scope = call_scope(self._control.timeout_s, self._control.failover_wait_s)
        try:
            with scope:
                return method(self, *args, **kwargs)
        finally:
            scope.leave()     # again: a signal handler's exception may have cut __exit__ short
    return bounded


class KVClient:
    """Client of a kvstore cluster.

    A facade over the SDK's parts: :class:`~kvstore.client.control.Control`
    (masters, failover, routing), :class:`~kvstore.client.puts.PutProtocol`,
    :class:`~kvstore.client.reads.Reads` and
    :class:`~kvstore.client.connections.Connections` (data connections, node ops).

    Args:
        master: address ``host:port`` of any master shard (``a|b``: one shard's
            masters, tried in turn).
        prefer_shm: use shared memory with nodes on this host.
        verify_checksum: check each value read against its xxh3-64 checksum.
            None (default): verify what crossed a socket (TCP); shared-memory
            reads are trusted, since the node verified the bytes when the
            write was committed and the read holds a reference, so they
            cannot change while copied.
        replica_num: default number of replicas per put.
        timeout_s: deadline of each master RPC attempt, and the default
            ``read_timeout_s``.
        failover_wait_s: how long after it started a call may still start new
            attempts: another master while a new leader is elected, a master
            warming up, a new grant after nodes failed a put. Every call ends
            by one deadline, ``max(timeout_s, failover_wait_s)`` after it
            started (15 s by default), its retries, waits and transfers
            included (:mod:`kvstore.client.deadline`).
        read_timeout_s: data-plane socket timeout (connect and each operation;
            default ``timeout_s``), cut to what is left of the call's deadline.
            A read that has another replica to try waits a quarter of it (at
            least 1 s) for each, so a hung or cut-off node (SIGSTOP, a link
            down) costs a fraction of it; a node that failed is tried last,
            longer at each failure in a row, and leaves the cached entry a
            fallback went through.
        meta_cache_entries: size of the client's metadata cache (0 = off); see
            :mod:`kvstore.client.meta_cache` for what it trades.
        rdma_device: move values with one-sided RDMA through this local device
            (e.g. ``mlx5_0``; needs pyverbs and nodes started with
            ``--rdma-device``) for nodes that shared memory cannot reach; a
            node that cannot do RDMA is used over TCP. None: no RDMA.
        rdma_port, rdma_gid_index: the device's port and GID index.
        token: this client's token for servers started with ``--auth`` (a
            ``client`` one for the SDK and engines, ``admin`` for evict/list/
            stats); default ``$KVSTORE_TOKEN`` or the file ``$KVSTORE_TOKEN_FILE``.
        tls: TLS files (the CA that signed the servers' certificates, and this
            client's own for mutual TLS); default ``$KVSTORE_TLS_CA`` /
            ``_CERT`` / ``_KEY``; None and no environment: plaintext.

    Raises:
        Unavailable: the master cannot be reached.
        Unauthenticated, PermissionDenied: the master refused the credentials.
    """

    def __init__(self, master: str, *, prefer_shm: bool = True, verify_checksum: bool | None = None,
                 replica_num: int = 1, timeout_s: float = 10.0,
                 meta_cache_entries: int = 65536, read_timeout_s: float | None = None,
                 failover_wait_s: float = 15.0, rdma_device: str | None = None,
                 rdma_port: int = 1, rdma_gid_index: int | None = None,
                 token: str | None = None, tls: TlsFiles | None = None):
        creds = ClientCredentials.resolve(token, tls=tls)
        self._control = Control(tuple(master.split("|")), timeout_s=timeout_s,
                                failover_wait_s=failover_wait_s, creds=creds)
        self._connections = Connections(
            self._control, prefer_shm=prefer_shm, read_timeout_s=read_timeout_s or timeout_s,
            rdma=(rdma_device, rdma_port, rdma_gid_index) if rdma_device else None, creds=creds)
        meta = MetaCache(meta_cache_entries)
        self._puts = PutProtocol(self._control, self._connections, meta,
                                 replica_num=replica_num, prefer_local=prefer_shm)
        self._reads = Reads(self._control, self._connections, meta, verify_checksum)
        self._meta = meta

    @property
    def shard_map(self) -> ShardMap:
        """The shard map calls are routed by (refreshed when a master answers WRONG_SHARD)."""
        return self._control.shard_map

    @shard_map.setter
    def shard_map(self, value: ShardMap) -> None:
        self._control.shard_map = value

    # ---- put ----
    @_one_deadline
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
            True if written, False if equal bytes were already stored. Either
            way the value is visible to every reader once this returns: a node
            acknowledges a write only after its master shard indexed it.

        Raises:
            KeyConflict: the key holds different bytes.
            TooLarge: no node could ever hold the value.
            NoSpace: the store is full.
            InvalidArgument, Unavailable.
        """
        (res,) = self._puts.put_many([key], [value], replica_num, [parent or ""])
        return unwrap(res)

    @_one_deadline
    def batch_put(self, keys: Sequence[str], values: Sequence[Any], *,
                  replica_num: int | None = None, parents: Sequence[str | None] | None = None
                  ) -> list[KVStoreError | None]:
        """Put many values; per key ``None`` on success (written or already present) or the error.

        ``parents[i]`` is the previous block's key of ``keys[i]``'s prefix chain (see :meth:`put`).
        """
        keys = key_list(keys, validate=False)       # a bad key fails alone, below
        parents = [p or "" for p in parents] if parents is not None else [""] * len(keys)
        return [r if isinstance(r, KVStoreError) else None
                for r in self._puts.put_many(keys, values, replica_num, parents)]

    @_one_deadline
    def put_tensor(self, key: str, tensor, *, replica_num: int | None = None) -> bool:
        """Store a contiguous CPU tensor's raw bytes (shape and dtype are the caller's to know)."""
        return self.put(key, tensor, replica_num=replica_num)

    def put_parts(self, keys: Sequence[str], sizes_bytes: Sequence[int], *,
                  parents: Sequence[str | None] | None = None,
                  replica_num: int | None = None) -> PartsWriter:
        """Start values that are written part by part, in order, before they are
        complete (a layer-wise KV save); see :class:`kvstore.client.parts.PartsWriter`.
        Placed like every put (a placement grant: no master call while it is fresh);
        a value that cannot be placed or reserved has its error in ``results`` at once.

        Raises:
            InvalidArgument: lengths differ, a key appears twice, or ``replica_num``
                is outside [1, MAX_REPLICAS].
        """
        return PartsWriter(self._puts, keys, sizes_bytes, parents,
                           replica_num or self._puts.replica_num)

    # ---- get ----
    @_one_deadline
    def lookup(self, keys: Sequence[str]) -> list[ObjectMeta | KVStoreError]:
        """Metadata (size, checksum, live replicas) per key, or NotFound; counts an access."""
        return self._reads.lookup(key_list(keys, validate=False))   # one str is no batch

    @_one_deadline
    def inspect(self, key: str) -> ObjectMeta:
        """One key's metadata, fresh from its shard, without counting an access
        (eviction does not see it as hot; :meth:`lookup` counts one).

        Raises:
            InvalidArgument: a bad key.
            NotFound: no such key.
            Unavailable.
        """
        return self._control.inspect(key)

    @_one_deadline
    def get(self, key: str) -> bytearray:
        """The value of ``key`` as a new bytearray (empty for a 0-byte value).

        Raises:
            NotFound: no such key (never an empty value instead).
            ChecksumMismatch, Unavailable.
        """
        (res,) = self._reads.get_many([key])
        return unwrap(res)

    @_one_deadline
    def batch_get(self, keys: Sequence[str]) -> list[bytearray | KVStoreError]:
        """Values (new bytearrays) or errors per key, in input order."""
        keys = key_list(keys, validate=False)   # one str is no batch
        return self._reads.get_many(keys)

    def get_into(self, key: str, dest: Any) -> int:
        """Read ``key`` straight into ``dest`` (bytearray, memoryview, numpy array, CPU tensor).

        A key this thread read before from a node on this host is copied from
        the node's shared memory with no round trip (:meth:`Reads.get_known
        <kvstore.client.reads.Reads.get_known>`).

        Returns:
            The value's size in bytes (``dest`` may be larger).

        Raises:
            NotFound, InvalidArgument (destination too small or read-only),
            ChecksumMismatch, Unavailable.
        """
        view = writable_view(dest)
        size = self._reads.get_known(key, view)
        return self._get_into(key, view) if size is None else size

    @_one_deadline
    def _get_into(self, key: str, view: memoryview) -> int:
        return self._reads.get_into(key, view)

    @_one_deadline
    def batch_get_into(self, keys: Sequence[str], dests: Sequence[Any]) -> list[int | KVStoreError]:
        """Read each key into its destination; per key the size in bytes or the error."""
        keys = key_list(keys, validate=False)   # one str is no batch
        return self._reads.get_many_into(keys, dests)

    @_one_deadline
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

    # ---- tiers: where objects are, queue lookahead, pins ----
    @_one_deadline
    def locate(self, keys: Sequence[str]) -> list[list[tuple[str, str]] | KVStoreError]:
        """Per key its replicas as ``(node_id, tier name)`` in read order ("DRAM", "GPU",
        "SSD"), fresh from the master, or the error (NotFound)."""
        return [m if isinstance(m, KVStoreError) else
                [(r.node.node_id, r.tier.name) for r in self._reads.read_order(m)]
                for m in self.lookup(keys)]

    @_one_deadline
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
        return self._connections.send_ops(Op.PREFETCH, deadline_ms, self.lookup(keys),
                                          lambda m: (self._reads.read_order(m)[0].node,))

    @_one_deadline
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

    @_one_deadline
    def batch_pin(self, keys: Sequence[str], *, ttl_ms: int = 0) -> list[KVStoreError | None]:
        """Pin each key on every node holding it; per key None or the first error."""
        if ttl_ms < 0:
            raise InvalidArgument(f"ttl_ms must be >= 0, got {ttl_ms}")
        return self._connections.send_ops(Op.PIN, ttl_ms, self.lookup(keys), _replica_nodes)

    @_one_deadline
    def unpin(self, key: str, *, soft: bool = False) -> None:
        """Drop one hard pin of ``key`` (or, with ``soft``, its soft pin) on every node holding it.

        Raises:
            NotFound, Unavailable.
        """
        err = self.batch_unpin([key], soft=soft)[0]
        if err is not None:
            raise err

    @_one_deadline
    def batch_unpin(self, keys: Sequence[str], *, soft: bool = False) -> list[KVStoreError | None]:
        """Unpin each key on every node holding it; per key None or the first error."""
        return self._connections.send_ops(Op.UNPIN, int(soft), self.lookup(keys), _replica_nodes)

    @_one_deadline
    def node_stats(self) -> dict[str, dict]:
        """Each live node's own stats, straight from the node (data-plane STATS op):
        node_id -> dict with per-tier ``tiers`` (used, free, evictable, ...) and ``counters``."""
        return self._connections.node_stats(self._live_nodes())

    def _live_nodes(self) -> Iterator[NodeAddress]:
        """The address of every live node of every shard (one Stat per shard)."""
        return (n.address for st in self.stat() for n in st.nodes if n.alive)

    def warm_up(self, timeout_s: float = 60.0) -> bool:
        """Connect to every live node now, and wait until this client has mapped the
        pages of each same-host node's segment.

        A client maps a segment at its first same-host operation and faults its
        pages in on a background thread (about 1.7 us per 4 KiB page: 1.3 s of
        one core for a 3 GiB segment); until that ends, copies compete with it
        for the CPU. An engine calls this before serving, a benchmark before
        measuring.

        Returns:
            True when every prefault ended within ``timeout_s`` (s).

        Raises:
            Unavailable: a master or a node cannot be reached.
        """
        return self._connections.warm_up(self._live_nodes(), timeout_s)

    # ---- other ops ----
    @_one_deadline
    def exists(self, key: str) -> bool:
        """True iff ``get(key)`` would return a value (never pins or refreshes it).

        Raises:
            InvalidArgument: a bad key (as ``get`` raises; :meth:`batch_exists`
                answers False for it).
            Unavailable.
        """
        validate_key(key)
        return self.batch_exists([key])[0]

    @_one_deadline
    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """Existence per key, in input order (one RPC per shard).

        Raises:
            InvalidArgument: one str for ``keys`` (a bad key is just absent: False).
            WrongShard: no shard owns a key, even after refreshing the shard map.
            Unavailable.
        """
        out = self._control.exists(key_list(keys, validate=False))
        for r in out:
            if isinstance(r, KVStoreError):
                raise r
        return out

    @_one_deadline
    def remove(self, key: str, *, reason: RemoveReason | str = RemoveReason.REMOVE) -> None:
        """Delete ``key``; its memory is freed on the nodes once no reader holds it.

        Args:
            reason: why (``RemoveReason.EVICT`` for an operator's eviction); the
                master counts removes and evictions apart.

        Raises:
            NotFound: no such key.
            InvalidArgument: an unknown reason.
        """
        err = self.batch_remove([key], reason=reason)[0]
        if err is not None:
            raise err

    @_one_deadline
    def batch_remove(self, keys: Sequence[str], *, reason: RemoveReason | str = RemoveReason.REMOVE
                     ) -> list[KVStoreError | None]:
        """Delete each key; per key None or the error (NotFound).

        Raises:
            InvalidArgument: an unknown reason.
        """
        keys = key_list(keys, validate=False)   # one str is no batch
        reason = replies.remove_reason(reason)
        keys = list(keys)
        for k in keys:
            if isinstance(k, str):
                self._meta.drop(k)
        removed = self._control.remove(keys, reason)
        # The nodes drop what was removed before this returns (their master's drop
        # orders come later, with a heartbeat): no reader with a cached copy of the
        # metadata gets the value afterwards. A node that cannot be reached gets
        # the drop order; it cannot serve the value meanwhile either.
        found = [m for m in removed if not isinstance(m, KVStoreError) and m.object_id]
        if found:
            self._connections.send_ops(Op.DROP, 0, found, _replica_nodes)
        for k in keys:
            if isinstance(k, str):
                self._meta.drop(k)       # again: a concurrent get may have cached it
        return [m if isinstance(m, KVStoreError) else None for m in removed]

    def list(self, prefix: str = "", *, page_size: int = 1000) -> Iterator[ObjectMeta]:
        """Every visible object whose key starts with ``prefix``, in key order, all shards
        (counts no access)."""
        yield from self._control.list(prefix, page_size)

    @_one_deadline
    def stat(self) -> list[ShardStatus]:
        """Each master shard's stats (nodes, objects, counters)."""
        return self._control.stat()

    @_one_deadline
    def tenant_stats(self) -> list[TenantStatus]:
        """Each tenant the caller's token may see (all for admin and without --auth):
        its objects, bytes, hard limits and counters, summed over the shards, by name.

        Raises:
            PermissionDenied: a node token. Unavailable: a shard did not answer.
        """
        return sum_tenants(self._control.tenant_stats())

    def answering_master(self, shard_id: int) -> str:
        """host:port of the master of shard ``shard_id`` that answered the latest call
        to it (after :meth:`stat`, the shard's leader); "" for a shard not in the map."""
        for r in self.shard_map.ranges:
            if r.shard_id == shard_id:
                return self._control.answering(r.addresses)
        return ""

    def close(self) -> None:
        """Close the data connections of every thread and the master channels;
        later calls raise Unavailable."""
        if self._control.closed:
            return
        self._control.close()
        self._connections.close()

    def __enter__(self) -> "KVClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _replica_nodes(meta: ObjectMeta):
    return [r.node for r in meta.replicas]
