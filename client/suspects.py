"""Store nodes this client could not reach lately, and how long reads wait for one.

A transfer that fails (the node down, hung, or cut off from this client while
its master still calls it alive) makes its node *suspect*: reads try it after
every other replica. A suspicion lasts ``suspect_s``, twice as long at each
further failure in a row (up to :data:`MAX_SUSPECT_S`), and ends at the node's
first success; so a node that stays unreachable is tried again less and less
often (after 5, 10, 20 ... s), not every ``suspect_s``, and each such try costs
a read only :func:`fallback_after_s` when it has another replica.

Thread safety: the sync SDK's threads share one :class:`Suspects` (a lock
guards changes; readers read ``until`` without it: a dict lookup).
"""

from __future__ import annotations

import threading
import time

from kvstore.types import NodeId

#: The longest a node stays suspect after failures in a row (it doubles at each).
MAX_SUSPECT_S = 120.0


def fallback_after_s(read_timeout_s: float) -> float:
    """How long a read waits for one replica when it has another to try: a quarter
    of ``read_timeout_s``, at least 1 s (a node answering a loaded host's reads
    late is not given up on at once), at most ``read_timeout_s``."""
    return min(read_timeout_s, max(1.0, read_timeout_s / 4))


class Suspects:
    """Node id -> until when reads try it last.

    Args:
        suspect_s: how long the first failure in a row makes a node suspect.

    Attributes:
        until: node id -> monotonic time its suspicion ends (read without the lock).
    """

    def __init__(self, suspect_s: float = 5.0):
        self.suspect_s = suspect_s
        self.until: dict[NodeId, float] = {}
        self._failures: dict[NodeId, int] = {}       # failures in a row, per suspect node
        self._lock = threading.Lock()

    def failed(self, node_id: NodeId) -> float:
        """A transfer with ``node_id`` failed; returns how long it is suspect now (s)."""
        with self._lock:
            n = self._failures[node_id] = self._failures.get(node_id, 0) + 1
            span = min(self.suspect_s * 2 ** min(n - 1, 16), MAX_SUSPECT_S)
            self.until[node_id] = time.monotonic() + span
        return span

    def ok(self, node_id: NodeId) -> None:
        """A transfer with ``node_id`` went through: it is not suspect any more."""
        if node_id in self.until:
            with self._lock:
                self.until.pop(node_id, None)
                self._failures.pop(node_id, None)

    def suspect(self, node_id: NodeId, now: float) -> bool:
        return self.until.get(node_id, 0.0) > now
