"""Busy-polling is bounded and can be turned off: the data connections' poll window
(:mod:`kvstore.store.polling`) and the report link's poll for its master's answer."""

from __future__ import annotations

import socket
import threading

import pytest

from kvstore._proto import kvstore_pb2 as pb
from kvstore.store.data_server import DataServer
from kvstore.store.node import StoreNode
from kvstore.store.polling import POLL_S, Pollers
from kvstore.store.tiers.dram import DramTier
from kvstore.transfer import report_link as rl


def test_pollers_bound_how_many_poll_at_once():
    pollers = Pollers(2, 0.0)
    assert pollers.take() and pollers.take() and not pollers.take()
    pollers.give()
    assert pollers.take()


@pytest.mark.parametrize("limit,poll_s", [(0, POLL_S), (1, -1e-6), (1, 2.0)])
def test_pollers_refuse_what_cannot_be_meant(limit, poll_s):
    with pytest.raises(ValueError):
        Pollers(limit, poll_s)


def test_a_data_server_hands_its_window_to_every_connection():
    tier = DramTier(1 << 20)
    node = StoreNode(tier, start_mover=False)
    try:
        for poll_s, want in ((None, POLL_S), (0.0, 0.0), (50e-6, 50e-6)):
            kw = {} if poll_s is None else {"poll_s": poll_s}
            server = DataServer(node, **kw)
            try:
                assert server._pollers.poll_s == want
            finally:
                server.stop()
    finally:
        node.close()
        tier.close()


def _master(listener: socket.socket, answers: int) -> None:
    """A master's side of the link: HELLO without a nonce, then an ANSWER per report."""
    conn, _ = listener.accept()
    with conn:
        conn.sendall(rl.frame(rl.Frame.HELLO, b""))
        buf = b""
        for _ in range(answers):
            while len(buf) < rl.HEADER.size:
                buf += conn.recv(65536)
            _kind, length = rl.HEADER.unpack_from(buf)
            while len(buf) < rl.HEADER.size + length:
                buf += conn.recv(65536)
            buf = buf[rl.HEADER.size + length:]
            answer = pb.ReportEventsResponse(known=True, statuses=[pb.Status()])
            conn.sendall(rl.frame(rl.Frame.ANSWER, answer.SerializeToString()))


@pytest.mark.parametrize("spin_s,polls", [(None, True), (0.0, False)])
def test_the_report_link_polls_for_answers_only_when_asked(spin_s, polls):
    listener = socket.create_server(("127.0.0.1", 0))
    th = threading.Thread(target=_master, args=(listener, 20), daemon=True)
    th.start()
    link = rl.ReportLink("127.0.0.1", listener.getsockname()[1], spin_s=spin_s)
    try:
        seen = []
        for i in range(20):
            req = pb.ReportEventsRequest(node_id="n", events=[pb.ReplicaEvent(key=f"k{i}")])
            assert link.report(req, 5.0).known
            seen.append(link._spin)
        # Polling: answers this fast keep it on at least once (a loaded machine may be
        # slow to run the fake master's thread); never: not once.
        assert any(seen) if polls else not any(seen)
    finally:
        link.close()
        listener.close()
        th.join(5)
