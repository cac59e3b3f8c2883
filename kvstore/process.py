"""Service process runtime: logging, the READY handshake, stop signals.

Every service process prints one line ``READY {json}`` on stdout once it
listens (the JSON carries at least its address), then logs to stderr; a
launcher (:mod:`kvstore.tools.processes`) waits for that line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys

READY_PREFIX = "READY "


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
