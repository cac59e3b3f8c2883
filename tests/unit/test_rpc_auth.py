"""The gRPC auth interceptor and bearer channels, unary and streaming, on a loopback server."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvstore.auth import Role, TokenFile
from kvstore.rpc import ClientCredentials, ServerSecurity, aio_channel, aio_server, channel, listen

CLIENT, NODE = "c" * 24, "n" * 24
METHODS = {"Echo": frozenset({Role.CLIENT}), "Count": frozenset({Role.CLIENT})}


def _handlers():
    async def echo(request: bytes, context) -> bytes:
        return request

    async def count(request: bytes, context):
        for i in range(int(request)):
            yield str(i).encode()

    ident = dict(request_deserializer=None, response_serializer=None)
    return grpc.method_handlers_generic_handler("t.T", {
        "Echo": grpc.unary_unary_rpc_method_handler(echo, **ident),
        "Count": grpc.unary_stream_rpc_method_handler(count, **ident),
        "Admin": grpc.unary_unary_rpc_method_handler(echo, **ident)})


async def _calls(address: str, token: str | None) -> dict[str, str]:
    out = {}
    async with aio_channel(address, ClientCredentials(token=token)) as ch:
        for name, call in (("Echo", ch.unary_unary("/t.T/Echo")),
                           ("Admin", ch.unary_unary("/t.T/Admin"))):
            try:
                out[name] = (await call(b"hi", timeout=5)).decode()
            except grpc.aio.AioRpcError as exc:
                out[name] = exc.code().name
        try:
            out["Count"] = ",".join([m.decode() async for m in ch.unary_stream("/t.T/Count")(
                b"3", timeout=5)])
        except grpc.aio.AioRpcError as exc:
            out["Count"] = exc.code().name
    return out


def _sync_count(port: int, token: str | None) -> str:
    """The blocking channel too (the SDK's and the nodes')."""
    with channel(f"127.0.0.1:{port}", ClientCredentials(token=token)) as ch:
        try:
            return ",".join(m.decode() for m in ch.unary_stream("/t.T/Count")(b"2", timeout=5))
        except grpc.RpcError as exc:
            return exc.code().name


@pytest.mark.parametrize("token, expected", [
    (None, dict(Echo="UNAUTHENTICATED", Admin="UNAUTHENTICATED", Count="UNAUTHENTICATED")),
    ("x" * 24, dict(Echo="UNAUTHENTICATED", Admin="UNAUTHENTICATED", Count="UNAUTHENTICATED")),
    (NODE, dict(Echo="PERMISSION_DENIED", Admin="PERMISSION_DENIED", Count="PERMISSION_DENIED")),
    (CLIENT, dict(Echo="hi", Admin="PERMISSION_DENIED", Count="0,1,2")),
])
def test_every_call_kind_carries_and_checks_the_token(tmp_path, token, expected):
    path = tmp_path / "tokens"
    path.write_text(f"client {CLIENT}\nnode {NODE}\n")
    security = ServerSecurity(tokens=TokenFile(str(path)))

    async def main():
        server = aio_server(security, METHODS)
        server.add_generic_rpc_handlers((_handlers(),))
        port = listen(server, "127.0.0.1", 0, security)
        await server.start()
        try:
            got = await _calls(f"127.0.0.1:{port}", token)
            got["sync Count"] = await asyncio.to_thread(_sync_count, port, token)
            return got
        finally:
            await server.stop(None)

    got = asyncio.run(main())
    sync = expected["Count"] if expected["Count"] != "0,1,2" else "0,1"
    assert got == {**expected, "sync Count": sync}
