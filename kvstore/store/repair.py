"""Repair copies: a node copies one of its objects to another node.

The master orders a copy (a :class:`CopyOrder` in a heartbeat reply) when an
object has fewer live replicas than its put asked for. The node holding a
live replica reads its own copy (holding a read reference while it copies,
so the bytes cannot be evicted underneath) and writes it to the target over
the ordinary TCP data plane, as a client put would; the result goes back to
the master in the next heartbeat. The target reports the copy STORED like any
put, which is what makes it a replica.

Thread safety: orders are queued from the heartbeat thread and run on one
copier thread; results are taken by the heartbeat thread under a lock.
"""

from __future__ import annotations

import logging
import queue
import threading

from kvstore.errors import KVStoreError
from kvstore.store.node import StoreNode
from kvstore.transfer.base import WriteItem
from kvstore.rpc import ClientCredentials
from kvstore.tls import client_context
from kvstore.transfer.tcp import NodeConnection, TcpTransport
from kvstore.types import CopyOrder, CopyResult

log = logging.getLogger(__name__)


class Copier:
    """Runs repair copies one at a time off the heartbeat thread.

    Args:
        node: the object table to copy from.
        timeout_s: socket timeout towards the target.
        creds: the node's token (the target authenticates the copy) and TLS files.
    """

    def __init__(self, node: StoreNode, timeout_s: float = 5.0,
                 creds: ClientCredentials | None = None):
        self.node = node
        self.creds = creds or ClientCredentials()
        self._tls = client_context(self.creds.tls) if self.creds.tls is not None else None
        self.timeout_s = timeout_s
        self._orders: queue.Queue[CopyOrder | None] = queue.Queue()
        self._done: list[CopyResult] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="copier", daemon=True)
        self._thread.start()

    def submit(self, order: CopyOrder) -> None:
        self._orders.put(order)

    def take_results(self) -> list[CopyResult]:
        with self._lock:
            done, self._done = self._done, []
            return done

    def stop(self) -> None:
        self._orders.put(None)
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            order = self._orders.get()
            if order is None:
                return
            error = ""
            try:
                self.copy(order)
            except KVStoreError as err:
                error = f"{type(err).__name__}: {err}"
            except OSError as exc:
                error = f"unreachable: {exc}"
            with self._lock:
                self._done.append(CopyResult(order.key, order.object_id, order.target.node_id,
                                             error))

    def copy(self, order: CopyOrder) -> None:
        """Copy (key, object_id) to ``order.target``.

        Raises:
            NotFound: this node no longer holds that version.
            KVStoreError: the target refused it (NoSpace, ...); OSError: unreachable.
        """
        obj = self.node.acquire(order.key, order.object_id, require_dram=False)
        try:
            buf = bytearray(obj.size_bytes)
            self.node.read_into(obj, memoryview(buf))
            checksum, replica_num = obj.checksum, obj.replica_num
        finally:
            self.node.release(obj)
        target = order.target
        tr = TcpTransport(NodeConnection(target.host, target.data_port, self.timeout_s,
                                         token=self.creds.token,
                                         tls=self._tls if target.tls else None))
        try:
            (err,) = tr.write_many([WriteItem(order.key, order.object_id, memoryview(buf),
                                              checksum, replica_num=replica_num)])
        finally:
            tr.close()
        if err is not None:
            raise err
        log.info("repair: copied %s (%d B) to %s", order.key, len(buf), order.target.node_id)
