"""The report link: a store node's STORED reports to its master shard on a plain socket.

A write is acknowledged only once the node's master shard has applied its
STORED event, so the report's round trip sits on every put's critical path
(:mod:`kvstore.store.events`). On gRPC's streaming call (StreamEvents) that
round trip costs about 450 us here, most of it in the hand-offs between the
threads of Python's synchronous gRPC client (the request iterator's thread,
the channel's, the reader's); the master spends about 30 us applying a report.
The link sends each report from the writer's own thread and reads the answer
there, on one TCP connection per node and master: no thread hand-off on the
node, an asyncio protocol on the master (:mod:`kvstore.master.report_port`).
While answers come within :data:`ANSWER_SPIN_S`, the writer polls for the
next one instead of sleeping in recv (a put's path crosses four wake-ups in a
row; this takes one of them off, for some of the node's CPU).

The master announces the link's port in its RegisterNode answer
(``report_port``; 0: it has none, the node keeps StreamEvents). Frames,
both ways::

    | type u8 | length u32 | body (length bytes) |      big-endian

    HELLO   master -> node, first   a nonce (empty: the master checks no tokens)
    PROVE   node -> master          HMAC-SHA256(token, nonce) (kvstore.auth.proof)
    REPORT  node -> master          a ReportEventsRequest
    ANSWER  master -> node          its ReportEventsResponse, in order
    ERROR   master -> node          code u8 (kvstore Code) + a UTF-8 message; a
                                    refusal of the report (not the leader, another
                                    incarnation) or of the link (bad credentials,
                                    a malformed frame: the master then closes it)
    CALL    client -> master        a client's Lookup, Exists or GrantPlacement on the
                                    same port (kvstore.transfer.call_link)
    FAILED  master -> client        that call's gRPC status, ErrorDetail and message

With ``--auth`` the master sends a nonce and takes a proof by a known token
(the token never crosses the link); only a ``node`` or ``admin`` token's link
may send REPORTs, and the node's identity check is the same as on gRPC (the
token's fingerprint). With TLS the link is TLS (the master's certificate,
the node's client certificate under mutual TLS). Lengths are bounded before anything is read: a proof at
:data:`MAX_PROOF_BYTES`, a report at :data:`kvstore.rpc.MAX_MESSAGE_BYTES`.

Delivery semantics are the event stream's: reports go one at a time (the
node's agent lock), the n-th answer is the n-th report's, and a report whose
answer does not come stays queued in the agent and is sent again (the master
applies events idempotently).

Thread safety: a :class:`ReportLink` is used by one thread at a time (the
agent's lock).
"""

from __future__ import annotations

import enum
import socket
import ssl
import struct
import time

from kvstore import tls as tlsmod
from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import proof
from kvstore.errors import ProtocolError, Unauthenticated, Unavailable, error_for_code
from kvstore.rpc import MAX_MESSAGE_BYTES, ClientCredentials
from kvstore.transfer.protocol import kernel_timeout

HEADER = struct.Struct("!BI")
MAX_PROOF_BYTES = 64
MAX_NONCE_BYTES = 64
MAX_ERROR_BYTES = 4096
#: Wait for an answer by polling the socket for up to this long before sleeping in
#: recv, while answers come that fast: a master on the same host answers within about
#: 100 us, and a blocked recv's sleep and wake-up cost tens of microseconds on a
#: virtual machine, on every put's path (a 64 KiB put: 252-307 -> 186-232 us here).
ANSWER_SPIN_S = 250e-6
_RECV_BYTES = 65536             # what one recv of an answer asks for


class Frame(enum.IntEnum):
    HELLO = 1
    PROVE = 2
    REPORT = 3
    ANSWER = 4
    ERROR = 5
    CALL = 6
    FAILED = 7


def frame(kind: Frame, body: bytes) -> bytes:
    """One frame's bytes."""
    return HEADER.pack(kind, len(body)) + body


def error_frame(code: int, message: str) -> bytes:
    """An ERROR frame: ``code`` (a kvstore Code) and ``message`` (cut at MAX_ERROR_BYTES)."""
    return frame(Frame.ERROR, bytes([code]) + message.encode()[:MAX_ERROR_BYTES - 1])


class LinkBroken(Unavailable):
    """A node's report was not answered: this link or the node's event stream
    (:mod:`kvstore.store.event_stream`) failed, was closed or stayed silent. (A
    master's refusal of a report is raised as its own class: NotLeader, IdTaken...)

    ``timed_out``: the master took the request and did not answer in time (it may
    be hung: a caller asks another master rather than this one again)."""

    def __init__(self, message: str, *, timed_out: bool = False, **kw):
        super().__init__(message, **kw)
        self.timed_out = timed_out


