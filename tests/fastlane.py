"""The fast lane's rule: a test that starts a cluster of processes is ``slow``.

``pytest -m "not slow"`` is the fast lane (the unit tests and the quick
integration tests, a few minutes on a 2-core machine); CI runs everything.
Nobody has to remember the marker for a cluster test: this plugin (loaded by
the root ``conftest.py``) marks it at collection, and stops one it missed.

- At collection, a test is marked ``slow`` when its function, or any fixture
  in its closure (the shared ``cluster`` and everything built on it, a
  module's own cluster fixture), refers to a launcher (:data:`LAUNCHERS`),
  directly or through a helper function of its own module. The check reads the
  source (an AST walk), so a new test or fixture needs no list kept by hand.
- At run time, a test not marked ``slow`` that starts a kvstore service
  anyway (through ``ProcessGroup.start``, which every launcher uses) fails at
  once, naming the marker: a miss of the static check cannot pass unseen.
- A test that runs over 5 s without the marker is listed at the end of the
  run (a reminder, not a failure: timing on a shared machine is noise).

Tests that start a cluster out of sight of both (a ``kvstore up`` command in
a subprocess, a script in a string) carry ``@pytest.mark.slow`` by hand.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import textwrap

import pytest

#: Names whose use starts kvstore processes: the launcher and what wraps it.
LAUNCHERS = frozenset({
    # tests/kvtest.py and the shared fixture
    "cluster_running", "start_cluster", "start_secured_cluster",
    # the launcher (kvstore.tools.cluster.launcher) and the process group's service command line
    "start_store_cluster", "LocalCluster", "EtcdServer", "service_args",
    # harnesses that start a cluster of their own
    "run_chaos", "run_partition", "start_multihost", "run_demo", "run_bench", "run_systems",
})

#: Over this many seconds, a test belongs in the slow lane.
SLOW_S = 5.0

_SLOW_HELP = ("starts a cluster of processes but is not marked slow: add @pytest.mark.slow "
              "(tests/fastlane.py explains the fast lane's rule)")


def _names(node: ast.AST) -> set[str]:
    """Every name a piece of code refers to (``x`` and the ``attr`` of ``y.attr``)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


@functools.lru_cache(maxsize=None)
def _launching_functions(module_file: str) -> frozenset[str]:
    """Names of the functions and classes of a module that start processes, helpers included.

    A module-level function or class launches when it refers to a launcher or
    to another launching function of the module (a fixed point over the module).
    """
    try:
        with open(module_file, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    defs = {n.name: _names(n) for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    launching = {name for name, refs in defs.items() if refs & LAUNCHERS}
    grew = True
    while grew:
        more = {name for name, refs in defs.items() if name not in launching and refs & launching}
        launching |= more
        grew = bool(more)
    return frozenset(launching)


@functools.lru_cache(maxsize=None)
def starts_processes(fn) -> bool:
    """Whether function ``fn`` refers to a launcher, itself or through its module's helpers."""
    fn = inspect.unwrap(fn)
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        module_file = inspect.getsourcefile(fn)
    except (OSError, TypeError):
        return False
    try:
        refs = _names(ast.parse(source))
    except SyntaxError:
        return False
    helpers = _launching_functions(module_file) if module_file else frozenset()
    return bool(refs & (LAUNCHERS | helpers))


def _fixture_functions(item) -> list:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return [d.func for defs in info.name2fixturedefs.values() for d in defs]


def is_cluster_test(item) -> bool:
    """Whether a collected test starts processes: its function or a fixture it uses does."""
    fn = getattr(item, "function", None)
    if fn is not None and starts_processes(fn):
        return True
    return any(starts_processes(f) for f in _fixture_functions(item))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("slow") is None and is_cluster_test(item):
            item.add_marker(pytest.mark.slow)


def _guarded_start(real):
    def start(self, name, args, *a, **kw):
        from kvstore.tools.cluster.processes import SERVICES_MODULE
        if SERVICES_MODULE in args:
            pytest.fail(f"this test {_SLOW_HELP} (it started {name!r})", pytrace=False)
        return real(self, name, args, *a, **kw)
    return start


def _unless_slow(item):
    """Within the hook: ProcessGroup.start refuses kvstore services for a test not marked slow."""
    if item.get_closest_marker("slow") is not None:
        return None
    from kvstore.tools.cluster.processes import ProcessGroup
    real = ProcessGroup.start
    ProcessGroup.start = _guarded_start(real)
    return lambda: setattr(ProcessGroup, "start", real)


@contextlib.contextmanager
def _guarded(item):
    """:func:`_unless_slow` for the length of one hook, undone after it."""
    undo = _unless_slow(item)
    try:
        yield
    finally:
        if undo:
            undo()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        yield


_over_key = pytest.StashKey[list]()


def pytest_configure(config):
    config.stash[_over_key] = []
    if not any(line.startswith("slow:") for line in config.getini("markers")):
        config.addinivalue_line("markers", "slow: starts a cluster of processes or runs over 5 s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when == "call" and report.duration > SLOW_S and item.get_closest_marker("slow") is None:
        item.config.stash[_over_key].append((report.nodeid, report.duration))


def pytest_terminal_summary(terminalreporter, config):
    over = config.stash.get(_over_key, [])
    if over:
        terminalreporter.section(f"over {SLOW_S:.0f} s but not marked slow")
        for nodeid, s in sorted(over, key=lambda x: -x[1]):
            terminalreporter.write_line(f"{s:6.1f} s  {nodeid}")
