"""A client's Lookup, Exists and GrantPlacement on its master's socket port, not gRPC.

One unary gRPC call costs a master 250-390 us of CPU here and the client
120-220 us, nearly all of it gRPC's own machinery (a health check with no
work in its handler costs a grpc.aio server 250 us on this 2-core machine);
a client's first read of a key, a put whose grant ran out and an engine's
prefix lookup each pay it. The master's socket port, where its nodes send
STORED reports (:mod:`kvstore.transfer.report_link`: the frames, the
handshake, TLS), takes these three calls too::

    CALL    client -> master   method u8 (CALL_METHODS) + the request's protobuf bytes
    ANSWER  master -> client   the response's protobuf bytes
    FAILED  master -> client   status u8 (the gRPC status code's number) + detail
                               length u16 + the ErrorDetail's bytes + a UTF-8 message:
                               the call failed as it would on gRPC (decoded by the
                               same rule, kvstore.errors.error_from_status)

The master runs the call through the servicer's own handler, so the checks,
the tenant scope and the answers are gRPC's (:mod:`kvstore.master.call_port`).
It announces the port in those calls' gRPC answers (``call_port``; 0: none):
the SDK's first call to a master goes through gRPC, the later ones through
the link. The link serves one call at a time; a call that finds it busy, or
broken, goes through gRPC (:class:`kvstore.client.control.Control`), and a
master whose link broke is asked through gRPC for PORT_RETRY_S.

Thread safety: a :class:`CallLink` is used under its ``lock`` only.
"""

from __future__ import annotations

import struct
import threading
import time
from typing import Callable

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import KVStoreError, ProtocolError, decode_detail, error_for_code, \
    error_from_status
from kvstore.transfer.report_link import Frame, FrameLink

#: The calls the socket port takes: name -> its method number in a CALL frame.
CALL_METHODS: dict[str, int] = {"Lookup": 1, "Exists": 2, "GrantPlacement": 3}
#: Method number -> (name, request type, response type).
CALL_TYPES: dict[int, tuple[str, type, type]] = {
    1: ("Lookup", pb.LookupRequest, pb.LookupResponse),
    2: ("Exists", pb.ExistsRequest, pb.ExistsResponse),
    3: ("GrantPlacement", pb.GrantPlacementRequest, pb.GrantPlacementResponse),
}
#: The largest CALL frame a master reads: MAX_KEYS_PER_CALL keys of MAX_KEY_BYTES, and
#: protobuf's few bytes a key (a longer call is refused, and its link closed).
MAX_CALL_BYTES = 8 << 20
#: After a master's link broke, its calls stay on gRPC this long (a port that a
#: firewall drops would cost every call a connect attempt).
PORT_RETRY_S = 30.0
_FAILED = struct.Struct("!BH")
_STATUS_BY_NUMBER = {s.value[0]: s for s in grpc.StatusCode}


def port_retry(links: dict, failed: dict[str, float], address: str) -> bool:
    """Whether a client should open a link to ``address``'s socket port now: it has none
    in ``links``, and none failed in the last PORT_RETRY_S (``failed``: address ->
    monotonic s of the failure)."""
    return address not in links and time.monotonic() - failed.get(address, -PORT_RETRY_S) \
        >= PORT_RETRY_S


def failed_body(status: grpc.StatusCode, message: str, detail: bytes = b"") -> bytes:
    """A FAILED frame's body: ``status``, the ``ErrorDetail`` bytes (empty: none) and
    ``message`` (cut at 4 KiB)."""
    return _FAILED.pack(status.value[0], len(detail)) + detail + message.encode()[:4096]


def error_of_failed(body: bytes) -> KVStoreError:
    """The error a FAILED frame's body stands for (ProtocolError: not a FAILED body)."""
    if len(body) < _FAILED.size:
        return ProtocolError("a short FAILED frame on the master's socket port")
    number, length = _FAILED.unpack_from(body)
    end = _FAILED.size + length
    status = _STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)
    detail = decode_detail(body[_FAILED.size:end]) if length else None
    message = body[end:].decode("utf-8", errors="replace") or status.name
    return error_from_status(status, message, detail)


class CallLink(FrameLink):
    """A client's link to one master's socket port (see the module docstring).

    Args:
        host, port: the master's host (as its gRPC address names it) and the
            ``call_port`` it announced.
        creds: the client's token and TLS files.
    """

    def __init__(self, host: str, port: int, creds=None):
        # No polling for the answer (spin_s 0): it comes in 50-150 us, and the client's
        # CPU is its engine's (polling took 120-170 us of wall time to 110-120; the
        # client's CPU 65-75 us a Lookup to 120-130).
        super().__init__(host, port, creds, spin_s=0.0)
        self.lock = threading.Lock()

    def call(self, method: str, request, timeout_s: float):
        """Send one call and wait (at most ``timeout_s``) for its answer.

        Returns:
            The response message (the type gRPC's call of ``method`` returns).

        Raises:
            LinkBroken: no answer (the link is closed: the call may go through gRPC).
            KVStoreError: the call failed on the master (the class gRPC would have
                raised: NotLeader, IndexIncomplete, InvalidArgument...), or the
                master refused the link (Unauthenticated, PermissionDenied: closed).
            ProtocolError: an answer that is not one of ours (the link is closed).
        """
        number = CALL_METHODS[method]
        kind, body = self.exchange(Frame.CALL, bytes([number]) + request.SerializeToString(),
                                   timeout_s)
        return answer_of(number, kind, body, self.close)


def answer_of(number: int, kind: int, body: bytes, close: Callable[[], None]):
    """The response in the answer (``kind``, ``body``) to a call of method ``number``;
    ``close`` is called first when the link is of no further use.

    Raises:
        KVStoreError: a FAILED answer's error (the link stays), or the master's refusal
            of the link (an ERROR frame).
        ProtocolError: an answer that is not one of ours.
    """
    if kind == Frame.ANSWER:
        try:
            return CALL_TYPES[number][2].FromString(body)
        except Exception:       # protobuf's DecodeError: not an answer of ours
            close()
            raise ProtocolError("an undecodable answer on the master's socket port") from None
    if kind == Frame.FAILED:
        err = error_of_failed(body)
        if isinstance(err, ProtocolError):
            close()
        raise err
    close()
    if kind == Frame.ERROR and body:
        raise error_for_code(body[0] or pb.INTERNAL, body[1:].decode("utf-8", errors="replace"))
    raise ProtocolError(f"an unexpected frame ({kind}) on the master's socket port")
