"""Worker liveness: which engine instances the scheduler may route to.

The contract, by side:

* **Scheduler side.** The scheduler reads one flag per instance,
  ``PrefillInstance.alive`` / ``DecodeInstance.alive``, and never routes to
  an instance whose flag is False. :class:`HealthMonitor` is the only writer
  of that flag.
* **Monitor side.** Every ``interval_s`` the monitor probes each instance
  (the engine's ``Status`` RPC, with a ``timeout_s`` deadline)::

      probe result        misses       alive afterwards
      ------------------  -----------  -------------------------------
      UP                  reset to 0   True   (a restarted engine rejoins)
      DOWN (UNAVAILABLE)  -            False  at once: nothing listens there
      TIMEOUT             += 1         False  once misses reach miss_limit

  A busy engine may answer a probe late, so one timeout is not a death; a
  killed engine refuses the connection, so one DOWN is.
* **Request side.** A request whose RPC to an instance failed calls
  :meth:`HealthMonitor.suspect`: that probes the instance at once, so a
  worker that died under a request has left the candidate set before the
  request is retried elsewhere (and a worker that merely returned an error
  stays in).

Thread safety: owned by the conductor's event loop; not locked.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Union

from kvstore.conductor.scheduler import DecodeInstance, PrefillInstance

log = logging.getLogger(__name__)

Instance = Union[PrefillInstance, DecodeInstance]


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class ProbeResult(enum.Enum):
    UP = "up"              # answered
    DOWN = "down"          # refused or reset: the process is gone or shutting down
    TIMEOUT = "timeout"    # no answer within the deadline: busy or hung


#: ``probe(worker, timeout_s) -> (result, detail)``; never raises.
Probe = Callable[["Worker", float], Awaitable[tuple[ProbeResult, str]]]


@dataclass(slots=True)
class Worker:
    """One engine instance as the monitor tracks it."""

    instance: Instance        # the scheduler's record; the monitor writes its `alive`
    role: Role
    misses: int = 0           # probe timeouts in a row
    routed: int = 0           # requests sent to it (attempts, retries included)
    failures: int = 0         # requests to it that failed on transport or deadline
    last_error: str = ""      # why it was last marked dead or failed
    since_ms: float = 0.0     # monitor clock (ms since start) when `alive` last changed

    @property
    def instance_id(self) -> str:
        return self.instance.instance_id


@dataclass(frozen=True, slots=True)
class WorkerState:
    """A copy of one worker's state, for status pages."""

    instance_id: str
    role: Role
    address: str
    alive: bool
    routed: int
    failures: int
    last_error: str
    since_ms: float


class HealthMonitor:
    """Probes the workers periodically and keeps their ``alive`` flags.

    Args:
        prefill: the scheduler's prefill instances (the same objects).
        decode: the scheduler's decode instances.
        probe: how to ask one worker whether it is up.
        interval_s: time between probe rounds.
        timeout_s: deadline of one probe.
        miss_limit: probe timeouts in a row that mark a worker dead.
    """

    def __init__(self, prefill: list[PrefillInstance], decode: list[DecodeInstance], probe: Probe,
                 interval_s: float = 0.5, timeout_s: float = 2.0, miss_limit: int = 3):
        if miss_limit < 1:
            raise ValueError(f"miss_limit must be >= 1, got {miss_limit}")
        ids = [i.instance_id for i in (*prefill, *decode)]
        if len(set(ids)) != len(ids):
            raise ValueError(f"instance ids must be unique, got {ids}")
        self._workers = {i.instance_id: Worker(i, Role.PREFILL) for i in prefill}
        self._workers.update({i.instance_id: Worker(i, Role.DECODE) for i in decode})
        self._probe = probe
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.miss_limit = miss_limit
        self._t0 = time.monotonic()
        self._task: asyncio.Task | None = None

    def worker(self, instance_id: str) -> Worker:
        return self._workers[instance_id]

    def start(self) -> None:
        """Start the periodic probe loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="health-monitor")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)

    async def probe_all(self) -> None:
        """One probe round over every worker, concurrently."""
        await asyncio.gather(*(self.check(w.instance_id) for w in self._workers.values()))

    async def check(self, instance_id: str) -> bool:
        """Probe one worker now and apply the result; returns whether it is alive."""
        w = self._workers[instance_id]
        result, detail = await self._probe(w, self.timeout_s)
        self.apply(w, result, detail)
        return w.instance.alive

    def apply(self, w: Worker, result: ProbeResult, detail: str = "") -> None:
        """Apply one probe result to ``w`` (the table in the module docstring)."""
        if result is ProbeResult.UP:
            w.misses = 0
            self._set_alive(w, True, "")
            return
        if result is ProbeResult.TIMEOUT:
            w.misses += 1
            if w.misses < self.miss_limit:
                return
            detail = f"{w.misses} probes without answer in {self.timeout_s:.1f} s: {detail}"
        self._set_alive(w, False, detail or result.value)

    def _set_alive(self, w: Worker, alive: bool, why: str) -> None:
        if w.instance.alive == alive:
            return
        w.instance.alive = alive
        w.since_ms = (time.monotonic() - self._t0) * 1000.0
        if alive:
            log.info("%s %s is back: routing to it again", w.role.value, w.instance_id)
        else:
            w.last_error = why
            log.warning("%s %s is dead (%s): no more requests go to it",
                        w.role.value, w.instance_id, why)

    def routed(self, instance_id: str) -> None:
        """Count a request (attempt) sent to ``instance_id``."""
        self._workers[instance_id].routed += 1

    async def suspect(self, instance_id: str, error: str) -> bool:
        """A request to ``instance_id`` failed with ``error``: probe it now.

        Returns:
            Whether the worker is still alive after the probe.
        """
        w = self._workers[instance_id]
        w.failures += 1
        w.last_error = error
        return await self.check(instance_id)

    def snapshot(self) -> list[WorkerState]:
        """Every worker's state, prefill first, in configuration order."""
        return [WorkerState(w.instance_id, w.role, w.instance.address, w.instance.alive, w.routed,
                            w.failures, w.last_error, w.since_ms)
                for w in self._workers.values()]
