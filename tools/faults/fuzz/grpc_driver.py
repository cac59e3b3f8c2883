"""Sends master inputs as unary calls on one channel, many in flight.

Each input's bytes go out as they are (identity serializers on a generic
unary call), with its credentials as ``authorization`` metadata, up to
``window`` calls in flight on one HTTP/2 channel. Answers are counted by
gRPC status name. UNKNOWN is what grpc answers when a handler raised an
exception of its own: bad input must get a typed status instead, so it
counts as unexpected (with the details noted). INTERNAL is grpc's answer
to a request it cannot deserialize, a clean refusal.
"""

from __future__ import annotations

import grpc

from kvstore import rpc
from kvstore.errors import ERROR_DETAIL_KEY
from kvstore.tools.faults.fuzz.grpc_inputs import GrpcInput
from kvstore.tools.faults.fuzz.report import SurfaceStats


def _identity(b: bytes) -> bytes:
    return b


class GrpcDriver:
    """The master surface.

    Args:
        address: the master's host:port.
        tokens: role -> token of the run.
        stats: where the surface's counts go.
        timeout_s: each call's deadline (DEADLINE_EXCEEDED counts as no answer).
        window: calls in flight at once.
    """

    def __init__(self, address: str, tokens: dict[str, str], stats: SurfaceStats,
                 timeout_s: float = 10.0, window: int = 32):
        self.tokens = tokens
        self.stats = stats
        self.timeout_s = timeout_s
        self.window = window
        self._channel = grpc.insecure_channel(address, options=rpc.CHANNEL_OPTIONS)
        self._calls: dict[str, grpc.UnaryUnaryMultiCallable] = {}
        self._inflight: list[tuple[GrpcInput, grpc.Future]] = []

    def _call(self, method: str) -> grpc.UnaryUnaryMultiCallable:
        call = self._calls.get(method)
        if call is None:
            call = self._channel.unary_unary(method, request_serializer=_identity,
                                             response_deserializer=_identity)
            self._calls[method] = call
        return call

    def _metadata(self, credentials: str) -> tuple[tuple[str, str], ...]:
        if credentials == "none":
            return ()
        kind, _, value = credentials.partition(":")
        if kind == "bogus":
            return (("authorization", f"Bearer {value}"),)
        if kind == "malformed":
            return (("authorization", value),)
        token = self.tokens.get(credentials)       # an attached cluster may give fewer roles
        return (("authorization", f"Bearer {token}"),) if token else ()

    def send(self, item: GrpcInput) -> None:
        """Start one call; waits for the oldest when ``window`` are in flight."""
        self.stats.inputs += 1
        self.stats.kinds[item.kind.split(":")[0]] += 1
        future = self._call(item.method).future(item.body, timeout=self.timeout_s,
                                                metadata=self._metadata(item.credentials))
        self._inflight.append((item, future))
        if len(self._inflight) >= self.window:
            self._collect(self._inflight[: self.window // 2])
            del self._inflight[: self.window // 2]

    def flush(self) -> None:
        """Wait for every call in flight (end of a batch)."""
        self._collect(self._inflight)
        self._inflight = []

    def _collect(self, calls: list[tuple[GrpcInput, grpc.Future]]) -> None:
        for item, future in calls:
            try:
                future.result()
                code = grpc.StatusCode.OK
                details, answered = "", True
            except grpc.RpcError as exc:
                code, details = exc.code(), exc.details() or ""
                answered = any(k == ERROR_DETAIL_KEY for k, _ in exc.trailing_metadata() or ())
            self.stats.answers[code.name] += 1
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                self.stats.no_answer += 1
                self.stats.note(f"{item.kind} {item.method}: no answer within {self.timeout_s} s")
            elif code is grpc.StatusCode.UNKNOWN:
                self.stats.unexpected += 1
                self.stats.note(f"{item.kind} {item.method} ({item.credentials.split(':')[0]}): "
                                f"UNKNOWN {details}; body {item.body[:64].hex()}")
            elif code is grpc.StatusCode.UNAVAILABLE and not answered:   # not the server's answer
                self.stats.refused += 1

    def close(self) -> None:
        self.flush()
        self._channel.close()
