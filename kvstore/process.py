"""Running kvstore's processes: the READY handshake and child supervision.

Every service process prints one line ``READY {json}`` on stdout once it
listens (the JSON carries at least its address), then logs to stderr. A
launcher starts children, waits for their READY lines and stops them all
when one dies, on Ctrl-C, or when it exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

READY_PREFIX = "READY "


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


def terminate(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """SIGTERM ``proc`` if it runs, wait up to ``timeout_s``, then SIGKILL it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def announce_ready(info: dict) -> None:
    """Tell the launcher this process is serving (one line on stdout)."""
    sys.stdout.write(READY_PREFIX + json.dumps(info) + "\n")
    sys.stdout.flush()


async def wait_for_stop_signal() -> None:
    """Return when the process gets SIGTERM or SIGINT (call on the serving event loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


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


class Cluster:
    """A set of child processes stopped together (a context manager).

    Args:
        log_dir: where each child's stderr goes (``<name>.log``); None = inherit.
    """

    def __init__(self, log_dir: str | None = None):
        self.children: list[Child] = []
        self.log_dir = log_dir
        self._closed = False

    def start(self, name: str, args: list[str], timeout_s: float = 60.0,
              env: dict | None = None) -> Child:
        """Start ``python -m ...`` style ``args`` and wait for its READY line.

        Raises:
            ChildFailed: it exited or stayed silent for ``timeout_s``.
        """
        stderr = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            stderr = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=stderr,
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
            rc = child.proc.poll()
            where = f" (see {self.log_dir}/{child.name}.log)" if self.log_dir else ""
            raise ChildFailed(f"{child.name} {'exited with ' + str(rc) if rc is not None else 'was not ready in %.0f s' % timeout_s}{where}")
        return result

    @staticmethod
    def _drain(proc: subprocess.Popen) -> None:
        for _ in proc.stdout:
            pass

    def check(self) -> None:
        """Raise :class:`ChildFailed` if any child has exited."""
        for c in self.children:
            rc = c.proc.poll()
            if rc is not None:
                raise ChildFailed(f"{c.name} exited with code {rc}")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every child (reverse start order), then SIGKILL stragglers."""
        if self._closed:
            return
        self._closed = True
        for c in reversed(self.children):
            if c.proc.poll() is None:
                try:
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

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
