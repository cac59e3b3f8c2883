"""One deadline per SDK call: the whole time it may take, retries and waits included.

Every call of both SDKs (:class:`~kvstore.client.client.KVClient`,
:class:`~kvstore.client.aio.AsyncKVClient`) gets one :class:`Deadline` when it
starts, from the client's ``timeout_s`` and ``failover_wait_s``::

    start                      retry_until                       end
      |-- attempts, failovers, ---|                                |
      |   warm-up waits, regrants,|  the attempt in flight may     |
      |   waits for a writer      |  finish; none starts           |
      |<------ failover_wait_s -->|                                |
      |<------------- max(timeout_s, failover_wait_s) ------------>|

Nothing of a call runs past ``end``: each master RPC gets the gRPC deadline
``min(timeout_s, left)``, each wait on a node ``min(its timeout, left)``; and
no new attempt (another master, the same one again, a new grant, another wait
for a writer or a warming master) starts after ``retry_until``. So a call that
keeps meeting failures (a hung master, a shard without a leader, several
shards in turn, node failures then a master failure) ends by its deadline, not
after a wait per attempt, shard or round.

The deadline travels in a :class:`contextvars.ContextVar`: the outermost SDK
call of a thread or an asyncio task sets it, and what that call does inside
(nested calls, the tasks it gathers) shares it. Work not done for one call (a
grant refreshed in the background, a fetch several puts wait on) runs
without one, and each master call of it gets a deadline of its own.

Thread safety: a Deadline is immutable; the ContextVar is per thread and per
asyncio task.
"""

from __future__ import annotations

import contextvars
import time
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Deadline:
    """When one SDK call must end, and until when it may start new attempts."""

    retry_until: float    # monotonic s: no new attempt or wait starts after it
    end: float            # monotonic s: nothing of the call runs past it

    @classmethod
    def after(cls, timeout_s: float, failover_wait_s: float) -> "Deadline":
        """The deadline of a call starting now (the rule in the module doc)."""
        now = time.monotonic()
        return cls(now + failover_wait_s, now + max(timeout_s, failover_wait_s))

    def left_s(self) -> float:
        """Seconds until ``end`` (<= 0: passed)."""
        return self.end - time.monotonic()

    def may_retry(self) -> bool:
        """Whether a new attempt or wait may start now."""
        return time.monotonic() < min(self.retry_until, self.end)

    def bound(self, timeout_s: float) -> float:
        """``timeout_s`` cut to what is left of the call (0.0: nothing is)."""
        return max(0.0, min(timeout_s, self.end - time.monotonic()))


_CURRENT: ContextVar[Deadline | None] = ContextVar("call_deadline", default=None)

#: A deadline that ended this long ago (s) is no running call's: nothing of a call runs
#: past its end, so it was left behind (a scope that never reset it). It is ignored, so
#: that it cannot fail every later call of its thread at once ("the call's deadline
#: passed before master ... could be asked; no attempt was made": 90 tests in two CI
#: runs, after a call cut short by a signal handler's exception left its deadline,
#: which :class:`call_scope` now undoes; this stays as the second line).
STALE_AFTER_S = 1.0


def _running() -> Deadline | None:
    dl = _CURRENT.get()
    if dl is not None and dl.end < time.monotonic() - STALE_AFTER_S:
        return None
    return dl


def current() -> Deadline | None:
    """The deadline of the SDK call running in this thread or task, if any."""
    return _running()


def of_call(timeout_s: float, failover_wait_s: float) -> Deadline:
    """The running call's deadline, or a new one for work done outside any call."""
    return _running() or Deadline.after(timeout_s, failover_wait_s)


class call_scope:
    """Run an SDK call under one deadline (``with call_scope(...):``): the enclosing
    call's when there is one (a call made inside another shares its deadline),
    else a new one. A class, not a generator: it wraps every get and put."""

    __slots__ = ("_timeout_s", "_failover_wait_s", "_token")

    def __init__(self, timeout_s: float, failover_wait_s: float):
        self._timeout_s = timeout_s
        self._failover_wait_s = failover_wait_s
        self._token = None

    def __enter__(self) -> None:
        if _running() is None:
            prev = _CURRENT.get()
            try:
                self._token = _CURRENT.set(Deadline.after(self._timeout_s, self._failover_wait_s))
            except BaseException:
                # An exception from a signal handler (Ctrl-C) can come as the set returns,
                # before its token is kept: nothing would ever reset it.
                _CURRENT.set(prev)
                raise

    def __exit__(self, *exc) -> None:
        self.leave()

    def leave(self) -> None:
        """Reset what :meth:`__enter__` set; idempotent. The SDK calls it again after
        the ``with``: an exception from a signal handler can cut ``__exit__`` short
        before it runs a line (tests/integration/test_interrupted_calls.py raises one
        at random points of calls, hundreds of times)."""
        token = self._token
        if token is not None:
            try:
                _CURRENT.reset(token)
            except (RuntimeError, ValueError):   # reset already (cut short after), another context
                pass
            self._token = None


def unscoped_context() -> contextvars.Context:
    """A copy of this context without the running call's deadline, for an asyncio
    task that works for several calls (``loop.create_task(coro, context=...)``)."""
    ctx = contextvars.copy_context()
    ctx.run(_CURRENT.set, None)
    return ctx
