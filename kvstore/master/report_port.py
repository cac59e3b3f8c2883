"""The master's end of the report link: store nodes' event reports on a plain socket.

The frames, the handshake and why the link exists are in
:mod:`kvstore.transfer.report_link`. This side is an asyncio server on the
master's event loop, on the host of its gRPC port and a port chosen at start
(announced to nodes in RegisterNode answers). Each report is applied by
:meth:`MasterServicer.apply_report`, the code behind ReportEvents and
StreamEvents, with the same rules: only the shard's leader applies reports
(a standby answers UNAVAILABLE with the leader's address, as its gRPC
calls do), a node is known by its incarnation and the fingerprint of its
token, and with ``--auth`` only a ``node`` or ``admin`` token may report.

What a connection can make the master hold is bounded: frames are read
only after their declared length was checked (a proof at MAX_PROOF_BYTES,
a report at MAX_MESSAGE_BYTES, the gRPC limit), a connection that has not
proven itself within :data:`HANDSHAKE_TIMEOUT_S` is closed, and any frame
that is not what the link expects (a wrong type, an undecodable report)
gets an ERROR frame and the connection is closed; no error here ends the
master.
"""

from __future__ import annotations

import asyncio
import logging

from kvstore import tls as tlsmod
from kvstore._proto import kvstore_pb2 as pb
from kvstore.auth import Role, new_nonce
from kvstore.errors import KVStoreError, to_status
from kvstore.master.counters import MasterCounter as C
from kvstore.rpc import MAX_MESSAGE_BYTES, ServerSecurity
from kvstore.transfer.report_link import HEADER, MAX_PROOF_BYTES, Frame, error_frame, frame

log = logging.getLogger(__name__)
HANDSHAKE_TIMEOUT_S = 10.0
_REPORTERS = (Role.NODE, Role.ADMIN)


class _Refused(Exception):
    """Close the connection after sending this ERROR (code, message)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


async def _read(reader: asyncio.StreamReader, expect: Frame, limit: int) -> bytes:
    kind, length = HEADER.unpack(await reader.readexactly(HEADER.size))
    if kind != expect:
        raise _Refused(pb.INVALID_ARGUMENT, f"expected a {expect.name} frame, got type {kind}")
    if length > limit:
        raise _Refused(pb.INVALID_ARGUMENT, f"a {expect.name} frame of {length} B "
                                            f"(at most {limit})")
    return await reader.readexactly(length)


class ReportPort:
    """Serves the report link for ``servicer``.

    Args:
        servicer: the shard's MasterServicer (its leadership, membership and index).
        security: tokens (a proof is required) and TLS (the link is TLS).
    """

    def __init__(self, servicer, security: ServerSecurity | None = None):
        self.servicer = servicer
        self.security = security or ServerSecurity()
        self.server: asyncio.base_events.Server | None = None
        self.port = 0
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int = 0) -> int:
        """Listen on ``host``:``port`` (0: a free port); returns the port.

        Raises:
            OSError: the address cannot be bound.
        """
        ssl_ctx = tlsmod.server_context(self.security.tls) if self.security.tls else None
        self.server = await asyncio.start_server(self._serve, host.strip("[]"), port,
                                                 ssl=ssl_ctx, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    def close(self) -> None:
        """Stop listening and end every link (its node reports on gRPC or to another master)."""
        if self.server is not None:
            self.server.close()
        for writer in list(self._writers):
            writer.close()

    async def _handshake(self, reader, writer) -> str:
        """Authenticate the node; returns its token's fingerprint ("" without --auth)."""
        tokens = self.security.tokens
        nonce = new_nonce() if tokens is not None else b""
        writer.write(frame(Frame.HELLO, nonce))
        if tokens is None:
            return ""
        answer = await asyncio.wait_for(_read(reader, Frame.PROVE, MAX_PROOF_BYTES),
                                        HANDSHAKE_TIMEOUT_S)
        found = tokens.match_proof(nonce, answer)
        if found is None:
            raise _Refused(pb.UNAUTHENTICATED, "unknown credentials")
        role, owner = found
        if role not in _REPORTERS:
            raise _Refused(pb.PERMISSION_DENIED, f"role {role.value} may not report node events")
        return owner

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

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            owner = await self._handshake(reader, writer)
            while True:
                body = await _read(reader, Frame.REPORT, MAX_MESSAGE_BYTES)
                writer.write(self._answer(body, owner))
                await writer.drain()
        except _Refused as refused:
            self.servicer.index.counters[C.LINKS_REFUSED] += 1
            log.warning("report link from %s refused: %s",
                        writer.get_extra_info("peername"), refused.message)
            writer.write(error_frame(refused.code, refused.message))
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, OSError,
                asyncio.CancelledError):
            pass                      # the node went away (or never proved itself), or we stop
        except Exception:             # a bug: this link ends, the master goes on
            log.exception("report link failed")
        finally:
            self._writers.discard(writer)
            try:
                writer.close()
            except Exception:
                pass
