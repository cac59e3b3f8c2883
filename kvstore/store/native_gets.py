"""The native GET service: a data connection's GET frames answered without Python.

It answers the SHM_TOUCH frames of same-host readers too: a reader that copied a
served copy straight from the segment (``kvstore/transfer/shm_slots.py``) tells
the node with a deferred SHM_TOUCH, which is counted as a read (recency, the
node's gets and bytes, ``shm_touch`` request metrics) and answered OK, as the
Python loop does; a touch of a copy not served goes to Python.

A connection's frame loop (:mod:`kvstore.store.session`) stays Python's. While
it has no reply pending it lends its socket and read-ahead buffer to the native
core (``kvstore/native/serving.hpp``, GIL released), which answers every GET of
a copy the DRAM tier serves, gathering replies and busy-polling for a client
that comes back fast, and gives the loop back the first frame it does not
answer (any other op, a key not served, a fenced node), unread::

    session loop ── no reply pending ──> serve(): serve_gets(index, fd, buffer)
         ^                                    | GET of a served copy: OK + value from
         |                                    |   the segment (readers counted)
         └──── a frame for Python, unread <───┘ anything else: handed back

Which copies are served: the DRAM copy of the confirmed version in service,
from its first read through Python on (``ObjectTable.published``) until the
copy is hidden or freed (a drop, a newer version, an eviction, a demotion:
``DramTier.hide`` / ``free``). A range freed while native sends are still
reading it is freed at the end of the last one (``DramTier.reap``), so bytes
being sent are never reused; objects are immutable. A fenced node serves
nothing natively (the tier's lease, the shortest shard lease); Python then
answers each key as its shard's lease says.

Reads are counted in the index as they are sent (the node's ``gets`` counter
adds them: ``ObjectTable.counted``). What else a read notes comes back with each
call, which ends at the latest before the connection waits (or after 4,096 gets
or 50 ms of them): recency for the eviction policies and a prefetch used, once
per copy read (``ObjectTable.native_reads``), the connection's bytes out and the
request metrics (count and duration histogram, per get from its frame to its
reply's send).

Which connections: plain TCP and Unix sockets with the kernel's timeouts
(``SO_RCVTIMEO`` / ``SO_SNDTIMEO``, as the Python loop uses them) that may read
every key: a node without ``--auth``, or a proven token of a data role whose
scope is every tenant (a tenant's token keeps the Python loop, which answers
other tenants' keys as absent). Each call checks the token against the file as
it is, and a reload of the file (SIGHUP) moves the index's epoch, so a GET after
it is handed back and checked again in Python. A stalled reader ends the
connection as in the Python loop.

Thread safety: one GetPump per connection thread; the index locks itself.
"""

from __future__ import annotations

import logging
import os
import ssl
import time

from kvstore import _native
from kvstore.errors import Unavailable
from kvstore.metrics import REQUEST_BUCKETS
from kvstore.store.stats import NodeCounter
from kvstore.transfer.protocol import REQUEST, Op, StreamEnded

log = logging.getLogger(__name__)

_HANDOFF, _YIELD, _CLOSED, _RECV_ERROR, _SEND_ERROR = range(5)
MAX_GETS_PER_CALL = 4096
MAX_SECONDS_PER_CALL = 0.05


class GetPump:
    """Serves one connection's GETs natively (see the module docstring).

    Args:
        session: the connection (its node, socket, reader, tally and byte counts).
        poll_s: busy-poll this long for a client that came back that fast.
        poll_limit: connections busy-polling at once (native polls).
    """

    def __init__(self, session, poll_s: float, poll_limit: int):
        self.session = session
        self.node = session.node
        self.index = session.node.tier.serving
        self.fd = session.conn.fileno()
        self.options = _native.ServeOptions(poll_s, poll_limit, MAX_GETS_PER_CALL,
                                            MAX_SECONDS_PER_CALL, list(REQUEST_BUCKETS))

    @classmethod
    def of(cls, session, poll_s: float, poll_limit: int) -> "GetPump | None":
        """The session's pump, or None where GETs stay Python's (see the module docstring)."""
        tier = getattr(session.node, "tier", None)
        if (getattr(tier, "serving", None) is None or isinstance(session.conn, ssl.SSLSocket)
                or not (session.kernel_timeouts())):
            return None
        return cls(session, poll_s, poll_limit)

    def takes_next(self) -> bool:
        """Whether the native service should take the connection now: nothing is
        buffered (it waits for the next frame), or the next frame is a GET (or an
        SHM_TOUCH) it serves (the Python loop then sends its replies first). A
        pipelined client's GETs go back to it after a frame Python answered, not only
        once the buffer drains."""
        if not self.session.tenancy.reads_everything():
            return False                   # not proven yet, or a tenant's: Python's
        reader = self.session.reader
        head = reader.peek(REQUEST.size)
        if head is None:
            return True
        op, flags, key_len, parent_len, object_id, _size, _checksum = REQUEST.unpack(head)
        if (op != Op.GET and op != Op.SHM_TOUCH) or flags or parent_len:
            return False
        frame = reader.peek(REQUEST.size + key_len)
        return frame is not None and self.index.serves(bytes(frame[REQUEST.size:]), object_id)

    def answered(self) -> None:
        """The Python loop sent its replies now: a client back within the poll window
        is polled for natively, as after the native replies."""
        self.options.answered_ns = time.monotonic_ns()

    def serve(self) -> None:
        """Answer GET frames natively until one is for Python (left unread).

        Raises:
            StreamEnded: the client closed the connection, or receiving failed (as
                the Python loop's reads raise it).
            Unavailable: sending failed; a reader that took no byte for the send
                timeout is counted (stalled_reads), as the Python loop does.
        """
        while True:
            self.options.epoch = self.index.epoch          # before the token is checked
            if not self.session.tenancy.reads_everything():
                return                     # not proven yet, or a tenant's: Python's
            (status, error, gets, nbytes, hist, seconds, touches, touch_hist,
             touch_seconds) = self.session.reader.lend(self._serve)
            if gets:
                self.session.bytes_out += nbytes
                self.node.note_native_reads(touches)
                if self.session.tally is not None:
                    self.session.tally.observe_many("get", "OK", hist, seconds)
                    self.session.tally.observe_many("shm_touch", "OK", touch_hist,
                                                    touch_seconds)
            if status != _YIELD:       # yielded: accounted, and on
                break
        if status == _HANDOFF:
            return
        if status == _CLOSED:
            raise StreamEnded("connection closed by peer")
        exc = OSError(error, os.strerror(error))
        if status == _RECV_ERROR:
            if isinstance(exc, TimeoutError):      # keepalive went unanswered (as _idle_read)
                self.node.count(NodeCounter.PEERS_LOST)
                log.info("a data client's host stopped answering: connection closed")
            raise StreamEnded(f"connection failed while receiving: {exc}") from exc
        if isinstance(exc, (BlockingIOError, TimeoutError)):
            self.node.count(NodeCounter.STALLED_READS)
            log.warning("a data client took no byte of its replies for %.1f s (%s): "
                        "dropping its connection", self.session.send_timeout_s, exc)
        raise Unavailable(f"client connection lost: {exc}") from exc

    def _serve(self, buffer, start: int, end: int):
        (status, error, start, end, gets, nbytes, hist, seconds, touches, touch_hist,
         touch_seconds) = _native.serve_gets(self.index, self.fd, buffer, start, end, self.options)
        return start, end, (status, error, gets, nbytes, hist, seconds, touches, touch_hist,
                            touch_seconds)
