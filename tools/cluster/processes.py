"""Child processes of a launcher: start, wait for READY, watch, stop together.

Every kvstore service prints one line ``READY {json}`` on stdout once it
listens (:func:`kvstore.process.announce_ready`; the JSON carries at least
its address), then logs to stderr. A :class:`ProcessGroup` starts children
(usually services, through :mod:`kvstore.tools.cli.services`), waits for their
READY lines, and stops them all when one dies, on Ctrl-C, or when it exits.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from kvstore.process import EXIT_WITH_LAUNCHER_ENV, READY_PREFIX

#: The log files of the children started last in this process (newest last): a test
#: harness shows the tails of those a failed test wrote to (tests/conftest.py).
RECENT_LOGS: collections.deque[str] = collections.deque(maxlen=64)

#: The module every service process runs (``python -m kvstore.tools.cli.services NAME ...``).
SERVICES_MODULE = "kvstore.tools.cli.services"


def service_args(service: str, *args: str) -> list[str]:
    """Interpreter arguments that run ``service`` (``master``, ``node``, ...) with ``args``."""
    return ["-m", SERVICES_MODULE, service, *args]


def _load_prctl():
    """libc's prctl, loaded here in the parent (a forked child must not load a library)."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl() if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def stop_with_launcher() -> None:
    """A ``preexec_fn`` for a program that is no service of ours (redis-server,
    mooncake_master): the kernel sends it SIGTERM when the thread that started it
    ends (start it from the main thread). Our services watch their parent themselves
    (:func:`kvstore.process.exit_with_launcher`)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def terminate(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """SIGTERM ``proc`` if it runs, wait up to ``timeout_s``, then SIGKILL it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux; else IANA's)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago (bound together, then released).

    A port that a process is told to listen on later (a master's, named in the
    static shard map before any master starts) must not come from the
    ephemeral range: any outgoing connection made meanwhile (a master's to
    etcd, a node's to its master) may be given it, and the listener then fails
    with EADDRINUSE. So the ports are drawn at random below that range, where
    only explicit binds land.
    """
    low, high = ephemeral_port_range()
    # Below the range (from 10000) or, where it starts too low, above it.
    lo, hi = (10000, low - 1) if low > 11000 else (high + 1, 65535)
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        tries = 50 * n if hi - lo >= 1000 else 0
        while len(socks) < n and tries > 0:
            tries -= 1
            s = socket.socket()
            try:
                s.bind((host, rng.randint(lo, hi)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:            # no such range, or a crowded one: any free port
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One port as :func:`free_ports` picks them."""
    return free_ports(1, host)[0]


class ChildFailed(RuntimeError):
    """A child process exited before it was ready, or died while running."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    info: dict = field(default_factory=dict)   # the READY payload

    @property
    def address(self) -> str:
        return self.info["address"]


class ProcessGroup:
    """A set of child processes stopped together (a context manager).

    Args:
        log_dir: where each child's stderr goes (``<name>.log``); None = inherit.
    """

    def __init__(self, log_dir: str | None = None):
        self.children: list[Child] = []
        self.log_dir = log_dir
        self._closed = False

    def start(self, name: str, args: list[str], timeout_s: float = 60.0,
              env: dict | None = None, prefix: list[str] | None = None) -> Child:
        """Start ``python ARGS`` (e.g. :func:`service_args`) and wait for its READY line.

        ``prefix`` runs it through another command that execs it, e.g. on a
        host of :class:`~kvstore.tools.cluster.netns.NetHosts` (``ip netns exec NS``).

        Raises:
            ChildFailed: it exited or stayed silent for ``timeout_s``.
        """
        stderr = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            stderr = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
            RECENT_LOGS.append(stderr.name)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", EXIT_WITH_LAUNCHER_ENV: "1",
                    **(env or {})}
        proc = subprocess.Popen([*(prefix or ()), sys.executable, *args],
                                stdout=subprocess.PIPE, stderr=stderr,
                                stdin=subprocess.DEVNULL, env=full_env, start_new_session=True)
        if stderr is not None:
            stderr.close()
        child = Child(name, proc)
        self.children.append(child)
        child.info = self._wait_ready(child, timeout_s)
        # Keep draining stdout so a chatty child never blocks on a full pipe.
        threading.Thread(target=self._drain, args=(proc,), daemon=True).start()
        return child

    def _wait_ready(self, child: Child, timeout_s: float) -> dict:
        result: dict = {}

        def read() -> None:
            for raw in child.proc.stdout:
                line = raw.decode(errors="replace").strip()
                if line.startswith(READY_PREFIX):
                    result.update(json.loads(line[len(READY_PREFIX):]))
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout_s)
        if not result:
            if not t.is_alive():         # stdout closed: the child is exiting
                try:
                    child.proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    pass
            rc = child.proc.poll()
            where = f" (see {self.log_dir}/{child.name}.log)" if self.log_dir else ""
            state = f"exited with {rc}" if rc is not None else f"was not ready in {timeout_s:.0f} s"
            raise ChildFailed(f"{child.name} {state}{where}")
        return result

    @staticmethod
    def _drain(proc: subprocess.Popen) -> None:
        for _ in proc.stdout:
            pass

    def child(self, name: str) -> Child:
        """The child called ``name``.

        Raises:
            KeyError: no such child.
        """
        for c in self.children:
            if c.name == name:
                return c
        raise KeyError(name)

    def wait_idle(self, busy_below: float = 0.1, window_s: float = 0.5,
                  timeout_s: float = 60.0) -> float:
        """Wait until every child's CPU use stays below ``busy_below`` (cores) for
        one ``window_s``, e.g. a node's segment prefault (seconds of one core
        after READY) before a measurement. Linux only (``/proc``); elsewhere
        every child reads as idle, so it returns after one window.

        Returns:
            The seconds waited (``timeout_s`` if they never went idle).
        """
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            before = [_cpu_seconds(c.proc.pid) for c in self.children]
            time.sleep(window_s)
            used = [_cpu_seconds(c.proc.pid) - b for c, b in zip(self.children, before)]
            if all(u < busy_below * window_s for u in used):
                break
        return time.monotonic() - t0

    def check(self) -> None:
        """Raise :class:`ChildFailed` if any child has exited."""
        for c in self.children:
            rc = c.proc.poll()
            if rc is not None:
                raise ChildFailed(f"{c.name} exited with code {rc}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every child (reverse start order), then SIGKILL stragglers. A child
        stopped with SIGSTOP (a test's hung process) is resumed first: a stopped
        process cannot act on SIGTERM."""
        if self._closed:
            return
        self._closed = True
        for c in reversed(self.children):
            if c.proc.poll() is None:
                try:
                    c.proc.send_signal(signal.SIGCONT)
                    c.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout_s
        for c in reversed(self.children):
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds ``pid`` has used (0.0 if /proc cannot say)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
