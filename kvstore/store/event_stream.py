"""A node's long-lived StreamEvents call to one master: a report out, its answer back.

A write is acknowledged only once the node's master shard applied its STORED
report, so the report's round trip is on every put's critical path. A unary
ReportEvents costs a new HTTP/2 stream each time (about 750 us here under
load); one stream kept open per node and shard answers in about 300 us.
Reports go one at a time (the agent's lock), so the n-th answer is the n-th
report's. Delivery stays at least once: a report whose answer does not come
(the stream broke, the master went away) stays queued in the agent and is sent
again, on a new stream or to another master, and the master applies events
idempotently.

A master without the method (UNIMPLEMENTED) is reported to unary-only
(:attr:`EventStream.supported` turns False).

Thread safety: :meth:`report` is called under the agent's lock (one at a
time); a reader thread per open stream moves answers to a queue.
"""

from __future__ import annotations

import queue
import threading

import grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore.errors import from_rpc_error
from kvstore.transfer.report_link import LinkBroken


class EventStream:
    """StreamEvents on ``stub``'s channel, opened at the first report.

    Args:
        stub: a MasterStub of the channel the stream lives on.
    """

    def __init__(self, stub):
        self._stub = stub
        self._requests: queue.SimpleQueue | None = None
        self._answers: queue.SimpleQueue = queue.SimpleQueue()
        self._call = None
        self.supported = True

    def _open(self) -> None:
        requests: queue.SimpleQueue = queue.SimpleQueue()
        answers: queue.SimpleQueue = queue.SimpleQueue()
        call = self._stub.StreamEvents(iter(requests.get, None))

        def read() -> None:
            try:
                for answer in call:
                    answers.put(answer)
                answers.put(LinkBroken("the master ended the stream"))
            except grpc.RpcError as exc:
                answers.put(exc)

        threading.Thread(target=read, name="event-stream", daemon=True).start()
        self._requests, self._answers, self._call = requests, answers, call

    def report(self, request: pb.ReportEventsRequest, timeout_s: float) -> pb.ReportEventsResponse:
        """Send one report and wait for its answer.

        Raises:
            LinkBroken: the stream ended or stayed silent for ``timeout_s`` (it is
                closed; the next report opens a new one).
            KVStoreError: the stream failed (its status's class; closed as well).
        """
        if self._call is None:
            self._open()
        self._requests.put(request)
        try:
            answer = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            self.close()
            raise LinkBroken(f"no answer on the event stream within {timeout_s:.1f} s") from None
        if isinstance(answer, LinkBroken):
            self.close()
            raise answer
        if isinstance(answer, grpc.RpcError):
            self.close()
            if answer.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
            raise from_rpc_error(answer) from None
        return answer

    def close(self) -> None:
        if self._call is None:
            return
        self._requests.put(None)
        self._call.cancel()
        self._call = self._requests = None
