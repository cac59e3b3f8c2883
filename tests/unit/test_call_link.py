"""The socket port's calls (kvstore.transfer.call_link, kvstore.master.call_port): a FAILED
frame decodes to the error gRPC would raise; a call interrupted while it waits closes its
link; a master that does not answer fails the attempt; a burst of calls on one link takes
turns with the master's loop; a call over its bound is refused."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from collections import Counter
from types import SimpleNamespace

import grpc
import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.control import Control
from kvstore.client.core.failover import MasterRetry
from kvstore.client.deadline import of_call
from kvstore.errors import (IndexIncomplete, InvalidArgument, NotLeader, ProtocolError,
                            Unavailable, error_detail, status_code)
from kvstore.master.report_port import FRAMES_PER_TURN, ReportPort, _Link
from kvstore.transfer.call_link import (MAX_CALL_BYTES, PORT_RETRY_S, CallLink, error_of_failed,
                                        failed_body, port_retry)
from kvstore.transfer.report_link import HEADER, Frame, LinkBroken, frame


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


# ---- a scripted master port: HELLO, then calls that are never answered ----

class SilentMaster:
    """Accepts links, says HELLO (no nonce), reads and never answers."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.sendall(frame(Frame.HELLO, b""))
            self.accepted.append(conn)

    def close(self):
        self.sock.close()
        for c in self.accepted:
            c.close()


class _Interrupted(Exception):
    pass


def test_an_interrupted_call_closes_its_link():
    """A signal handler's exception while the answer is awaited: the answer would be
    read as the next call's, so the link is closed (the next call opens another)."""
    master = SilentMaster()
    link = CallLink("127.0.0.1", master.port)

    def interrupt(*_):
        raise _Interrupted()
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(_Interrupted):
            link.call("Lookup", pb.LookupRequest(keys=["a"]), timeout_s=5.0)
        assert link._sock is None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        master.close()


def test_a_silent_master_fails_the_attempt_not_a_second_wait():
    """No answer in time: the attempt fails (the next goes to another master), where a
    broken link would send the same attempt through gRPC."""
    master = SilentMaster()
    control = Control.__new__(Control)
    control._links, control._port_failed = {}, {}
    link = CallLink("127.0.0.1", master.port)
    try:
        attempt = next(iter(MasterRetry(("m1:1", "m2:1"), {}, of_call(0.3, 0.3), 0.3)))
        control._links[attempt.address] = link
        response, err = control._on_link(link, attempt, "Lookup", pb.LookupRequest(keys=["a"]))
        assert response is None and isinstance(err, LinkBroken) and err.timed_out
        assert attempt.address not in control._links and attempt.address in control._port_failed
    finally:
        master.close()


class _Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.out, self.paused, self.closed = [], False, False

    def write(self, data):
        self.out.append(bytes(data))

    def pause_reading(self):
        self.paused = True

    def resume_reading(self):
        self.paused = False

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True

    def get_extra_info(self, name, default=None):
        return default


def test_calls_sent_back_to_back_take_turns_with_the_loop():
    """A burst of calls is answered FRAMES_PER_TURN at a time, reading paused between
    turns, every call answered in the end, in order."""
    async def main():
        port = ReportPort(servicer=None)         # no --auth: proven at once
        link, transport = _Link(port), _Transport()
        link.connection_made(transport)
        calls = 3 * FRAMES_PER_TURN + 5
        link.data_received(frame(Frame.CALL, bytes([250])) * calls)   # no such method
        assert len(transport.out) == 1 + FRAMES_PER_TURN and transport.paused
        for _ in range(10):
            await asyncio.sleep(0)
        assert len(transport.out) == 1 + calls and not transport.paused
        assert {HEADER.unpack_from(a)[0] for a in transport.out[1:]} == {Frame.FAILED}
    asyncio.run(main())


def test_a_call_longer_than_its_bound_is_refused():
    async def main():
        port = ReportPort(servicer=SimpleNamespace(index=SimpleNamespace(counters=Counter())))
        link, transport = _Link(port), _Transport()
        link.connection_made(transport)
        link.data_received(HEADER.pack(Frame.CALL, MAX_CALL_BYTES + 1))     # no byte of it yet
        assert transport.closed and HEADER.unpack_from(transport.out[-1])[0] == Frame.ERROR
    asyncio.run(main())
