"""Versions a dead node may bring back that the shard has since replaced.

A put of a key whose every replica is on a dead node makes the key new again
(the object is lost to readers). But the dead node may come back with the
old version on its SSD, after the new one was lost in turn (its only node
restarted, DRAM gone)::

    K=X on A (SSD); A stops       put K=Y: acknowledged, on B (DRAM)
    B restarts: Y is gone         A comes back, announces K=X  --> must not serve X

So when a version replaces one held only by dead nodes, the shard notes the
key with the newest acknowledged object id (ids only grow: kvstore/master/
roster.py), and an inventory that announces an older version of the key is
refused: the node drops it. A note is kept as long as a node may come back
with what it held, ``--node-forget-ms`` (after that a returning node is new
and its objects are indexed again, as documented); at most
:data:`MAX_NOTES` are kept, the oldest going first (counted).

Thread safety: owned by the master's event loop, like the index.
"""

from __future__ import annotations

from collections import deque

from kvstore.types import ObjectKey

#: Notes kept at most (about 150 B each).
MAX_NOTES = 1_000_000


class Superseded:
    """Per key, the newest acknowledged object id, while an older one may come back.

    Args:
        keep_ms: how long a note is kept (the node forget time).
    """

    def __init__(self, keep_ms: int):
        self.keep_ms = keep_ms
        self._newest: dict[ObjectKey, tuple[int, int]] = {}    # key -> (object id, expires_ms)
        self._order: deque[tuple[int, ObjectKey]] = deque()    # (expires_ms, key), oldest first
        self.dropped = 0             # notes given up early (MAX_NOTES)

    def __len__(self) -> int:
        return len(self._newest)

    def note(self, key: ObjectKey, object_id: int, now_ms: int) -> None:
        """Version ``object_id`` of ``key`` was acknowledged while an older one may
        come back on a dead node."""
        expires = now_ms + self.keep_ms
        old = self._newest.get(key, (0, 0))[0]
        self._newest[key] = (max(object_id, old), expires)
        self._order.append((expires, key))
        while len(self._newest) > MAX_NOTES:
            expires, old_key = self._order.popleft()
            if self._newest.get(old_key, (0, -1))[1] == expires:
                del self._newest[old_key]
                self.dropped += 1

    def renew(self, key: ObjectKey, object_id: int, now_ms: int) -> None:
        """A newer version of a noted key was acknowledged: it is the one to keep."""
        if key in self._newest:
            self.note(key, object_id, now_ms)

    def keys(self):
        """The keys noted (a live view)."""
        return self._newest.keys()

    def replaced(self, key: ObjectKey, object_id: int) -> bool:
        """Whether the shard acknowledged a version of ``key`` newer than ``object_id``."""
        return self._newest.get(key, (0, 0))[0] > object_id

    def expire(self, now_ms: int) -> None:
        """Forget the notes older than ``keep_ms`` (a key noted again since lives on)."""
        while self._order and self._order[0][0] <= now_ms:
            expires, key = self._order.popleft()
            if self._newest.get(key, (0, -1))[1] == expires:
                del self._newest[key]
