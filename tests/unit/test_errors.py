"""Errors as types (issue 32): every class of the one table crosses a failed RPC
(sync gRPC and grpc.aio), a per-item status and the report link as itself, with
its fields, through ErrorDetail; no caller reads a message."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvstore import rpc
from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import (ERROR_DETAIL_KEY, ERRORS, MAX_ERROR_DETAIL_BYTES, AlreadyPresent,
                            IndexIncomplete, KeyConflict, KVStoreError, NotLeader, Unavailable,
                            WrongShard, error_detail, error_for_code, from_rpc_error, to_status)
from kvstore.transfer.report_link import error_frame

_METHOD = "/kvstore.test.Errors/Fail"


def _sample(cls: type[KVStoreError]) -> KVStoreError:
    if cls is NotLeader:
        return NotLeader("not the leader of shard 3", leader="10.0.0.7:7001")
    if cls is WrongShard:
        return WrongShard("slot 12 is shard 1's", redirect="10.0.0.8:7001")
    return cls(f"a {cls.__name__}")


def _fields(err: KVStoreError) -> tuple:
    return type(err), err.message, err.redirect, getattr(err, "leader", None)


async def _serve_and_call(errors: list[KVStoreError]) -> tuple[list, list]:
    """A real grpc.aio server (port chosen at run time) failing call i with errors[i]:
    what a blocking channel and an asyncio channel make of each."""
    async def fail(request: bytes, context):
        await rpc.abort(context, errors[int(request.decode())])

    server = rpc.aio_server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "kvstore.test.Errors", {"Fail": grpc.unary_unary_rpc_method_handler(fail)})])
    port = rpc.listen(server, "127.0.0.1", 0)
    await server.start()
    try:
        async with rpc.aio_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_unary(_METHOD)
            on_aio = []
            for i in range(len(errors)):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(str(i).encode(), timeout=10)
                on_aio.append(from_rpc_error(info.value))

        def blocking() -> list:
            out = []
            with rpc.channel(f"127.0.0.1:{port}") as ch:
                call = ch.unary_unary(_METHOD)
                for i in range(len(errors)):
                    with pytest.raises(grpc.RpcError) as info:
                        call(str(i).encode(), timeout=10)
                    out.append(from_rpc_error(info.value))
            return out
        on_sync = await asyncio.to_thread(blocking)
    finally:
        await server.stop(None)
    return on_sync, on_aio


def test_every_class_crosses_a_failed_rpc_as_itself_with_its_fields():
    errors = [_sample(cls) for cls in ERRORS]
    on_sync, on_aio = asyncio.run(_serve_and_call(errors))
    for sent, got_sync, got_aio in zip(errors, on_sync, on_aio):
        assert _fields(got_sync) == _fields(sent)
        assert _fields(got_aio) == _fields(sent)
    leader = on_sync[list(ERRORS).index(NotLeader)]
    assert isinstance(leader, Unavailable) and leader.leader == "10.0.0.7:7001"


def test_every_class_crosses_a_per_item_status_and_the_report_link():
    for cls in ERRORS:
        err = _sample(cls)
        status = to_status(err)
        back = error_for_code(status.code, status.message, redirect=status.redirect)
        assert type(back) is cls and back.message == err.message
        body = error_frame(err.code, err.message)[5:]      # after the type and length
        assert type(error_for_code(body[0], body[1:].decode())) is cls


class _Failed(grpc.RpcError):
    """What a failed call looks like to from_rpc_error (status, details, trailers)."""

    def __init__(self, code, details, trailers=()):
        self._c, self._d, self._t = code, details, trailers

    def code(self):
        return self._c

    def details(self):
        return self._d

    def trailing_metadata(self):
        return self._t


def test_a_detail_that_does_not_fit_is_ignored():
    unavailable = grpc.StatusCode.UNAVAILABLE
    big = pb.ErrorDetail(code=pb.NOT_LEADER, leader="x" * MAX_ERROR_DETAIL_BYTES)
    assert type(from_rpc_error(_Failed(unavailable, "m", (
        (ERROR_DETAIL_KEY, big.SerializeToString()),)))) is Unavailable       # too large
    assert type(from_rpc_error(_Failed(unavailable, "m", (
        (ERROR_DETAIL_KEY, b"\xff\xff\xff"),)))) is Unavailable               # undecodable
    # a detail naming a class of another status: the status wins
    assert type(from_rpc_error(_Failed(grpc.StatusCode.NOT_FOUND, "m",
                                       error_detail(IndexIncomplete("w"))))) is not IndexIncomplete
    assert type(from_rpc_error(_Failed(unavailable, "m"))) is Unavailable        # no detail
    assert type(from_rpc_error(_Failed(grpc.StatusCode.ALREADY_EXISTS, "m",
                                       error_detail(AlreadyPresent("same"))))) is AlreadyPresent
    assert type(from_rpc_error(_Failed(grpc.StatusCode.ALREADY_EXISTS, "m"))) is KeyConflict


def test_the_report_link_raises_the_masters_refusal_and_its_own_failures_as_classes():
    import socket
    import threading

    from kvstore.errors import ProtocolError
    from kvstore.transfer.report_link import Frame, LinkBroken, ReportLink, frame

    assert issubclass(LinkBroken, Unavailable) and not issubclass(LinkBroken, grpc.RpcError)
    answers = [error_frame(pb.NOT_LEADER, "not the leader of shard 0"), frame(Frame.ANSWER, b"\xff"),
               b""]       # a refusal, an undecodable answer, then silence (closed)
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        for answer in answers:
            conn, _ = srv.accept()
            with conn:
                conn.sendall(frame(Frame.HELLO, b""))
                conn.recv(65536)
                conn.sendall(answer)
    t = threading.Thread(target=serve, daemon=True)
    t.start()
    link = ReportLink("127.0.0.1", srv.getsockname()[1])
    req = pb.ReportEventsRequest(node_id="n0")
    for expected in (NotLeader, ProtocolError, LinkBroken):
        with pytest.raises(KVStoreError) as info:
            link.report(req, 5.0)
        assert type(info.value) is expected
    t.join(timeout=5)
    srv.close()
