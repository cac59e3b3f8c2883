"""Workers killed (SIGKILL) while requests flow.

Cluster: master, 2 store nodes, 2 prefill engines, 2 decode engines, the
conductor. Four clients send requests back to back through the conductor's
gRPC ``Generate``. Once prefill1 has two requests in its queue, it is killed.
Then:

* it leaves the candidate set within seconds (conductor ``Status``);
* no request is routed to it afterwards (its routed count stays put, and
  every later request ran on prefill0 at the first attempt);
* no request hangs: each ends within its client timeout, and each either
  finished with all its tokens (those caught on prefill1 were retried on
  prefill0, with the same tokens as a plain greedy run) or carries a reason.

The same for decode1, killed while it streams. And with prefill0 killed
too, requests are rejected at once, with the reason. The tests run in file
order on one cluster.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from dataclasses import dataclass, field

import grpc
import pytest

from kvstore.engines.generate import greedy_generate
from kvstore.engines.model import LlamaModel
from kvstore.client.models import model_config
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.tools.cluster.launcher import ClusterSpec, LocalCluster
from waits import await_until

BLOCK_TOKENS = 16
MAX_TOKENS = 4
CLIENT_TIMEOUT_S = 20.0      # a request still open after this has hung
# A killed worker must leave the candidate set within this: the conductor's probes
# (every 0.2 s, 1 s timeout) find it in about a second; without them it would stay
# until a request's 15 s prefill timeout. Its speed is not timed here.
DETECT_LIMIT_S = 10.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spec = ClusterSpec(num_prefill=2, num_decode=2, node_dram="64MiB", kv_pages=512,
                       block_tokens=BLOCK_TOKENS,
                       log_dir=str(tmp_path_factory.mktemp("worker-failure-logs")),
                       conductor_args=("--probe-interval-s", "0.2", "--probe-timeout-s", "1.0",
                                       "--prefill-timeout-s", "15", "--decode-timeout-s", "10"))
    with LocalCluster(spec) as c:
        yield c


@dataclass
class Outcome:
    prompt: list[int]
    started: float
    ended: float = 0.0
    tokens: list[int] = field(default_factory=list)
    last: spb.GenerateChunk | None = None
    hung: bool = False


async def _run_one(stub, rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Outcome:
    out = Outcome(prompt, time.monotonic())

    async def consume() -> None:
        async for chunk in stub.Generate(spb.GenerateRequest(
                request_id=rid, prompt_tokens=prompt, max_tokens=max_tokens)):
            out.tokens += chunk.tokens
            if chunk.done:
                out.last = chunk

    try:
        await asyncio.wait_for(consume(), CLIENT_TIMEOUT_S)
    except asyncio.TimeoutError:
        out.hung = True
    out.ended = time.monotonic()
    return out


async def _status(stub) -> dict[str, spb.WorkerState]:
    st = await stub.Status(spb.ConductorStatusRequest(), timeout=5)
    return {w.instance_id: w for w in st.workers}


async def _busy(address: str, role: str) -> bool:
    """Whether an engine has two requests or more, queued or running (its own Status).

    Two, not one: the one running might finish between this answer and the
    kill; the one behind it cannot.
    """
    stub_cls = spb_grpc.PrefillEngineStub if role == "prefill" else spb_grpc.DecodeEngineStub
    async with grpc.aio.insecure_channel(address) as ch:
        st = await stub_cls(ch).Status(spb.EngineStatusRequest(), timeout=2)
        return st.queued + st.running >= 2


async def _until(cond, limit_s: float, what: str) -> float:
    """Wait until ``await cond()`` holds (at most ``limit_s``); returns when it did."""
    await await_until(cond, timeout_s=limit_s, what=what)
    return time.monotonic()


def _check_ended_with_reason(outcomes: list[Outcome], max_tokens: int = MAX_TOKENS) -> None:
    for o in outcomes:
        assert not o.hung, f"request hung for {CLIENT_TIMEOUT_S} s"
        assert o.last is not None, "stream ended without a final chunk"
        if o.last.error or o.last.rejected:
            assert o.last.error, "a failed request must say why"
        else:
            assert len(o.tokens) == max_tokens


class _Load:
    """Four clients sending distinct prompts back to back until stopped."""

    def __init__(self, stub, prompt_len: tuple[int, int], max_tokens: int, seed: int):
        self.stub = stub
        self.seed = seed
        self.rng = random.Random(seed)
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _client(self, k: int) -> None:
        i = 0
        while not self._stop.is_set():
            # Distinct prompts (no cache hits): real prefill work.
            prompt = [self.rng.randrange(2048) for _ in range(self.rng.randrange(*self.prompt_len))]
            self.outcomes.append(await _run_one(self.stub, f"s{self.seed}-c{k}-{i}", prompt,
                                                self.max_tokens))
            i += 1

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(k)) for k in range(4)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def finished_after(self, t: float, n: int) -> bool:
        """Whether ``n`` requests that started after ``t`` have ended."""
        return sum(o.started > t for o in self.outcomes) >= n

    async def served_by(self, *names: str) -> bool:
        ok = [o.last.metrics for o in self.outcomes if o.last and not o.last.error]
        seen = {m.prefill_instance for m in ok} | {m.decode_instance for m in ok}
        return set(names) <= seen


async def _kill_under_load(stub, load: _Load, victim, kind: str) -> tuple[float, float, int]:
    """Wait until both ``kind`` instances serve and ``victim`` (``<kind>1``) is
    busy, kill -9 it, wait until it leaves the candidates and 6 more requests
    have started. Returns (kill time, time it left, its routed count then)."""
    name = f"{kind}1"
    await _until(lambda: load.served_by(f"{kind}0", name), 20, f"both {kind} instances serving")
    await _until(lambda: _busy(victim.info["address"], kind), 10, f"work on {name}")
    t_kill = time.monotonic()
    os.kill(victim.proc.pid, signal.SIGKILL)

    async def victim_dead() -> bool:
        return not (await _status(stub))[name].alive
    t_dead = await _until(victim_dead, DETECT_LIMIT_S, f"{name} leaving the candidates")
    routed_at_dead = (await _status(stub))[name].routed
    # Requests keep flowing, on the other instance only.
    await _until(lambda: load.finished_after(t_dead, 6), 30, "6 requests after the kill")
    return t_kill, t_dead, routed_at_dead


async def test_killed_prefill_leaves_candidates_and_requests_finish(cluster):
    victim = cluster.process("prefill1")
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = spb_grpc.ConductorStub(ch)
        load = _Load(stub, prompt_len=(64, 192), max_tokens=MAX_TOKENS, seed=0)
        load.start()
        try:
            # Both instances serve, then prefill1 is killed with work in its queue.
            t_kill, t_dead, routed_at_dead = await _kill_under_load(stub, load, victim, "prefill")
        finally:
            await load.stop()
        final = await _status(stub)

    outcomes = load.outcomes
    _check_ended_with_reason(outcomes)
    assert final["prefill1"].routed == routed_at_dead, "a request was routed to the dead worker"
    assert "UNAVAILABLE" in final["prefill1"].last_error
    after = [o for o in outcomes if o.started > t_dead]
    for o in after:
        assert o.last.metrics.prefill_instance == "prefill0"
        assert o.last.metrics.prefill_attempts == 1
    # The requests caught on prefill1 finished on prefill0.
    retried = [o for o in outcomes if o.last.metrics.prefill_attempts > 1]
    assert retried, "no request was in flight on the killed worker"
    for o in retried:
        assert not o.last.error, o.last.error
        assert o.last.metrics.prefill_instance == "prefill0"
        assert t_kill <= o.ended
    # Their tokens are the plain greedy tokens.
    model = LlamaModel.random(model_config("tiny"))
    for o in retried[:3]:
        assert o.tokens == greedy_generate(model, o.prompt, MAX_TOKENS, page_tokens=BLOCK_TOKENS)
    assert cluster.process("prefill0").proc.poll() is None, "prefill0 died"


async def test_killed_decode_leaves_candidates_and_requests_end(cluster):
    """decode1 is killed while streaming: its requests end with a reason or finish elsewhere."""
    victim = cluster.process("decode1")
    max_tokens = 48                       # long streams: the kill lands mid-stream
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = spb_grpc.ConductorStub(ch)
        load = _Load(stub, prompt_len=(8, 40), max_tokens=max_tokens, seed=1)
        load.start()
        try:
            _t_kill, t_dead, routed_at_dead = await _kill_under_load(stub, load, victim, "decode")
        finally:
            await load.stop()
        final = await _status(stub)

    outcomes = load.outcomes
    _check_ended_with_reason(outcomes, max_tokens)
    assert final["decode1"].routed == routed_at_dead, "a request was routed to the dead worker"
    hit = [o for o in outcomes if o.last.error or o.last.metrics.decode_attempts > 1]
    assert hit, "no request was in flight on the killed worker"
    for o in hit:
        if o.last.error:      # cut mid-stream: ended with the reason
            assert "decode1" in o.last.error and "UNAVAILABLE" in o.last.error
        else:                 # before its first decode token: retried on decode0
            assert o.last.metrics.decode_instance == "decode0"
    after = [o for o in outcomes if o.started > t_dead]
    assert after and all(o.last.metrics.decode_instance == "decode0" and not o.last.error
                         for o in after)


async def test_no_live_prefill_rejects_with_reason(cluster):
    """Runs after the test above (prefill1 is dead): kill prefill0 as well."""
    os.kill(cluster.process("prefill0").proc.pid, signal.SIGKILL)
    async with grpc.aio.insecure_channel(cluster.conductor) as ch:
        stub = spb_grpc.ConductorStub(ch)
        outcomes = await asyncio.gather(*(_run_one(stub, f"late-{i}", [1, 2, 3, 4 + i])
                                          for i in range(4)))
        _check_ended_with_reason(outcomes)
        assert all(not o.tokens and o.last.error for o in outcomes)

        async def both_dead() -> bool:
            st = await _status(stub)
            return not st["prefill0"].alive and not st["prefill1"].alive
        await _until(both_dead, DETECT_LIMIT_S, "prefill0 leaving the candidates")
        o = await _run_one(stub, "rejected", [5, 6, 7])
    assert o.last.rejected and "no live prefill instance" in o.last.error
    assert o.last.error_code == "UNAVAILABLE"      # no engine, not load: the front's 503
    assert o.ended - o.started < 10.0   # rejected, not queued until the 15 s prefill timeout
