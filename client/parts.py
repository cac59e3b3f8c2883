"""Values written part by part, before they are complete: layer-wise KV saves.

A prefill computes a block's KV one layer at a time, and a block object is
layer-major (``[num_layers, 2, block_tokens, num_kv_heads, head_dim]``), so
layer ``l`` is one contiguous range of the value. A :class:`PartsWriter`
reserves each value's space on its target nodes first, lets the engine copy
each layer in as soon as it is computed, and publishes the values when the
last part is in: the transfer overlaps the rest of the computation instead
of following it.

Protocol (one round trip per phase, batched over the writer's keys)::

    PutStart(checksum_at_end)  master: object id and targets
    SHM_ALLOC(checksum 0)      each same-host target reserves space; offset back
    write(i, offset, part)*    copies into every target's segment, in order,
                               hashing as it goes (xxh3-64, streamed)
    SHM_COMMIT(checksum)       node verifies the bytes against it, reports them
                               STORED (with the checksum) to its master shard and
                               acknowledges once the key is visible

The value is never visible before its commit, so readers see it whole or
not at all, and immutability holds: a key that exists with another size is
KeyConflict at once; one of equal size takes no bytes, but its parts are
still hashed and compared with the stored checksum at commit: "already
present" (False) when equal, KeyConflict when not. A
target the client cannot map (another host) gets the value over TCP at
commit, from a local buffer: correct, without the overlap.

The master's side of it is the SDK's one put protocol
(:class:`kvstore.client.puts.PutProtocol`: ``start``, ``stored``, ``revoke``).

Thread safety: a writer belongs to the thread that made it (it uses that
thread's data connections).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

import xxhash

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.puts import PutProtocol, Written
from kvstore.errors import (InvalidArgument, KeyConflict, KVStoreError, Unavailable,
                            error_for_code)
from kvstore.keys import validate_key
from kvstore.transfer.base import Transport, WriteItem
from kvstore.transfer.buffers import readable_view
from kvstore.transfer.protocol import Op
from kvstore.transfer.shm import ShmTransport
from kvstore.types import NodeAddress, NodeId, ObjectId, ObjectMeta

#: Metadata per key from the master, or the error: :meth:`kvstore.client.KVClient.lookup`.
Lookup = Callable[[Sequence[str]], list[ObjectMeta | KVStoreError]]


class _Target:
    """One replica of one value: where its parts go."""

    __slots__ = ("node", "view", "buffer", "transport")

    def __init__(self, node: NodeAddress, transport: Transport, view: memoryview | None):
        self.node = node
        self.transport = transport
        self.view = view                                   # reserved range in the node's segment
        self.buffer = None if view is not None else bytearray()   # else: sent at commit


class PartsWriter:
    """Values filled part by part and published together (see the module docstring).

    Made by :meth:`kvstore.client.KVClient.put_parts`. Per key ``i``: :meth:`write`
    its parts in order (any sizes that add up to ``sizes_bytes[i]``), then
    :meth:`commit` (all keys, or some as they complete), or :meth:`abort`. As
    a context manager it commits at the end of the block, or aborts when the
    block raises. A writer left open keeps its reservations (node memory)
    until its client closes.

    Attributes:
        results: per key, None while open; after :meth:`commit`: True
            (stored), False (already present) or the error.
    """

    def __init__(self, puts: PutProtocol, lookup: Lookup, keys: Sequence[str],
                 sizes_bytes: Sequence[int], parents: Sequence[str | None] | None,
                 replica_num: int):
        if len(keys) != len(sizes_bytes) or (parents is not None and len(parents) != len(keys)):
            raise InvalidArgument(f"{len(keys)} keys, {len(sizes_bytes)} sizes, "
                                  f"{len(parents) if parents is not None else '-'} parents")
        self._puts = puts
        self._replica_num = replica_num
        self._connections = puts.connections
        self._lookup = lookup
        self.keys = list(keys)
        self.sizes = [int(s) for s in sizes_bytes]
        self.parents = [p or "" for p in parents] if parents is not None else [""] * len(keys)
        n = len(self.keys)
        self.results: list[bool | KVStoreError | None] = [None] * n
        self._oid: list[ObjectId] = [ObjectId(0)] * n
        self._targets: list[list[_Target]] = [[] for _ in range(n)]
        self._written = [0] * n
        self._hash = [xxhash.xxh3_64() for _ in range(n)]
        self._open = [False] * n      # reserved: parts are stored
        self._present = [False] * n   # exists with this size: parts are only hashed
        for i, (k, size) in enumerate(zip(self.keys, self.sizes)):
            try:
                validate_key(k)
                if size < 0:
                    raise InvalidArgument(f"size_bytes must be >= 0, got {size}", key=k)
            except KVStoreError as err:
                self.results[i] = err
        self._start(replica_num)

    # ---- open: PutStart, then reserve on every target ----
    def _start(self, replica_num: int) -> None:
        todo = [i for i in range(len(self.keys)) if self.results[i] is None]
        if len(set(self.keys[i] for i in todo)) != len(todo):
            raise InvalidArgument("a key appears twice in one put_parts")
        placements = self._puts.start([self.keys[i] for i in todo], [self.sizes[i] for i in todo],
                                      replica_num)
        by_node: dict[NodeId, list[tuple[int, NodeAddress]]] = defaultdict(list)
        for i, p in zip(todo, placements):
            if isinstance(p, KVStoreError):
                self.results[i] = p
            elif p.already_present:
                self._present[i] = True
            else:
                self._oid[i] = p.object_id
                self._open[i] = True
                for t in p.targets:
                    by_node[t.node_id].append((i, t))
        for lst in by_node.values():
            self._reserve(lst)
        for i in todo:
            if self._open[i] and not self._targets[i]:
                self._fail(i, Unavailable("no target node could reserve the value",
                                          key=self.keys[i]))

    def _reserve(self, lst: list[tuple[int, NodeAddress]]) -> None:
        node = lst[0][1]
        try:
            tr = self._connections.transport(node)
        except Unavailable:
            return
        if not isinstance(tr, ShmTransport):
            for i, _ in lst:
                self._targets[i].append(_Target(node, tr, None))
            return
        try:
            with tr.using() as seg:     # the reserved ranges' views keep the mapping alive
                replies = tr.control(Op.SHM_ALLOC, [(self.keys[i], self._oid[i], self.sizes[i], 0)
                                                   for i, _ in lst],
                                     [self.parents[i] for i, _ in lst],
                                     [self._replica_num] * len(lst))
                for (i, _), (code, _oid, size, _ck, offset, _msg) in zip(lst, replies):
                    if code == pb.OK:
                        self._targets[i].append(_Target(node, tr,
                                                        seg[offset:offset + self.sizes[i]]))
        except Unavailable:
            self._connections.drop(node.node_id)
            return

    # ---- fill ----
    def write(self, i: int, offset: int, part: Any) -> None:
        """Copy ``part`` (bytes-like, numpy array or CPU tensor) to bytes
        ``[offset, offset + len)`` of value ``i``; parts come in order.

        A key that failed ignores its parts; one already present only hashes them.

        Raises:
            InvalidArgument: out of order, or past the value's size.
        """
        if not (self._open[i] or self._present[i]):
            return
        view = readable_view(part)
        n = len(view)
        if offset != self._written[i] or offset + n > self.sizes[i]:
            raise InvalidArgument(f"part [{offset}, {offset + n}) of a {self.sizes[i]} B value "
                                  f"with {self._written[i]} B written", key=self.keys[i])
        if any(t.view is not None and t.transport.conn.broken for t in self._targets[i]):
            # The connection that holds the reservation is gone (client closed,
            # node failed): the node has given that memory back, maybe to
            # another object. Never write there.
            for t in self._targets[i]:
                t.view = None
            err = Unavailable("the connection holding this value's reservation closed",
                              key=self.keys[i])
            self._fail(i, err)
            raise err
        for t in self._targets[i]:    # none when already present
            if t.view is not None:
                t.view[offset:offset + n] = view
            else:
                t.buffer += view
        self._hash[i].update(view)
        self._written[i] += n

    def is_open(self, i: int) -> bool:
        """True while value ``i`` takes parts (it is not stored yet, and has not failed)."""
        return self._open[i]

    # ---- publish ----
    def commit(self, only: Sequence[int] | None = None) -> list[bool | KVStoreError | None]:
        """Publish the values (all, or those listed in ``only``); returns :attr:`results`.

        Values may be committed in several calls (each as soon as it is
        complete). A value with bytes missing fails with InvalidArgument (and
        is not stored).
        """
        chosen = set(range(len(self.keys)) if only is None else only)
        self._check_present(chosen)
        open_ = [i for i, o in enumerate(self._open) if o and i in chosen]
        for i in open_:
            if self._written[i] != self.sizes[i]:
                self._fail(i, InvalidArgument(f"{self._written[i]} of {self.sizes[i]} B written",
                                              key=self.keys[i]))
        checksum = {i: self._hash[i].intdigest() for i in open_ if self._open[i]}
        written: dict[int, list[NodeAddress]] = defaultdict(list)
        errors: dict[int, KVStoreError] = {}
        by_node: dict[NodeId, list[tuple[int, _Target]]] = defaultdict(list)
        for i in checksum:
            for t in self._targets[i]:
                by_node[t.node.node_id].append((i, t))
        for node_id, lst in by_node.items():
            tr = lst[0][1].transport
            try:
                if isinstance(tr, ShmTransport):
                    replies = tr.control(Op.SHM_COMMIT, [(self.keys[i], self._oid[i], 0, checksum[i])
                                                        for i, _ in lst])
                    outcome = [None if r[0] == pb.OK else error_for_code(r[0], r[5], key=self.keys[i])
                               for (i, _), r in zip(lst, replies)]
                else:
                    outcome = tr.write_many([WriteItem(self.keys[i], self._oid[i],
                                                       memoryview(t.buffer), checksum[i],
                                                       self.parents[i], self._replica_num)
                                             for i, t in lst])
            except Unavailable as err:
                self._connections.drop(node_id)
                outcome = [err] * len(lst)
            for (i, t), err in zip(lst, outcome):
                t.view = None
                if err is None:
                    written[i].append(t.node)
                else:
                    errors.setdefault(i, err)
        # Each commit is acknowledged once the node's STORED report (with the
        # checksum hashed here) is applied by the master: the value is visible.
        ends = [i for i in checksum if written[i]]
        self._puts.stored([Written(self.keys[i], self._oid[i], self.sizes[i], checksum[i],
                                   tuple(written[i])) for i in ends])
        partial = []
        for i in ends:
            self._open[i] = False
            self.results[i] = True
            if len(written[i]) < len(self._targets[i]):
                partial.append((self.keys[i], self._oid[i]))
        for i in checksum:
            if self._open[i]:
                self._fail(i, errors.get(i) or Unavailable("no target node accepted the value",
                                                           key=self.keys[i]))
        if partial:
            self._puts.revoke(partial)      # give back the targets that failed
        return self.results

    def _check_present(self, chosen: set[int]) -> None:
        """Already-present keys: compare the parts' checksum with the stored one."""
        idx = [i for i, p in enumerate(self._present) if p and i in chosen]
        if not idx:
            return
        for i, meta in zip(idx, self._lookup([self.keys[i] for i in idx])):
            self._present[i] = False
            if self._written[i] != self.sizes[i]:
                self.results[i] = InvalidArgument(f"{self._written[i]} of {self.sizes[i]} B "
                                                  "written", key=self.keys[i])
            elif isinstance(meta, KVStoreError):
                self.results[i] = meta   # removed meanwhile: nothing was written
            elif meta.checksum == self._hash[i].intdigest():
                self.results[i] = False
            else:
                self.results[i] = KeyConflict(
                    f"key holds different bytes (checksum {meta.checksum:#x}); objects are "
                    "immutable", key=self.keys[i])

    def abort(self) -> None:
        """Give every open value up: reservations back, puts revoked."""
        for i in [i for i, o in enumerate(self._open) if o]:
            self._fail(i, InvalidArgument("aborted", key=self.keys[i]))
        for i in [i for i, p in enumerate(self._present) if p]:
            self._present[i] = False
            self.results[i] = InvalidArgument("aborted", key=self.keys[i])

    def _fail(self, i: int, err: KVStoreError) -> None:
        """Close value ``i`` with ``err``: abort its reservations, revoke its put."""
        self._open[i] = False
        self.results[i] = err
        for t in self._targets[i]:
            if t.view is not None and isinstance(t.transport, ShmTransport):
                t.view = None
                try:
                    t.transport.control(Op.SHM_ABORT, [(self.keys[i], self._oid[i], 0, 0)])
                except Unavailable:
                    pass   # the node drops a closed connection's reservations itself
        self._targets[i] = []
        try:
            self._puts.revoke([(self.keys[i], self._oid[i])])
        except KVStoreError:
            pass   # the master revokes pending puts at their deadline

    def __enter__(self) -> "PartsWriter":
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        """Commit what is open (an incomplete value fails and is freed), or abort
        everything when the block raised."""
        if exc_type is not None:
            self.abort()
        else:
            self.commit()
