"""A shard's roster: the store nodes it knows, kept where a restarted master finds them,
with how far its object ids went.

The warm-up (:mod:`kvstore.master.warmup`) waits for exactly these nodes
after a restart or a change of leader, and a fresh cluster (an empty roster)
serves at once. A node is added at its first registration, before the
registration is answered (so a master killed just after cannot forget it),
and removed when the shard forgets it (``--node-forget-ms``)::

    --etcd URL       /kvstore/<cluster>/shard/<id>/nodes/<node id>: shared by the
                     shard's leader and standbys, so a standby that wins knows them
    --state-dir DIR  DIR/nodes.json, written whole and renamed into place
    neither          no roster: the warm-up cannot tell a fresh cluster from a
                     restart and waits the node ttl (see warmup.py)

Object ids only grow, across restarts too, so that of two versions of a key
the larger id is the later put (:mod:`kvstore.master.inventory` keeps the
later one). With ``--state-dir`` the file also holds ``ids_below``: no id at
or above it was handed out; the master reserves ids a block at a time
(:meth:`Roster.reserve_ids`) and a restarted one starts above the last
block. With etcd a leader's ids start at its election's revision << 32
(:mod:`kvstore.master.election`), above every earlier term's.

Thread safety: each method may block (file or etcd I/O); the servicer calls
them off its event loop, one at a time per roster (:attr:`Roster.lock`).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import threading

from kvstore.types import NodeId

log = logging.getLogger(__name__)

#: Object ids reserved at a time (``ids_below`` moves this far ahead of the next id).
ID_BLOCK = 1 << 24


class Roster:
    """No roster: nothing is known, nothing is kept."""

    def __init__(self):
        self.lock = threading.Lock()

    def load(self) -> set[NodeId] | None:
        """The nodes the shard knew; None: this roster cannot know.

        Raises:
            OSError: the roster could not be read (the master does not start).
        """
        return None

    def add(self, node_id: NodeId) -> None:
        """Keep ``node_id``. Raises OSError when it could not be kept."""

    def remove(self, node_id: NodeId) -> None:
        """Forget ``node_id``. Raises OSError when it could not be written."""

    def ids_below(self) -> int | None:
        """No object id at or above this was handed out; None: not kept here
        (the ids need no reservation)."""
        return None

    def reserve_ids(self, below: int) -> None:
        """Record that ids up to ``below`` may be handed out. Raises OSError."""


class FileRoster(Roster):
    """The roster in ``DIR/nodes.json`` (``--state-dir DIR``)."""

    def __init__(self, state_dir: str):
        super().__init__()
        self.path = pathlib.Path(state_dir) / "nodes.json"
        self._nodes: set[NodeId] | None = None
        self._ids_below = 0

    def load(self) -> set[NodeId]:
        with self.lock:
            if self._nodes is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                try:
                    doc = json.loads(self.path.read_text())
                except FileNotFoundError:
                    doc = {"nodes": []}
                except ValueError as exc:
                    raise OSError(f"{self.path}: not a roster ({exc}); move it aside to start "
                                  f"with an empty one") from None
                nodes = doc.get("nodes") if isinstance(doc, dict) else None
                ids = doc.get("ids_below", 0) if isinstance(doc, dict) else None
                if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes) \
                        or not isinstance(ids, int) or not 0 <= ids < 2**63:
                    raise OSError(f"{self.path}: not a roster (a list of node ids and an id "
                                  f"bound); move it aside to start with an empty one")
                self._nodes = {NodeId(n) for n in nodes}
                self._ids_below = ids
            return set(self._nodes)

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"nodes": sorted(self._nodes or ()), "ids_below": self._ids_below}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def add(self, node_id: NodeId) -> None:
        self.load()
        with self.lock:
            if node_id not in self._nodes:
                self._nodes.add(node_id)
                self._write()

    def remove(self, node_id: NodeId) -> None:
        self.load()
        with self.lock:
            if node_id in self._nodes:
                self._nodes.discard(node_id)
                self._write()


    def ids_below(self) -> int:
        self.load()
        return self._ids_below

    def reserve_ids(self, below: int) -> None:
        self.load()
        with self.lock:
            if below > self._ids_below:
                self._ids_below = below
                self._write()


class EtcdRoster(Roster):
    """The roster in etcd, under ``/kvstore/<cluster>/shard/<id>/nodes/``.

    Args:
        etcd: a :class:`kvstore.master.election.Etcd` client.
    """

    def __init__(self, etcd, cluster: str, shard_id: int):
        super().__init__()
        self.etcd = etcd
        self.prefix = f"/kvstore/{cluster}/shard/{shard_id}/nodes/"

    def load(self) -> set[NodeId]:
        from kvstore.master.election import EtcdError

        try:
            return {NodeId(k[len(self.prefix):]) for k in self.etcd.get_prefix(self.prefix)}
        except EtcdError as exc:
            raise OSError(str(exc)) from None

    def add(self, node_id: NodeId) -> None:
        from kvstore.master.election import EtcdError

        try:
            self.etcd.put(self.prefix + node_id, "1")
        except EtcdError as exc:
            raise OSError(str(exc)) from None

    def remove(self, node_id: NodeId) -> None:
        from kvstore.master.election import EtcdError

        try:
            self.etcd.delete(self.prefix + node_id)
        except EtcdError as exc:
            raise OSError(str(exc)) from None
