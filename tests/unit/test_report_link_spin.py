"""The report link's writer polls for an answer only while answers come fast
(ANSWER_SPIN_S), and reads the same answers either way."""

from __future__ import annotations

import socket
import threading
import time

from kvstore._proto import kvstore_pb2 as pb
from kvstore.transfer import report_link as rl


def _master(listener: socket.socket, delays: list[float]) -> None:
    """A master's side of the link: HELLO without a nonce, then one ANSWER per report
    (``known`` and one OK status per event), each after its delay."""
    conn, _ = listener.accept()
    with conn:
        conn.sendall(rl.frame(rl.Frame.HELLO, b""))
        buf = b""
        for delay in delays:
            while len(buf) < rl.HEADER.size:
                buf += conn.recv(65536)
            _kind, length = rl.HEADER.unpack_from(buf)
            while len(buf) < rl.HEADER.size + length:
                buf += conn.recv(65536)
            req = pb.ReportEventsRequest.FromString(buf[rl.HEADER.size:rl.HEADER.size + length])
            buf = buf[rl.HEADER.size + length:]
            time.sleep(delay)
            answer = pb.ReportEventsResponse(known=True, statuses=[pb.Status()] * len(req.events))
            conn.sendall(rl.frame(rl.Frame.ANSWER, answer.SerializeToString()))


def test_the_writer_polls_only_while_answers_come_fast():
    listener = socket.create_server(("127.0.0.1", 0))
    delays = [0.0, 0.05] + [0.0] * 50
    th = threading.Thread(target=_master, args=(listener, delays), daemon=True)
    th.start()
    link = rl.ReportLink("127.0.0.1", listener.getsockname()[1])
    try:
        spins = []
        for i in range(len(delays)):
            req = pb.ReportEventsRequest(node_id="n", events=[pb.ReplicaEvent(key=f"k{i}")])
            answer = link.report(req, 5.0)
            assert answer.known and len(answer.statuses) == 1
            spins.append(link._spin)
        # A slow answer (50 ms) stops the polling; a fast one brings it back (any of
        # 50: a loaded machine may be slow to run the fake master's thread).
        assert spins[1] is False and any(spins[2:])
    finally:
        link.close()
        listener.close()
        th.join(5)


def test_a_link_asked_not_to_poll_never_does():
    listener = socket.create_server(("127.0.0.1", 0))
    th = threading.Thread(target=_master, args=(listener, [0.0] * 20), daemon=True)
    th.start()
    link = rl.ReportLink("127.0.0.1", listener.getsockname()[1], spin_s=0.0)   # --busy-poll-us 0
    try:
        for i in range(20):
            req = pb.ReportEventsRequest(node_id="n", events=[pb.ReplicaEvent(key=f"k{i}")])
            assert link.report(req, 5.0).known
            assert link._spin is False
    finally:
        link.close()
        listener.close()
        th.join(5)

