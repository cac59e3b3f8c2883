"""Waiting on a condition with a deadline, instead of sleeping and hoping.

Importable from every test module as ``waits`` (``tests/`` is on ``sys.path``
through the root ``conftest.py``). A bare ``time.sleep`` in a test either waits
too long (slow) or not long enough (flaky on a busy machine); these poll a
predicate until it holds and fail the test naming what never happened.
"""

from __future__ import annotations

import asyncio
import time


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05,
               what: str = "the condition"):
    """Poll ``predicate()`` until it returns something truthy, and return that.

    Args:
        predicate: called with no arguments; an exception it raises propagates.
        timeout_s: deadline, seconds (generous: machines running tests are busy).
        interval_s: pause between polls, seconds.
        what: what is waited for, for the failure message.

    Raises:
        AssertionError: ``predicate()`` was still falsy at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}: it never happened")
        time.sleep(interval_s)


async def await_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05,
                      what: str = "the condition"):
    """:func:`wait_until` inside an event loop: ``predicate`` may be a coroutine function.

    Raises:
        AssertionError: ``predicate()`` was still falsy at the deadline.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}: it never happened")
        await asyncio.sleep(interval_s)
