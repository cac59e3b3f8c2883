"""CPU time of the processes behind a row, over its timed rounds: µs of CPU per operation.

Wall time on this shared host moves with whatever else runs; the CPU time a
process spends per operation hardly does, and it says which process an
operation costs (issue 33: the node's, the master's, the client's; and the
peers' redis-server and Mooncake processes beside them).

A :class:`CpuMeter` names the processes of one system (``{"node": pid,
"master": pid, "client": os.getpid()}``) and reads their CPU time together;
:func:`~kvstore.tools.bench.harness.timed` reads it when the timed rounds
begin and when they end, and the row divides each process's difference by
the operations of those rounds.

What is read, per process (all its threads, living and exited): its CPU
clock (``clock_gettime`` on the process's CPU-time clock id, as glibc's
``clock_getcpuclockid`` builds it), in ns: the kernel's run time of the
process, the counter that ``/proc/PID/stat``'s utime + stime are scaled
from. Where that clock cannot be read, utime + stime from ``/proc/PID/stat``
in clock ticks (``SC_CLK_TCK``, 10 ms here): with 3,000 operations in a
row that is 3.3 µs per operation per process, so a row records the
resolution of its coarsest reading (``cpu_resolution_us``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

#: Seconds per tick of ``/proc/PID/stat``'s utime and stime.
PROC_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
#: Resolution of a process CPU clock reading (ns), as the kernel reports it.
CLOCK_TICK_S = 1e-9


def _cpu_clock_id(pid: int) -> int:
    """The clock id of ``pid``'s CPU time, all threads (Linux: ``MAKE_PROCESS_CPUCLOCK(pid,
    CPUCLOCK_SCHED)``, what glibc's ``clock_getcpuclockid`` returns)."""
    return ((~pid) << 3) | 2


def proc_stat_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` from ``/proc/PID/stat``, in seconds (clock-tick resolution).

    Raises:
        OSError: the process is gone or /proc cannot say.
    """
    with open(f"/proc/{pid}/stat", "rb") as f:
        # comm (field 2) may hold spaces and parentheses: fields count from the last ")".
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * PROC_TICK_S


@dataclass(slots=True)
class CpuMeter:
    """CPU seconds of named processes, read together: ``{"node": pid, "client": pid, ...}``.

    A process whose CPU clock cannot be read falls back to ``/proc/PID/stat``
    (:attr:`tick_s` then says 10 ms); a process that is gone is left out of
    the reading. Plain fields: a worker process builds its own from pids.
    """

    pids: dict[str, int]
    _source: dict[int, bool] = field(default_factory=dict)   # pid -> its CPU clock works

    def _read(self, pid: int) -> float:
        if self._source.get(pid, True):
            try:
                seconds = time.clock_gettime(_cpu_clock_id(pid))
                self._source[pid] = True
                return seconds
            except OSError:
                self._source[pid] = False
        return proc_stat_cpu_s(pid)

    def sample(self) -> dict[str, float]:
        """CPU seconds each named process has used so far (the gone ones left out)."""
        out = {}
        for name, pid in self.pids.items():
            try:
                out[name] = self._read(pid)
            except (OSError, IndexError, ValueError):
                pass
        return out

    @property
    def tick_s(self) -> float:
        """Resolution of the coarsest reading so far, in seconds."""
        return PROC_TICK_S if not all(self._source.values()) else CLOCK_TICK_S


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds each process used between two :meth:`CpuMeter.sample` readings."""
    return {name: after[name] - before[name] for name in after if name in before}


def add_cpu(*used: dict[str, float]) -> dict[str, float]:
    """Several :func:`cpu_used` results summed per process name (rounds, or client processes)."""
    out: dict[str, float] = {}
    for u in used:
        for name, seconds in u.items():
            out[name] = out.get(name, 0.0) + seconds
    return out


def this_process(name: str = "client") -> CpuMeter:
    """A meter of the calling process alone (the client side of a loop it runs)."""
    return CpuMeter({name: os.getpid()})
