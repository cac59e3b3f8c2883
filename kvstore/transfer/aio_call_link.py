"""The asyncio SDK's link to a master's socket port: Lookup, Exists and GrantPlacement
as CALL frames (the frames, and why: :mod:`kvstore.transfer.call_link`).

Calls are pipelined on the one connection: each is written as it is made and
the n-th answer is the n-th call's (the master answers in order). A call
that is not answered within its timeout closes the link, failing the calls
behind it with :class:`~kvstore.transfer.report_link.LinkBroken`, which the
SDK takes as "ask through gRPC" (it names the port again).

Thread safety: an :class:`AsyncCallLink` belongs to one event loop.
"""

from __future__ import annotations

import asyncio
import collections
import ssl

from kvstore.auth import proof
from kvstore.errors import Unauthenticated
from kvstore.rpc import MAX_MESSAGE_BYTES
from kvstore.transfer.call_link import CALL_METHODS, answer_of
from kvstore.transfer.report_link import HEADER, MAX_NONCE_BYTES, Frame, LinkBroken, frame


class AsyncCallLink(asyncio.Protocol):
    """One master's socket port, for one asyncio client (see the module docstring).

    Open it with :meth:`open`."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._hello: asyncio.Future = loop.create_future()
        self._waiting: collections.deque[asyncio.Future] = collections.deque()
        self.broken: LinkBroken | None = None

    @classmethod
    async def open(cls, host: str, port: int, token: str | None,
                   tls: ssl.SSLContext | None, timeout_s: float) -> "AsyncCallLink":
        """Connect to ``host``:``port`` and prove ``token`` when the master asks.

        Raises:
            LinkBroken: no connection or no HELLO within ``timeout_s``.
            Unauthenticated: the master asks for a token and there is none.
        """
        host = host.strip("[]")
        loop = asyncio.get_running_loop()
        try:
            _, link = await asyncio.wait_for(loop.create_connection(
                cls, host, port, ssl=tls, server_hostname=host if tls else None), timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            raise LinkBroken(f"the master's socket port {host}:{port}: {exc!r}") from None
        try:
            nonce = await asyncio.wait_for(asyncio.shield(link._hello), timeout_s)
        except (LinkBroken, asyncio.TimeoutError):
            link.close()
            raise LinkBroken(f"no HELLO from the master's socket port {host}:{port}") from None
        if nonce:
            if not token:
                link.close()
                raise Unauthenticated("the master's socket port needs a token")
            link.transport.write(frame(Frame.PROVE, proof(token, nonce)))
        return link

    async def call(self, method: str, request, timeout_s: float):
        """One call and its answer (at most ``timeout_s``), as :meth:`CallLink.call`.

        Raises:
            LinkBroken: the link is closed or broke, or no answer came in time.
            KVStoreError: the call failed on the master, as on gRPC.
            ProtocolError: an answer that is not one of ours (the link is closed).
        """
        if self.broken is not None:
            raise self.broken
        number = CALL_METHODS[method]
        answer = asyncio.get_running_loop().create_future()
        self._waiting.append(answer)
        self.transport.write(frame(Frame.CALL, bytes([number]) + request.SerializeToString()))
        try:
            kind, body = await asyncio.wait_for(answer, timeout_s)
        except asyncio.TimeoutError:
            self.close()
            raise LinkBroken(f"no answer from the master's socket port within "
                             f"{timeout_s:.1f} s", timed_out=True) from None
        return answer_of(number, kind, body, self.close)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self._fail(LinkBroken("the link to the master's socket port is closed"))

    # ---- the protocol ----
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(LinkBroken(f"the master's socket port closed the link ({exc!r})"))

    def _fail(self, err: LinkBroken) -> None:
        if self.broken is None:
            self.broken = err
        if not self._hello.done():
            self._hello.set_exception(err)
            self._hello.exception()     # retrieved: open() may have stopped waiting
        while self._waiting:
            waiting = self._waiting.popleft()
            if not waiting.done():
                waiting.set_exception(err)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start = 0
        while len(buf) - start >= HEADER.size:
            kind, length = HEADER.unpack_from(buf, start)
            limit = MAX_MESSAGE_BYTES if self._hello.done() else MAX_NONCE_BYTES
            if length > limit:
                self.close()
                return
            end = start + HEADER.size + length
            if len(buf) < end:
                break
            body = bytes(buf[start + HEADER.size:end])
            start = end
            if not self._hello.done():
                if kind != Frame.HELLO:
                    self.close()
                    return
                self._hello.set_result(body)
            elif self._waiting:
                waiting = self._waiting.popleft()
                if not waiting.done():
                    waiting.set_result((kind, body))
            else:                       # an answer no call waits for
                self.close()
                return
        del buf[:start]
