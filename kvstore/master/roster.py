"""A shard's roster: the store nodes it knows, kept where a restarted master finds them.

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


class FileRoster(Roster):
    """The roster in ``DIR/nodes.json`` (``--state-dir DIR``)."""

    def __init__(self, state_dir: str):
        super().__init__()
        self.path = pathlib.Path(state_dir) / "nodes.json"
        self._nodes: set[NodeId] | None = None

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
                if not isinstance(nodes, list) or not all(isinstance(n, str) for n in nodes):
                    raise OSError(f"{self.path}: not a roster (no list of node ids); move it "
                                  f"aside to start with an empty one")
                self._nodes = {NodeId(n) for n in nodes}
            return set(self._nodes)

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"nodes": sorted(self._nodes or ())}, f)
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
