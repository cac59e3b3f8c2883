"""The two clocks of a process: monotonic for every deadline and ttl, wall for display.

NTP steps the wall clock (``time.time()``) by seconds or hours; a deadline or
a ttl computed on it would then fire early (a node declared dead, a grant
expired before its put could use it) or never (a dead node kept alive, a lease
held forever). So every deadline, ttl, lease, expiry and age on the master and
the nodes is on :meth:`Clock.monotonic_ms`, which only runs forward. The wall
clock is read only to show a time to a person or another process
(:meth:`Clock.wall_of` turns a monotonic instant into unix ms at the moment it
is shown). A monotonic value never crosses a process boundary: each process's
clock starts at its own origin.

The clock is injectable (:class:`ManualClock` in tests steps the wall clock
while monotonic time runs on).
"""

from __future__ import annotations

import time


class Clock:
    """The system's clocks."""

    def monotonic_ms(self) -> int:
        """Milliseconds on the monotonic clock (an arbitrary origin, never steps)."""
        return time.monotonic_ns() // 1_000_000

    def wall_ms(self) -> int:
        """Unix milliseconds (for display and logs only: may step either way)."""
        return time.time_ns() // 1_000_000

    def wall_of(self, monotonic_ms: int) -> int:
        """The unix ms at which the monotonic clock read ``monotonic_ms`` (0, "never",
        stays 0), as the wall clock reads now."""
        if not monotonic_ms:
            return 0
        return max(0, self.wall_ms() - (self.monotonic_ms() - monotonic_ms))


#: The clock of every process that is not told otherwise.
SYSTEM_CLOCK = Clock()


class ManualClock(Clock):
    """A clock moved by hand (tests): :meth:`advance` moves both clocks, :meth:`step_wall`
    only the wall clock, as NTP does.

    Args:
        monotonic_ms: the starting monotonic reading (not 0: 0 means "never" in places).
        wall_ms: the starting wall reading (unix ms).
    """

    def __init__(self, monotonic_ms: int = 1_000_000, wall_ms: int = 1_700_000_000_000):
        self._mono = monotonic_ms
        self._wall = wall_ms

    def monotonic_ms(self) -> int:
        return self._mono

    def wall_ms(self) -> int:
        return self._wall

    def advance(self, ms: int) -> None:
        """Time passes: both clocks move forward by ``ms``."""
        self._mono += ms
        self._wall += ms

    def step_wall(self, ms: int) -> None:
        """The wall clock alone jumps by ``ms`` (either sign), as an NTP step."""
        self._wall += ms
