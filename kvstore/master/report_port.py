"""The master's end of the report link: store nodes' event reports on a plain socket.

The frames, the handshake and why the link exists are in
:mod:`kvstore.transfer.report_link`. This side is an asyncio server (a
protocol: one callback per report) on the master's event loop, on the host
of its gRPC port and a port chosen at start (announced to nodes in
RegisterNode answers). Each report is applied by
:meth:`MasterServicer.apply_report`, the code behind ReportEvents and
StreamEvents, with the same rules: only the shard's leader applies reports
(a standby answers UNAVAILABLE with the leader's address, as its gRPC
calls do), a node is known by its incarnation and the fingerprint of its
token, and with ``--auth`` only a ``node`` or ``admin`` token may report.
Clients' Lookup, Exists and GrantPlacement come on the same port as CALL
frames, answered by the servicer's own handlers (:mod:`kvstore.master.call_port`).

What a connection can make the master hold is bounded: frames are read
only after their declared length was checked (a proof at MAX_PROOF_BYTES,
a report at MAX_MESSAGE_BYTES, the gRPC limit, a call at MAX_CALL_BYTES),
a connection that has not proven itself within :data:`HANDSHAKE_TIMEOUT_S`
is closed, and any frame that is not what the link expects (a wrong type,
an undecodable report) gets an ERROR frame and the connection is closed;
no error here ends the master. What it can make the loop do at once is
bounded too: FRAMES_PER_TURN frames, then the loop's other work takes a turn.
"""

from __future__ import annotations

import asyncio
import logging

from kvstore import tls as tlsmod
from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import Role, fingerprint, new_nonce
from kvstore.errors import KVStoreError, to_status
from kvstore.master.call_port import answer_call
from kvstore.master.counters import MasterCounter as C
from kvstore.rpc import MAX_MESSAGE_BYTES, ServerSecurity
from kvstore.transfer.call_link import MAX_CALL_BYTES
from kvstore.transfer.report_link import HEADER, MAX_PROOF_BYTES, Frame, error_frame, frame

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 10.0
_REPORTERS = (Role.NODE, Role.ADMIN)
#: Frames a link's callback answers before the loop's other work gets a turn.
FRAMES_PER_TURN = 16


