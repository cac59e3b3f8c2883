"""The fast lane's rule (tests/fastlane.py): cluster tests are marked slow with no one's help.

Each test here runs pytest on a made-up suite (pytester); nothing starts a process.
"""

from __future__ import annotations


def test_tests_on_a_cluster_are_marked_slow_at_collection(pytester):
    pytester.makeconftest("""
        import pytest
        from kvstore.tools.cluster.launcher import start_store_cluster

        @pytest.fixture(scope="session")
        def cluster(tmp_path_factory):
            with start_store_cluster(log_dir=str(tmp_path_factory.mktemp("logs"))) as c:
                yield c

        @pytest.fixture
        def kv(cluster):
            return cluster
    """)
    pytester.makepyfile(test_suite="""
        from kvstore.tools.cluster.launcher import start_store_cluster

        def _own_cluster(log_dir):
            return start_store_cluster(log_dir=log_dir)

        def test_on_the_shared_cluster(kv):
            pass

        def test_on_a_cluster_of_its_own(tmp_path):
            _own_cluster(str(tmp_path)).stop()

        def test_quick():
            pass
    """)
    items, _ = pytester.inline_genitems("-p", "fastlane", "-p", "no:asyncio")
    slow = {item.name for item in items if item.get_closest_marker("slow")}
    assert slow == {"test_on_the_shared_cluster", "test_on_a_cluster_of_its_own"}


def test_an_unmarked_test_that_starts_a_service_fails_before_it_starts(pytester):
    # Out of the static check's sight (no launcher named): the run-time check stops it.
    pytester.makepyfile(test_suite="""
        from kvstore.tools.cluster.processes import SERVICES_MODULE, ProcessGroup

        def test_sneaky(tmp_path):
            group = ProcessGroup(str(tmp_path))
            group.start("master", ["-m", SERVICES_MODULE, "master"])
    """)
    result = pytester.runpytest_inprocess("-p", "fastlane", "-p", "no:asyncio")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*starts a cluster of processes but is not marked slow*"])
