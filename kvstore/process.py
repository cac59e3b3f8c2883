"""Service process runtime: logging, the READY handshake, stop signals.

Every service process prints one line ``READY {json}`` on stdout once it
listens (the JSON carries at least its address), then logs to stderr; a
launcher (:mod:`kvstore.tools.cluster.processes`) waits for that line. A process it
launched stops (as on SIGTERM) when the launcher is gone: a launcher killed
(SIGKILL, the OOM killer) otherwise left its cluster running, gigabytes of
segments included.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import signal
import sys
import threading
import time

READY_PREFIX = "READY "
#: Set by the launcher in its children's environment: stop when it is gone.
EXIT_WITH_LAUNCHER_ENV = "KVSTORE_EXIT_WITH_LAUNCHER"
_PARENT_PID = os.getppid()            # at import, before the launcher could have gone


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")


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


def exit_with_launcher(check_s: float = 1.0) -> None:
    """When the environment says so (:data:`EXIT_WITH_LAUNCHER_ENV`), stop this process
    once its launcher is gone (:func:`watch_parent` of the parent it started under)."""
    if os.environ.get(EXIT_WITH_LAUNCHER_ENV) == "1":
        watch_parent(_PARENT_PID, check_s)


def watch_parent(parent_pid: int, check_s: float = 1.0) -> None:
    """Send this process SIGTERM once ``parent_pid`` is no longer its parent (it died
    and this process was re-parented), checked every ``check_s`` on a daemon thread."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(check_s)
        logging.getLogger(__name__).warning("the launcher (pid %d) is gone: stopping",
                                            parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def memory_limit_bytes() -> int:
    """The memory this process may use: its cgroup's limit (cgroup v2 ``memory.max``)
    where one is set, else the machine's (``MemTotal``); 0 when neither can be read."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            return int(limit)
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def freeze_survivors() -> None:
    """Take the objects that outlived a young collection out of the cyclic GC's scans.

    A master's index and a node's table are millions of long-lived objects;
    CPython's full collection walks every one of them (about 0.5 s per
    million index entries), holding the GIL: every call, heartbeat and data
    transfer of the process waits. Called every fraction of a second by the
    service's own loop: a collection of the young generations first (cheap,
    bounded by the GC thresholds), then ``gc.freeze()`` (O(1)) moves what is
    left to the permanent generation, so a full collection only walks what
    was created since. Freed objects are still freed by reference counting;
    only a reference cycle that was alive at a freeze and dies later is never
    collected (the services make none on their steady paths).
    """
    gc.collect(1)
    gc.freeze()