class FrameLink:
    """A blocking link to a master's socket port: the handshake, one request frame out
    and its answer frame in (the report link below; a client's calls in
    :mod:`kvstore.transfer.call_link`). Opened at the first exchange, again after
    a failure.

    Args:
        host, port: the master's host (as its gRPC port is reached) and its socket
            port (announced by the master: RegisterNode's ``report_port``, a
            client call's ``call_port``).
        creds: the token (a proof answers the master's nonce) and TLS files.
        spin_s: poll for an answer this long before sleeping in recv (0: never;
            None: ANSWER_SPIN_S), while answers come that fast.
    """

    def __init__(self, host: str, port: int, creds: ClientCredentials | None = None,
                 spin_s: float | None = None):
        self.host = host.strip("[]")
        self.port = port
        self.creds = creds or ClientCredentials()
        self._sock: socket.socket | None = None
        self._inbox = bytearray()       # received, not read yet
        self._kernel = False            # the socket's timeouts are the kernel's
        self._timeout_s: float | None = None
        self.spin_s = ANSWER_SPIN_S if spin_s is None else spin_s
        self._spin = self.spin_s > 0    # the last answer came within spin_s

    def _read(self, limit: int) -> tuple[int, bytes]:
        """The next frame: (type, body). An answer usually arrives whole and is taken
        in one recv; the read-ahead keeps what came beyond the frame."""
        buf = self._inbox
        while len(buf) < HEADER.size:
            self._fill()
        kind, length = HEADER.unpack_from(buf)
        if length > limit:
            raise ConnectionError(f"a frame of {length} B from the master (at most {limit})")
        end = HEADER.size + length
        while len(buf) < end:
            self._fill()
        body = bytes(buf[HEADER.size:end])
        del buf[:end]
        return kind, body

    def _fill(self) -> None:
        if self._spin and self._kernel:
            data = self._spin_recv()
        else:
            data = self._sock.recv(_RECV_BYTES)
        if not data:
            raise ConnectionError("the master closed the link")
        self._inbox += data

    def _spin_recv(self) -> bytes:
        """recv, polling the socket (MSG_DONTWAIT) for up to ``spin_s`` first."""
        deadline = time.perf_counter() + self.spin_s
        recv = self._sock.recv
        while True:
            try:
                return recv(_RECV_BYTES, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                if time.perf_counter() >= deadline:
                    return recv(_RECV_BYTES)

    def _timeout(self, timeout_s: float) -> None:
        """Sends and receives wait at most ``timeout_s``: in the kernel on a plain
        socket (SO_RCVTIMEO, SO_SNDTIMEO: one syscall a recv), else Python's timeout
        (a poll before each). The kernel's is set again only when it is shorter than
        ``timeout_s`` or over 10 % (and 10 ms) longer: a setsockopt per report costs
        more than the whole recv (each report asks for what is left of its deadline)."""
        now = self._timeout_s
        if now is not None and timeout_s <= now <= timeout_s * 1.1 + 0.01:
            return
        if not (self._kernel and kernel_timeout(self._sock, "SO_RCVTIMEO", timeout_s)
                and kernel_timeout(self._sock, "SO_SNDTIMEO", timeout_s)):
            self._kernel = False
            self._sock.settimeout(timeout_s)
        self._timeout_s = timeout_s

    def _open(self, timeout_s: float) -> None:
        self._kernel, self._timeout_s = False, None
        sock = socket.create_connection((self.host, self.port), timeout=min(timeout_s, 1.0))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.creds.tls is not None:
                sock = tlsmod.client_context(self.creds.tls).wrap_socket(
                    sock, server_hostname=self.host)
            self._sock = sock
            self._inbox.clear()
            kind, nonce = self._read(MAX_NONCE_BYTES)
            if kind != Frame.HELLO:
                raise ConnectionError(f"the master's first frame is {kind}, not HELLO")
            if nonce:
                if not self.creds.token:
                    raise Unauthenticated("the master's socket port needs a token")
                sock.sendall(frame(Frame.PROVE, proof(self.creds.token, nonce)))
            if not isinstance(sock, ssl.SSLSocket):
                sock.settimeout(None)      # blocking: the kernel's timeouts from now on
                self._kernel, self._timeout_s = True, None
        except BaseException:
            self.close()
            sock.close()
            raise

    def exchange(self, kind: Frame, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        """Send one frame and wait (at most ``timeout_s``) for the next frame back.

        Returns:
            The answer's (type, body); the caller closes the link on one it does not
            expect.

        Raises:
            LinkBroken: no answer (the link is closed; the next exchange opens a new one).
            Unauthenticated: the link needs a token and this client has none.
        """
        try:
            if self._sock is None:
                self._open(timeout_s)
            self._timeout(timeout_s)
            sent_at = time.perf_counter()
            self._sock.sendall(frame(kind, body))
            answer = self._read(MAX_MESSAGE_BYTES)
            self._spin = time.perf_counter() - sent_at < self.spin_s
            return answer
        except Unauthenticated:
            raise
        except (socket.timeout, BlockingIOError):     # Python's timeout, or the kernel's
            self.close()
            raise LinkBroken(f"no answer from the master's socket port within "
                             f"{timeout_s:.1f} s", timed_out=True) from None
        except (OSError, ConnectionError) as exc:
            self.close()
            raise LinkBroken(f"the master's socket port: {exc}") from None
        except BaseException:
            # Interrupted (KeyboardInterrupt, an exception from a signal handler) between
            # the send and the whole answer: that answer would be read as the next
            # call's. The link is closed; the next exchange opens a new one.
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None


class ReportLink(FrameLink):
    """One node's link to one master: its reports, one at a time."""

    def report(self, request: pb.ReportEventsRequest, timeout_s: float) -> pb.ReportEventsResponse:
        """Send one report and wait (at most ``timeout_s``) for its answer.

        Raises:
            LinkBroken: no answer (the link is closed; the next report opens a new one).
            ProtocolError: an answer that is not one of ours (the link is closed).
            KVStoreError: the master refused the report (its class: NotLeader,
                IdTaken, Unauthenticated...; the link is closed).
        """
        kind, body = self.exchange(Frame.REPORT, request.SerializeToString(), timeout_s)
        if kind == Frame.ANSWER:
            try:
                return pb.ReportEventsResponse.FromString(body)
            except Exception:       # protobuf's DecodeError: not an answer of ours
                self.close()
                raise ProtocolError("an undecodable answer on the report link") from None
        self.close()
        if kind == Frame.ERROR and body:
            raise error_for_code(body[0] or pb.INTERNAL, body[1:].decode("utf-8", errors="replace"))
        raise ProtocolError(f"an unexpected report-link frame ({kind})")
