"""The socket port's call answers (kvstore.transfer.call_link): a FAILED frame carries
what a failed gRPC call carries, and decodes to the same error class and fields."""

from __future__ import annotations

import grpc
import pytest

from kvstore.errors import (IndexIncomplete, InvalidArgument, NotLeader, ProtocolError,
                            Unavailable, error_detail, status_code)
from kvstore.transfer.call_link import PORT_RETRY_S, error_of_failed, failed_body, port_retry


@pytest.mark.parametrize("err", [NotLeader("not the leader", leader="m2:7000"),
                                 IndexIncomplete("warming up"), InvalidArgument("bad key")])
def test_a_failed_answer_is_the_error_grpc_would_raise(err):
    ((_, detail),) = error_detail(err)
    back = error_of_failed(failed_body(status_code(err), err.message, detail))
    assert type(back) is type(err) and back.message == err.message
    assert getattr(back, "leader", "") == getattr(err, "leader", "")


def test_a_status_without_detail_and_junk():
    assert isinstance(error_of_failed(failed_body(grpc.StatusCode.INVALID_ARGUMENT, "no")),
                      InvalidArgument)
    assert isinstance(error_of_failed(b"\x03"), ProtocolError)          # short
    # A detail length past the body, an unknown status number: still an error, no crash.
    assert isinstance(error_of_failed(b"\xfe\xff\xff" + b"x" * 10), Unavailable)


def test_a_failed_link_waits_before_the_next(monkeypatch):
    failed = {"a:1": 1000.0}
    monkeypatch.setattr("time.monotonic", lambda: 1000.0 + PORT_RETRY_S / 2)
    assert not port_retry({}, failed, "a:1") and port_retry({}, failed, "b:1")
    assert not port_retry({"b:1": object()}, failed, "b:1")
    monkeypatch.setattr("time.monotonic", lambda: 1000.0 + PORT_RETRY_S)
    assert port_retry({}, failed, "a:1")
