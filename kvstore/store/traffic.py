"""What a node's data server moved: value bytes and open connections, by transport.

Read by the node's metrics (``kvstore_transfer_bytes_total``,
``kvstore_connections``); counted by :class:`kvstore.store.data_server.DataServer`.
"""

from __future__ import annotations

import threading


class Traffic:
    """Bytes moved and connections open, by transport (``tcp``; ``shm``: the Unix
    socket of same-host clients, whose values move through the segment).

    A session counts its own bytes (no lock); closed sessions are folded in.
    One-sided RDMA reads never reach the node's CPU and are not counted.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._open: dict[str, set] = {"tcp": set(), "shm": set()}
        self._done: dict[tuple[str, str], int] = {}

    def opened(self, transport: str, session: "object") -> None:
        with self._lock:
            self._open[transport].add(session)

    def closed(self, transport: str, session: "object") -> None:
        with self._lock:
            self._open[transport].discard(session)
            for direction, n in (("in", session.bytes_in), ("out", session.bytes_out)):
                self._done[(transport, direction)] = self._done.get((transport, direction), 0) + n

    def connections(self) -> dict[str, int]:
        with self._lock:
            return {t: len(s) for t, s in self._open.items()}

    def bytes(self) -> dict[tuple[str, str], int]:
        """(transport, direction) -> bytes, ``in`` (written to the node) and ``out``."""
        with self._lock:
            out = dict(self._done)
            for t, sessions in self._open.items():
                for s in sessions:
                    out[(t, "in")] = out.get((t, "in"), 0) + s.bytes_in
                    out[(t, "out")] = out.get((t, "out"), 0) + s.bytes_out
        for t in self._open:
            for d in ("in", "out"):
                out.setdefault((t, d), 0)
        return out
