"""The master's side of a client's calls on its socket port (:mod:`kvstore.transfer.call_link`).

A CALL frame runs the servicer's own gRPC handler (Lookup, Exists,
GrantPlacement) with a :class:`PortContext` in grpc's context's place: the
handler's checks (bounds, leadership, a warming index), the caller's tenant
scope and its answer are the same as on gRPC; ``context.abort`` raises
:class:`Aborted`, whose status, message and ``ErrorDetail`` go back in a
FAILED frame. The role check gRPC's interceptor makes is made here, per call,
with the token's role and tenants of the table of now (a SIGHUP reload
counts from the next call, as on gRPC).

These handlers never wait on anything but an abort, so a call is run to its
end in the link's callback (its coroutine driven by one ``send``), with no
task: answers go out in the order of the calls.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc

from kvstore.auth import allows
from kvstore.errors import ERROR_DETAIL_KEY
from kvstore.master.counters import MasterCounter as C
from kvstore.master.servicer import METHOD_ROLES
from kvstore.rpc import ServerSecurity
from kvstore.transfer.call_link import CALL_TYPES, failed_body
from kvstore.transfer.report_link import Frame, frame

log = logging.getLogger(__name__)


class Aborted(Exception):
    """A handler's ``context.abort``: the call fails with this status."""

    def __init__(self, status: grpc.StatusCode, message: str, detail: bytes):
        super().__init__(message)
        self.status = status
        self.message = message
        self.detail = detail


class PortContext:
    """What a servicer handler uses of grpc's context, for a call on the socket port:
    the caller's token as its metadata, and ``abort``."""

    __slots__ = ("_metadata",)

    def __init__(self, token: str | None):
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def invocation_metadata(self):
        return self._metadata

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()):
        detail = next((v for k, v in trailing_metadata or () if k == ERROR_DETAIL_KEY), b"")
        raise Aborted(code, details, detail)


def answer_call(servicer, security: ServerSecurity, token: str | None, body: bytes,
                observe: Callable[[str, str, float], None] | None = None) -> bytes:
    """The frame that answers one CALL frame's ``body`` from a link proven by ``token``
    (None without ``--auth``): ANSWER with the response, or FAILED. ``observe(method,
    code, seconds)`` counts the call as gRPC's calls are counted
    (:class:`kvstore.metrics.RequestMetrics`).

    Never raises for what the caller sent (an unknown method, an undecodable request,
    a role that may not call it: FAILED)."""
    t0 = time.perf_counter()
    answer, code = _answer(servicer, security, token, body)
    if observe is not None and body and body[0] in CALL_TYPES:
        observe(CALL_TYPES[body[0]][0], code, time.perf_counter() - t0)
    return answer


def _failed(status: grpc.StatusCode, message: str, detail: bytes = b"") -> tuple[bytes, str]:
    return frame(Frame.FAILED, failed_body(status, message, detail)), status.name


def _answer(servicer, security: ServerSecurity, token: str | None,
            body: bytes) -> tuple[bytes, str]:
    """(the answer frame, its status code's name)."""
    typed = CALL_TYPES.get(body[0]) if body else None
    if typed is None:
        return _failed(grpc.StatusCode.UNIMPLEMENTED, "no such call on the socket port")
    name, request_type, _ = typed
    if security.tokens is not None:
        creds = security.tokens.credentials_of(token)
        if creds is None:
            return _failed(grpc.StatusCode.UNAUTHENTICATED, "this token is no longer known")
        if not allows(creds[0], METHOD_ROLES[name]):
            return _failed(grpc.StatusCode.PERMISSION_DENIED,
                           f"role {creds[0].value} may not call {name}")
    try:
        request = request_type.FromString(body[1:])
    except Exception:              # protobuf's DecodeError
        return _failed(grpc.StatusCode.INVALID_ARGUMENT, f"an undecodable {name} request")
    servicer.index.counters[C.PORT_CALLS] += 1
    handler = getattr(servicer, name)(request, PortContext(token))
    try:
        handler.send(None)
    except StopIteration as done:
        return frame(Frame.ANSWER, done.value.SerializeToString()), "OK"
    except Aborted as failed:
        return _failed(failed.status, failed.message, failed.detail)
    except Exception:              # a bug: this call fails (as gRPC's UNKNOWN), the link goes on
        log.exception("%s on the socket port failed", name)
        return _failed(grpc.StatusCode.UNKNOWN, f"{name} failed")
    handler.close()                # it waited on something: not a call this port runs
    return _failed(grpc.StatusCode.INTERNAL, f"{name} cannot be answered on the socket port")

