"""Shared fixtures: a real kvstore cluster (master + store nodes as child processes).

``cluster`` is one session-wide cluster (a master and two 64 MiB nodes) that
most integration tests share; they keep out of each other's way by using
unique key prefixes (``key_prefix``). Tests that must fill or starve a node
start their own small cluster with ``kvtest.start_cluster``.
"""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from kvtest import RunningCluster, cluster_running

# Tests send SIGINT to the processes they start, as a Ctrl-C. A shell started in the
# background (`.ci/run &`, nohup) ignores SIGINT, and an ignored signal stays ignored
# in every process it starts: Python would then never raise KeyboardInterrupt. A
# handler here is reset to the default in each child (exec), so they see Ctrl-C.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# pytester: tests/unit/test_fast_lane.py runs the fast lane's rule on a made-up suite.
pytest_plugins = ["pytester"]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> RunningCluster:
    """Master + two 64 MiB store nodes (n0, n1), shared by the whole session."""
    with cluster_running(str(tmp_path_factory.mktemp("cluster-logs"))) as running:
        yield running           # cluster_running checks nobody crashed along the way


@pytest.fixture(scope="session")
def master(cluster) -> str:
    """Address of the shared cluster's master."""
    return cluster.master


@pytest.fixture(params=["tcp", "shm"])
def transport(request) -> str:
    """Which data path a client uses: "tcp" or "shm" (same-host shared memory)."""
    return request.param


@pytest.fixture
def make_client(master, transport):
    """Factory of clients of the shared cluster on the parametrized transport; closed after the test."""
    from kvstore.client import KVClient

    clients = []

    def make(address: str | None = None, **kwargs) -> KVClient:
        kwargs.setdefault("prefer_shm", transport == "shm")
        c = KVClient(address or master, **kwargs)
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.close()


@pytest.fixture
def kv(make_client):
    """A client of the shared cluster on the parametrized transport."""
    return make_client()


@pytest.fixture
def key_prefix() -> str:
    """A prefix no other test uses, so tests can share the cluster."""
    return f"t-{uuid.uuid4().hex[:12]}/"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test shows the last lines of the service logs written while it ran
    (ProcessGroup.RECENT_LOGS): a failure seen only in CI (a master that did not
    answer, a node that died) is read from its report, not reproduced first."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.when == "teardown":
        return
    from kvstore.tools.cluster.processes import RECENT_LOGS

    started = call.start - 1.0
    tails = []
    for path in dict.fromkeys(reversed(RECENT_LOGS)):      # newest first, once each
        try:
            if os.path.getmtime(path) < started:
                continue
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 4096))
                lines = f.read().decode(errors="replace").splitlines()[-15:]
        except OSError:
            continue
        tails.append(f"== {path} (last {len(lines)} lines)\n" + "\n".join(lines))
        if len(tails) == 6:
            break
    if tails:
        report.sections.append(("service logs written during the test", "\n".join(tails)))


def pytest_configure(config):
    # The fast lane's rule (tests/fastlane.py): cluster tests are marked slow at collection.
    import fastlane
    if not config.pluginmanager.is_registered(fastlane):
        config.pluginmanager.register(fastlane, "fastlane")
