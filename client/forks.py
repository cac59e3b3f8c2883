"""What the SDK's objects do in a forked child (``os.fork``, multiprocessing's fork start).

A child inherits its parent's sockets: a master link or a data connection the
two processes then both use interleaves their requests, and an answer meant
for one reaches the other (a lookup answered with another key's metadata, a
read with another key's bytes). The SDK's objects that hold connections
register a method here; in a child, each forgets the parent's connections
(closing its own copies of their file descriptors) and opens new ones at its
next use. The methods are held weakly: a client that is gone is not kept.

Thread safety: registration may come from any thread; the methods run in the
child's only thread, right after the fork.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Callable

log = logging.getLogger(__name__)
_hooks: list[weakref.WeakMethod] = []
_lock = threading.Lock()


def in_forked_child(method: Callable[[], None]) -> None:
    """Call ``method`` (a bound method, held weakly) in every child this process forks."""
    with _lock:
        if len(_hooks) >= 64:
            _hooks[:] = [ref for ref in _hooks if ref() is not None]
        _hooks.append(weakref.WeakMethod(method))


def _after_fork() -> None:
    global _lock
    _lock = threading.Lock()       # a thread of the parent may have held it at the fork
    for ref in list(_hooks):
        method = ref()
        if method is not None:
            try:
                method()
            except Exception:              # noqa: BLE001 - one client must not stop the rest
                log.exception("a client's cleanup after fork failed")


os.register_at_fork(after_in_child=_after_fork)
