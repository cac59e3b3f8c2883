"""Tests for kvstore.conductor.health.HealthMonitor, driven by scripted probe results (no network)."""

from __future__ import annotations

from kvstore.conductor.health import HealthMonitor, ProbeResult, Role
from kvstore.conductor.scheduler import DecodeInstance, PrefillInstance, SchedRequest, Scheduler


def _setup(results: dict[str, list[ProbeResult]], miss_limit: int = 3):
    prefill = [PrefillInstance("p0", "a:1"), PrefillInstance("p1", "a:2")]
    decode = [DecodeInstance("d0", "a:3")]

    async def probe(w, timeout_s):
        script = results.get(w.instance_id)
        return (script.pop(0) if script else ProbeResult.UP), "scripted"

    mon = HealthMonitor(prefill, decode, probe, miss_limit=miss_limit)
    return mon, Scheduler(prefill, decode)


async def test_down_is_dead_at_once_and_leaves_the_scheduler():
    mon, sched = _setup({"p1": [ProbeResult.DOWN]})
    await mon.probe_all()
    assert not mon.worker("p1").instance.alive
    req = SchedRequest("r", prompt_tokens=100)
    assert {sched.schedule(req, 0.0).prefill.instance.instance_id for _ in range(5)} == {"p0"}
    assert mon.worker("p1").last_error == "scripted"


async def test_timeouts_need_miss_limit_in_a_row():
    mon, _ = _setup({"p0": [ProbeResult.TIMEOUT, ProbeResult.TIMEOUT, ProbeResult.UP,
                            ProbeResult.TIMEOUT, ProbeResult.TIMEOUT, ProbeResult.TIMEOUT]})
    alive = []
    for _ in range(6):
        await mon.probe_all()
        alive.append(mon.worker("p0").instance.alive)
    assert alive == [True, True, True, True, True, False]


async def test_a_dead_worker_that_answers_rejoins():
    mon, _ = _setup({"d0": [ProbeResult.DOWN, ProbeResult.UP]})
    assert not await mon.check("d0")
    assert await mon.check("d0")
    states = {s.instance_id: s for s in mon.snapshot()}
    assert states["d0"].alive and states["d0"].role is Role.DECODE


async def test_suspect_counts_the_failure_and_probes():
    mon, _ = _setup({"p0": [ProbeResult.DOWN]})
    mon.routed("p0")
    assert not await mon.suspect("p0", "UNAVAILABLE: reset")
    s = mon.snapshot()[0]
    assert (s.instance_id, s.routed, s.failures, s.alive) == ("p0", 1, 1, False)
