"""Helpers shared by the tests: starting a real cluster, polling, node stats.

Importable from every test module as ``kvtest`` (pytest puts ``tests/`` on
``sys.path`` for the root ``conftest.py``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from kvstore.tools.cluster.launcher import StoreCluster, start_store_cluster
from kvstore.tools.cluster.processes import service_args
from kvstore.types import NodeStatus
from waits import wait_until

#: A started cluster (``procs``, ``master``, ``nodes``: node_id -> Child with its READY info).
RunningCluster = StoreCluster


def node_args(master: str, node_id: str, dram: str, eviction_policy: str, ssd: str = "",
              ssd_dir: str = "", extra: tuple[str, ...] = ()) -> list[str]:
    """Command line of one store node; with ``ssd``, its SSD tier lives in ``ssd_dir/node_id``."""
    args = ["--master", master, "--dram", dram, "--node-id", node_id,
            "--eviction-policy", eviction_policy]
    if ssd:
        args += ["--ssd", ssd, "--ssd-path", f"{ssd_dir}/{node_id}"]
    return service_args("node", *args, *extra)


def start_cluster(log_dir: str, num_nodes: int = 2, dram: str = "64MiB",
                  node_ttl_ms: int = 3000, eviction_policy: str = "none", ssd: str = "",
                  ssd_dir: str = "", extra_node_args: tuple[str, ...] = ()) -> RunningCluster:
    """Start a master and ``num_nodes`` store nodes named n0, n1, ...; the caller stops it.

    Nodes default to no eviction, so a full node answers NoSpace (the store
    rules); eviction tests pass a policy name. With ``ssd`` (a size) each node
    gets an SSD tier under ``ssd_dir``.
    """
    return start_store_cluster(1, num_nodes, dram=dram, node_ttl_ms=node_ttl_ms,
                               eviction_policy=eviction_policy, ssd=ssd, ssd_dir=ssd_dir,
                               node_args=extra_node_args, log_dir=log_dir)


def start_secured_cluster(tmp, tokens: dict[str, str], nodes: int = 1,
                          node_ttl_ms: int = 3000) -> RunningCluster:
    """A master and ``nodes`` nodes started with ``--auth`` (a token file in ``tmp``
    with ``tokens``: role -> token; the nodes hold the ``node`` one); the caller
    stops it. ``cluster.auth_file`` is the file."""
    auth = tmp / "tokens"
    auth.write_text("".join(f"{role} {tok}\n" for role, tok in tokens.items()))
    c = start_store_cluster(nodes=nodes, log_dir=str(tmp), master_args=("--auth", str(auth)),
                            node_args=("--auth", str(auth)), node_ttl_ms=node_ttl_ms,
                            env={"KVSTORE_TOKEN": tokens["node"]})
    c.auth_file = auth
    return c


@contextlib.contextmanager
def cluster_running(log_dir: str, **kwargs) -> Iterator[RunningCluster]:
    """``start_cluster`` as a context: checks every process survived, then stops them."""
    running = start_cluster(log_dir, **kwargs)
    try:
        yield running
        running.procs.check()
    finally:
        running.procs.stop()


def wait_for(predicate, timeout_s: float = 10.0, interval_s: float = 0.05,
             what: str = "the condition"):
    """Poll ``predicate()`` until it returns something truthy; returns it, or fails the test
    (:func:`waits.wait_until`)."""
    return wait_until(predicate, timeout_s=timeout_s, interval_s=interval_s, what=what)


def node_stats(kv) -> dict[str, NodeStatus]:
    """The master's view of each node (node_id -> NodeStatus) through a KVClient."""
    return {n.address.node_id: n for st in kv.stat() for n in st.nodes}