class _Refused(Exception):
    """Close the connection after sending this ERROR (code, message)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class _Link(asyncio.Protocol):
    """One node's or client's connection: frames parsed as they arrive, each answered at once.

    A protocol rather than a stream reader: a report costs the loop one callback
    (its bytes) instead of two awaited reads and their futures; the answer is
    written from that callback. Reading pauses while the node does not take
    its answers (the transport's write buffer above its high-water mark), so a
    node that sends reports without reading makes the master hold at most that.
    """

    def __init__(self, port: "ReportPort"):
        self.port = port
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.owner: str | None = None      # the proven token's fingerprint ("" without --auth)
        self.token: str | None = None      # the proven token (None without --auth)
        self.may_report = False            # a node's or an admin's token (any without --auth)
        self.nonce = b""
        self.timer: asyncio.TimerHandle | None = None
        self.turn_pending = False          # frames left for a later turn of the loop
        self.write_paused = False          # the transport's write buffer is full

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.port._links.add(self)
        if self.port.security.tokens is None:
            self.owner, self.may_report = "", True
        else:
            self.nonce = new_nonce()
            # Not proven within HANDSHAKE_TIMEOUT_S: closed (without an ERROR).
            self.timer = asyncio.get_running_loop().call_later(HANDSHAKE_TIMEOUT_S,
                                                               transport.close)
        transport.write(frame(Frame.HELLO, self.nonce))

    def connection_lost(self, exc: Exception | None) -> None:
        self.port._links.discard(self)
        if self.timer is not None:
            self.timer.cancel()

    def pause_writing(self) -> None:
        self.write_paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.write_paused = False
        if not self.turn_pending:
            self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.turn_pending:
            self._serve()

    def _serve(self) -> None:
        """Answer the complete frames at hand, at most FRAMES_PER_TURN of them: with more
        waiting, reading pauses and the rest is served at a later turn of the loop,
        after what else is ready (a link sending calls back to back must not hold
        the loop: heartbeats, other links and gRPC calls take turns)."""
        self.turn_pending = False
        buf = self.buf
        try:
            start = served = 0
            while len(buf) - start >= HEADER.size and not self.transport.is_closing():
                if served == FRAMES_PER_TURN:
                    self.turn_pending = True
                    self.transport.pause_reading()
                    asyncio.get_running_loop().call_soon(self._serve)
                    break
                kind, length = HEADER.unpack_from(buf, start)
                if self.owner is None:
                    expect, limit = (Frame.PROVE,), MAX_PROOF_BYTES
                else:
                    expect, limit = (Frame.REPORT, Frame.CALL), (
                        MAX_CALL_BYTES if kind == Frame.CALL else MAX_MESSAGE_BYTES)
                if kind not in expect:
                    raise _Refused(pb.INVALID_ARGUMENT, f"expected a {expect[0].name} frame, "
                                                        f"got type {kind}")
                if kind == Frame.REPORT and not self.may_report:    # before its body is read
                    raise _Refused(pb.PERMISSION_DENIED, "this token's role may not report "
                                                         "node events")
                if length > limit:
                    raise _Refused(pb.INVALID_ARGUMENT, f"a frame of {length} B "
                                                        f"(at most {limit})")
                end = start + HEADER.size + length
                if len(buf) < end:
                    break
                body = bytes(buf[start + HEADER.size:end])
                start = end
                served += 1
                if self.owner is None:
                    self.owner, self.token, self.may_report = self.port._prove(self.nonce, body)
                    self.timer.cancel()
                elif kind == Frame.CALL:
                    self.transport.write(answer_call(self.port.servicer, self.port.security,
                                                     self.token, body, self.port.observe))
                else:
                    self.transport.write(self.port._answer(body, self.owner))
            del buf[:start]
            if not self.turn_pending and not self.write_paused:
                self.transport.resume_reading()
        except _Refused as refused:
            self.port.servicer.index.counters[C.LINKS_REFUSED] += 1
            log.warning("report link from %s refused: %s",
                        self.transport.get_extra_info("peername"), refused.message)
            self.transport.write(error_frame(refused.code, refused.message))
            self.transport.close()
        except Exception:             # a bug: this link ends, the master goes on
            log.exception("report link failed")
            self.transport.close()


class ReportPort:
    """Serves the report link for ``servicer``.

    Args:
        servicer: the shard's MasterServicer (its leadership, membership and index).
        security: tokens (a proof is required) and TLS (the link is TLS).
        metrics: where clients' calls are counted and timed, as gRPC's are
            (``kvstore_requests_total{op,code}``); None: nowhere.
    """

    def __init__(self, servicer, security: ServerSecurity | None = None, metrics=None):
        self.servicer = servicer
        self.security = security or ServerSecurity()
        self.observe = metrics.observe if metrics is not None else None
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self._links: set[_Link] = set()

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host``:``port`` (0: a free port); returns the port.

        Raises:
            OSError: the address cannot be bound.
        """
        ssl_ctx = tlsmod.server_context(self.security.tls) if self.security.tls else None
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: _Link(self), host.strip("[]"), port,
                                               ssl=ssl_ctx, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    def close(self) -> None:
        """Stop listening and end every link (its node reports on gRPC or to another master)."""
        if self.server is not None:
            self.server.close()
        for link in list(self._links):
            link.transport.close()

    def _prove(self, nonce: bytes, answer: bytes) -> tuple[str, str, bool]:
        """The fingerprint of the token whose proof ``answer`` is, the token, and whether
        it may send reports (a node's or an admin's).

        Raises:
            _Refused: unknown credentials.
        """
        token = self.security.tokens.proof_token(nonce, answer)
        role = self.security.tokens.role_of(token)
        if role is None:
            raise _Refused(pb.UNAUTHENTICATED, "unknown credentials")
        return fingerprint(token), token, role in _REPORTERS

    def _answer(self, body: bytes, owner: str) -> bytes:
        try:
            request = pb.ReportEventsRequest.FromString(body)
        except Exception:            # protobuf's DecodeError: not a report of ours
            raise _Refused(pb.INVALID_ARGUMENT, "an undecodable report") from None
        servicer = self.servicer
        if not servicer.leading():
            refusal = servicer.not_leader()
            return error_frame(refusal.code, refusal.message)
        servicer.index.counters[C.LINK_REPORTS] += 1
        try:
            return frame(Frame.ANSWER, servicer.apply_report(request, owner).SerializeToString())
        except KVStoreError as err:
            log.warning("report refused: %s", err.message)
            return error_frame(to_status(err).code, err.message)
