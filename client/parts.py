"""Values written part by part, before they are complete: layer-wise KV saves.

A prefill computes a block's KV one layer at a time, and a block object is
layer-major (``[num_layers, 2, block_tokens, num_kv_heads, head_dim]``), so
layer ``l`` is one contiguous range of the value. A :class:`PartsWriter`
reserves each value's space on its target nodes first, lets the engine copy
each layer in as soon as it is computed, and publishes the values when the
last part is in: the transfer overlaps the rest of the computation instead
of following it.

Protocol (the SDK's one put protocol, :mod:`kvstore.client.puts`: placement
grants, no master call of its own)::

    place                      an object id and target nodes per value from the
                               shard's placement grant (kvstore.client.placement)
    SHM_ALLOC(checksum 0)      each same-host target reserves space; offset back
                               (one that cannot, e.g. NO_SPACE, is replaced by the
                               grant's next node)
    write(i, offset, part)*    copies into every target's segment, in order,
                               hashing as it goes (xxh3-64, streamed)
    SHM_COMMIT(checksum)       node verifies the bytes against it, reports them
                               STORED (with the checksum) to its master shard and
                               acknowledges once the shard applied the report

The shard decides the put when it applies the STORED report, as for every
put (:mod:`kvstore.master.grants`): a new key becomes visible; a key that
holds equal bytes answers ALREADY_PRESENT (the value's result is False), one
that holds other bytes (or another size) KEY_CONFLICT, and the node drops
its copy. So the value is never visible before its commit (readers see it
whole or not at all), immutability holds, and nothing is held at the master
while the parts come: a writer that dies mid-value blocks no other writer of
its key, and its node gives the reservation back when the writer's
connection drops (or sends nothing for the node's ``--write-timeout-s``).
A target the client cannot map (another host) gets the value over TCP at
commit, from a local buffer: correct, without the overlap.

Thread safety: a writer belongs to the thread that made it (it uses that
thread's data connections).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence


from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.core.puts import MAX_NODES_TRIED, settle
from kvstore.client.puts import PutProtocol, Written
from kvstore.errors import (InvalidArgument, KVStoreError, NotFound, Unavailable,
                            error_for_code)
from kvstore.keys import validate_key
from kvstore.rpc import check_replica_num
from kvstore.transfer import codec
from kvstore.transfer.base import Transport, WriteItem
from kvstore.transfer.buffers import readable_view
from kvstore.transfer.protocol import Op
from kvstore.transfer.shm import ShmTransport
from kvstore.types import NodeAddress, NodeId, ObjectId


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
            (stored), False (equal bytes already stored) or the error.

    Raises (at construction):
        InvalidArgument: lengths differ, a key appears twice, or ``replica_num``
            is outside [1, MAX_REPLICAS].
    """

    def __init__(self, puts: PutProtocol, keys: Sequence[str], sizes_bytes: Sequence[int],
                 parents: Sequence[str | None] | None, replica_num: int):
        if len(keys) != len(sizes_bytes) or (parents is not None and len(parents) != len(keys)):
            raise InvalidArgument(f"{len(keys)} keys, {len(sizes_bytes)} sizes, "
                                  f"{len(parents) if parents is not None else '-'} parents")
        check_replica_num(replica_num)
        self._puts = puts
        self._replica_num = replica_num
        self._connections = puts.connections
        self.keys = list(keys)
        self.sizes = [int(s) for s in sizes_bytes]
        self.parents = [p or "" for p in parents] if parents is not None else [""] * len(keys)
        n = len(self.keys)
        self.results: list[bool | KVStoreError | None] = [None] * n
        self._oid: list[ObjectId] = [ObjectId(0)] * n
        self._targets: list[list[_Target]] = [[] for _ in range(n)]
        self._written = [0] * n
        self._hash = [codec.Hasher() for _ in range(n)]
        self._open = [False] * n      # placed and reserved: parts are stored
        for i, (k, size) in enumerate(zip(self.keys, self.sizes)):
            try:
                validate_key(k)
                if size < 0:
                    raise InvalidArgument(f"size_bytes must be >= 0, got {size}", key=k)
            except KVStoreError as err:
                self.results[i] = err
        self._start()

    # ---- open: place from the grant, reserve on every target ----
    def _start(self) -> None:
        todo = [i for i in range(len(self.keys)) if self.results[i] is None]
        if len(set(self.keys[i] for i in todo)) != len(todo):
            raise InvalidArgument("a key appears twice in one put_parts")
        failed: dict[int, set[NodeId]] = defaultdict(set)   # nodes that could not reserve it
        errors: dict[int, KVStoreError] = {}                 # ... and the first one's answer
        while todo:
            by_node: dict[NodeId, list[tuple[int, NodeAddress]]] = defaultdict(list)
            for i in todo:
                try:
                    self._oid[i], targets = self._puts.place(
                        self.keys[i], self.sizes[i], self._replica_num, frozenset(failed[i]))
                except KVStoreError as err:
                    self.results[i] = errors.get(i, err)    # no node left: why the first failed
                    continue
                for t in targets:
                    by_node[t.node_id].append((i, t))
            for lst in by_node.values():
                self._reserve(lst, failed, errors)
            # A value no target could reserve goes to other nodes of the grant.
            todo = [i for i in todo if self.results[i] is None and not self._targets[i]
                    and len(failed[i]) < MAX_NODES_TRIED]
        for i in range(len(self.keys)):
            if self.results[i] is None:
                if self._targets[i]:
                    self._open[i] = True
                else:
                    self.results[i] = errors.get(i) or Unavailable(
                        "no target node could reserve the value", key=self.keys[i])

    def _reserve(self, lst: list[tuple[int, NodeAddress]], failed: dict[int, set[NodeId]],
                 errors: dict[int, KVStoreError]) -> None:
        """Reserve the values of ``lst`` (all on one node); a value the node could
        not take gets the node in ``failed`` and its answer in ``errors``."""
        node = lst[0][1]

        def refused(i: int, err: KVStoreError) -> None:
            failed[i].add(node.node_id)
            errors.setdefault(i, err)

        try:
            tr = self._connections.transport(node)
        except Unavailable as err:
            for i, _ in lst:
                refused(i, err)
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
                for (i, _), (code, _oid, _size, _ck, offset, msg) in zip(lst, replies):
                    if code == pb.OK:
                        self._targets[i].append(_Target(node, tr,
                                                        seg[offset:offset + self.sizes[i]]))
                    else:
                        refused(i, error_for_code(code, msg, key=self.keys[i]))
        except Unavailable as err:
            self._connections.drop(node.node_id)
            for i, _ in lst:
                refused(i, err)

    # ---- fill ----
    def write(self, i: int, offset: int, part: Any) -> None:
        """Copy ``part`` (bytes-like, numpy array or CPU tensor) to bytes
        ``[offset, offset + len)`` of value ``i``; parts come in order.

        A key that failed ignores its parts.

        Raises:
            InvalidArgument: out of order, or past the value's size.
            Unavailable: the connection that holds the value's reservation
                closed (the value fails).
        """
        if not self._open[i]:
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
        for t in self._targets[i]:
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
        is not stored). Per value: True (stored, visible now), False (the key
        holds equal bytes), KeyConflict (it holds other bytes), or the error.
        """
        chosen = set(range(len(self.keys)) if only is None else only)
        open_ = [i for i, o in enumerate(self._open) if o and i in chosen]
        for i in open_:
            if self._written[i] != self.sizes[i]:
                self._fail(i, InvalidArgument(f"{self._written[i]} of {self.sizes[i]} B written",
                                              key=self.keys[i]))
        checksum = {i: self._hash[i].intdigest() for i in open_ if self._open[i]}
        written: dict[int, list[NodeAddress]] = defaultdict(list)
        failures: dict[int, list[tuple[NodeAddress, KVStoreError]]] = defaultdict(list)
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
                    failures[i].append((t.node, err))
        # Each commit is acknowledged once the node's STORED report (with the
        # checksum hashed here) is applied by the master: the value is visible.
        self._puts.stored([Written(self.keys[i], self._oid[i], self.sizes[i], checksum[i],
                                   tuple(written[i])) for i in checksum if written[i]])
        for i in checksum:
            self._open[i] = False
            self._targets[i] = []
            result, _then = settle(self.keys[i], written[i], failures[i])
            if isinstance(result, NotFound):
                # The shard did not know the value's placement (a new leader, or a
                # value held open past its grant): the node dropped the bytes.
                result = Unavailable(f"the shard refused the value's placement ({result.message})"
                                     "; put it again", key=self.keys[i])
            self.results[i] = result
        return self.results

    def abort(self) -> None:
        """Give every open value up: its reservations go back at once."""
        for i in [i for i, o in enumerate(self._open) if o]:
            self._fail(i, InvalidArgument("aborted", key=self.keys[i]))

    def _fail(self, i: int, err: KVStoreError) -> None:
        """Close value ``i`` with ``err`` and abort its reservations (nothing of it
        was reported to the master, so nothing is left there)."""
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

    def __enter__(self) -> "PartsWriter":
        return self

    def __exit__(self, exc_type, *_exc) -> None:
        """Commit what is open (an incomplete value fails and is freed), or abort
        everything when the block raised."""
        if exc_type is not None:
            self.abort()
        else:
            self.commit()
