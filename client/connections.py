"""The client's data connections to the store nodes, and the value-less ops it sends them.

Each thread has its own transport per node (a transport is not
thread-safe), chosen when it connects: the node's shared-memory segment when
it is on this host, else one-sided RDMA when the client has a device and the
node serves it, else TCP. A transfer that fails makes its node *suspect*
(tried last by reads, longer at each failure in a row:
:mod:`kvstore.client.suspects`) and is reported to the master
(``ReportFailure``), which quarantines a node that keeps failing while it
heartbeats.

Each wait on a node has a timeout: ``read_timeout_s``, or less where the
caller says (what is left of its call's deadline, :mod:`kvstore.client.deadline`;
a read that has another replica to try, :attr:`Connections.fallback_after_s`).

Thread safety: a Connections may be shared by threads; each thread only
ever sees its own transports. When a thread ends, its transports are
closed (sockets, segment mappings), so short-lived threads do not pile up
connections.
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from collections import defaultdict
from typing import Callable, Iterable

from kvstore.client.control import Control
from kvstore.client.core.reads import report_node
from kvstore.transfer.reply import Reply
from kvstore.client.deadline import of_call
from kvstore.client.forks import in_forked_child
from kvstore.client.suspects import Suspects, fallback_after_s
from kvstore.errors import KVStoreError, Unavailable
from kvstore.transfer.base import Transport
from kvstore.transfer.protocol import Op, local_address
from kvstore.transfer.shm import SegmentMaps, ShmTransport, host_id
from kvstore.rpc import ClientCredentials
from kvstore.tls import client_context
from kvstore.transfer.tcp import NodeConnection, TcpTransport
from kvstore.types import NodeAddress, NodeId, ObjectMeta

log = logging.getLogger(__name__)
#: How much of a node's segment a same-host client maps ahead of its copies.
CLIENT_PREFAULT_BYTES = 4 << 30


class _ThreadTransports:
    """One thread's data connections (node id -> Transport).

    Held in thread-local storage: when the thread ends, its storage goes and
    the finalizer closes the transports.
    """

    def __init__(self):
        self.map: dict[NodeId, Transport] = {}
        weakref.finalize(self, _close_transports, self.map)

    def close_all(self) -> None:
        _close_transports(self.map)


def _stale(tr: Transport) -> bool:
    """A shared-memory transport whose mapping was retired (its node restarted or
    failed, as another thread found): it reconnects instead of failing its next call."""
    return isinstance(tr, ShmTransport) and tr.segment.closed


def _close_transports(transports: dict[NodeId, Transport]) -> None:
    for tr in list(transports.values()):
        tr.close()
    transports.clear()


class Connections:
    """Per-thread transports to the store nodes, suspects, failure reports, node ops.

    Args:
        control: the client's control plane (failure reports; a closed client).
        prefer_shm: use shared memory with nodes on this host.
        read_timeout_s: data-plane socket timeout (connect and each operation).
        rdma: ``(device, port, gid_index)`` to use RDMA with nodes that shared
            memory cannot reach, or None.
        suspect_s: how long a node that failed a transfer stays suspect (twice
            as long at each further failure in a row, up to
            :data:`~kvstore.client.suspects.MAX_SUSPECT_S`).
        creds: the client's token (every data connection authenticates with it)
            and TLS files (for nodes whose TCP port speaks TLS).

    Attributes:
        host_id: this machine's id (equal to a node's: shared memory can reach it).
        suspect_until: node id -> monotonic time it stops being suspect.
        fallback_after_s: how long a read waits for a replica when it has another
            to try (:func:`kvstore.client.suspects.fallback_after_s`: a quarter of
            ``read_timeout_s``, at least 1 s).
    """

    def __init__(self, control: Control, *, prefer_shm: bool, read_timeout_s: float,
                 rdma: tuple[str, int, int | None] | None, suspect_s: float = 5.0,
                 creds: ClientCredentials | None = None):
        self._control = control
        self.creds = creds or ClientCredentials()
        self._tls = client_context(self.creds.tls) if self.creds.tls is not None else None
        self.prefer_shm = prefer_shm
        self.read_timeout_s = read_timeout_s
        self.rdma = rdma
        self.fallback_after_s = fallback_after_s(read_timeout_s)
        self.host_id = host_id()
        self.suspects = Suspects(suspect_s)
        self.suspect_until = self.suspects.until
        self._local = threading.local()
        # Each thread's transports; weak, so that a finished thread's go away with it.
        self._holders: weakref.WeakSet[_ThreadTransports] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._segments = SegmentMaps(CLIENT_PREFAULT_BYTES)   # one mapping per node, all threads
        in_forked_child(self.forked)

    def transport(self, node: NodeAddress, timeout_s: float | None = None) -> Transport:
        """This thread's transport to ``node``, connected on first use (or after it broke),
        its waits (connect, each socket operation) bounded by ``timeout_s`` (default
        ``read_timeout_s``) until the next call sets another.

        Raises:
            Unavailable: the node cannot be reached, or the client is closed.
        """
        self._control.check_open()
        wait_s = self.read_timeout_s if timeout_s is None else timeout_s
        if wait_s <= 0:
            raise Unavailable(f"no time left to reach store node {node.node_id}")
        holder: _ThreadTransports | None = getattr(self._local, "transports", None)
        if holder is None:
            holder = self._local.transports = _ThreadTransports()
            with self._lock:
                self._holders.add(holder)
        cache = holder.map
        tr = cache.get(node.node_id)
        if tr is not None and not getattr(tr, "conn").broken and not _stale(tr):
            sock = getattr(tr, "conn").sock
            if sock.gettimeout() != wait_s:
                sock.settimeout(wait_s)
            return tr
        if tr is not None:
            tr.close()
        tr = None
        if self.prefer_shm and node.shm_name and node.host_id == self.host_id:
            # Same host: map the node's segment, and send the control frames over
            # its Unix socket when it has one (a cheaper round trip than TCP).
            try:
                segment = self._segments.acquire(node.shm_name, node.node_id)
            except OSError as exc:
                log.info("shared memory %s not usable (%s); using TCP", node.shm_name, exc)
            else:
                try:
                    conn = self.connect(node, unix_address=local_address(node.shm_name),
                                        timeout_s=wait_s)
                except Unavailable:
                    try:
                        conn = self.connect(node, timeout_s=wait_s)
                    except Unavailable:
                        self._segments.release(segment)
                        raise
                tr = ShmTransport(conn, segment, maps=self._segments)
        if tr is None and self.rdma is not None:
            tr = self._rdma_transport(node)
        if tr is None:
            tr = TcpTransport(self.connect(node, timeout_s=wait_s))
        cache[node.node_id] = tr
        return tr

    def shm_transport(self, node_id: NodeId) -> ShmTransport | None:
        """This thread's working shared-memory transport to ``node_id`` if it has one
        already (no connect, no wait); None otherwise.

        Raises:
            Unavailable: the client is closed.
        """
        self._control.check_open()
        holder: _ThreadTransports | None = getattr(self._local, "transports", None)
        tr = holder.map.get(node_id) if holder is not None else None
        if type(tr) is ShmTransport and not tr.conn.broken and not tr.segment.closed:
            return tr
        return None

    def connect(self, node: NodeAddress, unix_address: str | None = None,
                timeout_s: float | None = None) -> NodeConnection:
        """A new, authenticated data connection to ``node`` (TLS when its TCP port speaks
        it), its socket timeout ``timeout_s`` (default ``read_timeout_s``).

        Raises:
            Unavailable: the node cannot be reached, or speaks TLS and this
                client has no CA to check it ($KVSTORE_TLS_CA).
            Unauthenticated: the node refused this client's token.
        """
        tls = None
        if node.tls and unix_address is None:
            if self._tls is None:
                raise Unavailable(f"node {node.node_id} speaks TLS: give the client a CA "
                                  f"(KVClient(tls=...) or $KVSTORE_TLS_CA)")
            tls = self._tls
        return NodeConnection(node.host, node.data_port, timeout_s or self.read_timeout_s,
                              unix_address=unix_address, token=self.creds.token, tls=tls)

    def _rdma_transport(self, node: NodeAddress) -> Transport | None:
        """An RDMA transport to ``node``, or None (logged) when either side cannot do it."""
        from kvstore.transfer.rdma import RdmaTransport

        device, port, gid_index = self.rdma
        conn = self.connect(node)
        try:
            return RdmaTransport(conn, device, port=port, gid_index=gid_index,
                                 timeout_s=self.read_timeout_s)
        except Unavailable as exc:     # RdmaTransport closed the connection
            log.info("RDMA to node %s not usable (%s); using TCP", node.node_id, exc.message)
            return None

    def drop(self, node_id: NodeId) -> None:
        """Close this thread's transport to ``node_id`` (it failed); the next use reconnects.
        Its segment mapping is retired: other threads' transports to the node
        reconnect at their next use, and an idle thread's no longer keeps a dead
        node's segment mapped (``SegmentMaps``)."""
        self._discard(node_id)
        self._segments.retire_node(node_id)

    def node_failed(self, node: NodeAddress, key: str, err: KVStoreError) -> None:
        """A transfer of ``key`` with ``node`` failed (down, hung, broken): try the
        node last (:class:`~kvstore.client.suspects.Suspects`: for ``suspect_s``,
        doubled at each failure in a row), and report it to the master shard of ``key``."""
        self.suspects.failed(node.node_id)
        try:
            self._control.report_failure(key, node.node_id, str(err)[:200])
        except KVStoreError as exc:
            log.debug("could not report failure of %s: %s", node.node_id, exc)

    def transfer(self, node: NodeAddress, items: list, wanted_s: float, verb: str,
                 move: Callable[[Transport], list]) -> list[KVStoreError | None]:
        """``move(transport)`` with ``node`` (read or write ``items``), waiting ``wanted_s``
        at most, cut to what is left of the call's deadline; per item None or the
        error. A node that fails is suspect and reported (by the core's rule,
        :func:`~kvstore.client.core.reads.report_node`); one that answers is not."""
        dl = of_call(self._control.timeout_s, self._control.failover_wait_s)
        wait_s = dl.bound(wanted_s)
        if wait_s <= 0:
            return [Unavailable(f"the call's deadline passed before store node "
                                f"{node.node_id} could be {verb}", key=it.key) for it in items]
        try:
            out = move(self.transport(node, wait_s))
        except Unavailable as err:
            self.drop(node.node_id)
            if report_node(err, dl):
                self.node_failed(node, items[0].key, err)
            return [err] * len(items)
        except BaseException:
            # Interrupted mid-transfer (KeyboardInterrupt, a signal handler's exception):
            # the connection may hold a reply or a value nobody read, which its next
            # request would take as its own. Closed; the next use connects again.
            self._discard(node.node_id)
            raise
        self.node_ok(node.node_id)
        return out

    def _discard(self, node_id: NodeId) -> None:
        """Close this thread's transport to ``node_id`` (the node did not fail)."""
        holder = getattr(self._local, "transports", None)
        tr = holder.map.pop(node_id, None) if holder is not None else None
        if tr is not None:
            tr.close()

    def wait_s(self) -> float:
        """``read_timeout_s`` cut to what is left of the running call's deadline."""
        return of_call(self._control.timeout_s,
                       self._control.failover_wait_s).bound(self.read_timeout_s)

    def node_ok(self, node_id: NodeId) -> None:
        """A transfer with ``node_id`` went through: it is no longer suspect."""
        self.suspects.ok(node_id)

    # ---- value-less ops ----
    def send_ops(self, op: Op, size: int, metas: list[ObjectMeta | KVStoreError],
                 nodes_of: Callable[[ObjectMeta], Iterable[NodeAddress]]
                 ) -> list[KVStoreError | None]:
        """Send one value-less ``op`` frame (with ``size``) per found key and node of
        ``nodes_of(meta)``, pipelined per node.

        Returns:
            Per key None, its lookup error, or the first error one of its nodes answered.
        """
        out: list[KVStoreError | None] = [m if isinstance(m, KVStoreError) else None
                                          for m in metas]
        by_node: dict[NodeId, list[tuple[int, NodeAddress, ObjectMeta]]] = defaultdict(list)
        for i, m in enumerate(metas):
            if not isinstance(m, KVStoreError):
                for node in nodes_of(m):
                    by_node[node.node_id].append((i, node, m))
        for node_id, lst in by_node.items():
            try:
                conn = self.transport(lst[0][1], self.wait_s()).conn
                for _i, _node, m in lst:
                    conn.send(op, m.key, m.object_id, size)
                errs = [Reply.of_header(conn.recv_header()).error(m.key) for _i, _n, m in lst]
            except Unavailable as err:
                self.drop(node_id)
                errs = [err] * len(lst)
            for (i, _node, _m), err in zip(lst, errs):
                out[i] = out[i] or err
        return out

    def warm_up(self, nodes: Iterable[NodeAddress], timeout_s: float) -> bool:
        """Connect this thread to each of ``nodes`` and wait for the same-host
        segments' prefaults (:meth:`SegmentMaps.wait_prefaulted`).

        Raises:
            Unavailable: a node cannot be reached.
        """
        for node in nodes:
            self.transport(node)
        return self._segments.wait_prefaulted(timeout_s)

    def node_stats(self, nodes: Iterable[NodeAddress]) -> dict[str, dict]:
        """Each node's own stats (STATS op), once per node id: node_id -> the node's dict.

        Raises:
            Unavailable: a node cannot be reached.
        """
        out: dict[str, dict] = {}
        for node in nodes:
            if node.node_id in out:
                continue
            try:
                conn = self.transport(node, self.wait_s()).conn
                conn.send(Op.STATS, "")
                reply = Reply.of_header(conn.recv_header())
                if not reply.ok:
                    raise reply.error()
                buf = bytearray(reply.size)
                conn.recv_value_into(reply.size, memoryview(buf))
            except Unavailable:
                self.drop(node.node_id)
                raise
            out[node.node_id] = json.loads(buf)
        return out

    def forked(self) -> None:
        """In a forked child (:mod:`kvstore.client.forks`): forget the parent's
        transports (their sockets are shared with it), each closed in this process
        only; the next use connects again."""
        self._lock = threading.Lock()
        holders, self._holders = list(self._holders), weakref.WeakSet()
        self._local = threading.local()
        for holder in holders:
            holder.close_all()

    def close(self) -> None:
        """Close every thread's transports."""
        with self._lock:
            for holder in list(self._holders):
                holder.close_all()
