"""Conductor process: accepts requests, schedules prefill and decode, streams tokens.

:meth:`Conductor.generate` runs one request through the disaggregated
pipeline::

    prefix keys -> store hits -> Scheduler.schedule: (prefill, decode) or refused
                -> Prefill (first token: TTFT) -> Scheduler.admit_decode (late check)
                -> Decode stream (later tokens: TBT) -> metrics

The scheduler is the simulator's (FAST'25 Algorithm 1 and early rejection,
:mod:`kvstore.conductor.scheduler`); :mod:`kvstore.conductor.live_state` keeps
its inputs as the simulator does.

TTFT and TBT are measured here, from the moment the request reaches the
conductor. The gRPC ``Conductor`` servicer and the HTTP front
(:mod:`kvstore.conductor.http`) are thin over :class:`Conductor`.

Worker failures (see :mod:`kvstore.conductor.health` for liveness):

* A Prefill RPC that fails with UNAVAILABLE (the worker died under it, or
  could not reach the store) is retried on another instance, after the
  failed instance was probed, so a dead one is out of the candidate set.
* A Decode stream that fails with UNAVAILABLE before its first token is
  retried on another decode instance, after a fresh prefill (the failed
  decoder may have consumed the request's transfer keys); after decode
  tokens went out, the request ends with an error.
* Every RPC has a deadline (:class:`Deadlines`), so no request hangs on a
  stuck worker: it ends with ``error`` and ``error_code`` set.
* A scheduler rejection ends the request with ``rejected``, the reason in
  ``error`` and ``error_code`` RESOURCE_EXHAUSTED (an SLO, KV room: the HTTP
  front's 429), or UNAVAILABLE when no instance of a role is live (503).

Thread safety: everything runs on the conductor's event loop; the blocking
store client is called through ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from contextlib import aclosing
from typing import AsyncIterator, Awaitable, Callable

import grpc

from kvstore.client import KVClient, KVStoreError, Namespace, NotFound, prefix_keys
from kvstore.client.models import model_config, namespace_for_model
from kvstore.keys import tenant_namespace, valid_tenant
from kvstore.client.transfer_keys import is_transfer_key
from kvstore.conductor.arrival_order import ArrivalOrder
from kvstore.conductor.health import HealthMonitor, ProbeResult, Worker
from kvstore.conductor.instances import DecodeChoice, RejectReason, SchedRequest
from kvstore.conductor.live_state import DecisionLog, PrefillQueues, SharedStoreView
from kvstore.conductor.config import ConductorConfig, Deadlines, conductor_cost_model
from kvstore.conductor.scheduler import DecodeInstance, PrefillInstance, Scheduler, Slo
from kvstore._proto import serving_pb2 as spb
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore import rpc
from kvstore.auth import Role
from kvstore.binding import advertised_host, check_binding
from kvstore.conductor.metrics import ConductorMetrics
from kvstore.conductor.tokenizer import load_tokenizer
from kvstore.errors import RETRYABLE_STATUS
from kvstore.health import Health, State, drain
from kvstore.metrics import ProcessMetrics, check_metrics_binding, start_metrics
from kvstore.process import announce_ready, wait_for_stop_signal
from kvstore.rpc import ClientCredentials

log = logging.getLogger(__name__)

#: At most this many ``GenerateRequest.stop_token_ids``.
MAX_STOP_TOKENS = 64


def _ms() -> float:
    return time.perf_counter() * 1000.0


class _RequestFailed(Exception):
    """Ends a request: rejected (no capacity) or failed (with a gRPC code)."""

    def __init__(self, code: grpc.StatusCode, message: str, rejected: bool = False,
                 reason: str = "no_instance"):
        super().__init__(message)
        self.code = code
        self.rejected = rejected
        self.reason = reason       # of a rejection (ConductorMetrics.rejected)

    @classmethod
    def refused(cls, reason: RejectReason, detail: str) -> "_RequestFailed":
        """A scheduler's refusal: RESOURCE_EXHAUSTED under load (an SLO, KV room; HTTP
        429), UNAVAILABLE when no instance of a role is live (HTTP 503)."""
        code = grpc.StatusCode.UNAVAILABLE if reason is RejectReason.NO_INSTANCE \
            else grpc.StatusCode.RESOURCE_EXHAUSTED
        return cls(code, detail, rejected=True, reason=reason.value)


class Conductor:
    """Owns the engine stubs, the store client and worker liveness.

    Args:
        scheduler: instance choice; its cache view becomes the shared store's
            (:class:`~kvstore.conductor.live_state.SharedStoreView`).
        kv: store client (prefix hit lookups).
        namespace: the model's KV namespace (same as the engines').
        use_cache: False runs every request without reading the prefix cache.
        deadlines: RPC time limits and probe settings.
        lookahead_window: queued requests per prefill instance that prefetch
            their cached blocks (queue lookahead); 0 turns it off.
        creds: the conductor's token (a client one) and TLS files, for the engines.
        metrics: TTFT, TBT, prefix hits and rejections, when given.
        decision_log: where each decision is written with its state (None: nowhere).
    """

    def __init__(self, scheduler: Scheduler, kv: KVClient, namespace: Namespace,
                 use_cache: bool = True, deadlines: Deadlines = Deadlines(),
                 lookahead_window: int = 64, creds: ClientCredentials | None = None,
                 metrics: ConductorMetrics | None = None, decision_log: DecisionLog | None = None):
        self.creds = creds
        self.metrics = metrics
        self.scheduler = scheduler
        self.kv = kv
        self.namespace = namespace
        self.use_cache = use_cache
        self.deadlines = deadlines
        self._channels: list[grpc.aio.Channel] = []
        self.lookahead_window = lookahead_window
        self._background: set = set()
        self.view = SharedStoreView()
        scheduler.cache_view = self.view
        # A cost model without timing (token counts) gets no clock: its queue is the
        # queued work, and engine times say nothing about its units.
        timed = scheduler.cost.name != "token-count"
        self._clock = _ms if timed else (lambda: 0.0)
        self.queues = PrefillQueues(learn_ratio=timed)
        self.decision_log = decision_log
        self._seq = 0
        self.arrivals = ArrivalOrder()
        self._prefill_stubs = {p.instance_id: spb_grpc.PrefillEngineStub(self._channel(p.address))
                               for p in scheduler.prefill}
        self._decode_stubs = {d.instance_id: spb_grpc.DecodeEngineStub(self._channel(d.address))
                              for d in scheduler.decode}
        self.monitor = HealthMonitor(scheduler.prefill, scheduler.decode, self._probe,
                                     interval_s=deadlines.probe_interval_s,
                                     timeout_s=deadlines.probe_s, miss_limit=deadlines.probe_misses)

    def _channel(self, address: str) -> grpc.aio.Channel:
        ch = rpc.aio_channel(address, self.creds)
        self._channels.append(ch)
        return ch

    def start(self) -> None:
        """Start health probing (call on the serving event loop)."""
        self.monitor.start()

    async def close(self) -> None:
        await self.monitor.stop()
        if self.decision_log is not None:
            self.decision_log.close()
        for ch in self._channels:
            await ch.close()

    async def _probe(self, w: Worker, timeout_s: float) -> tuple[ProbeResult, str]:
        stub = self._prefill_stubs.get(w.instance_id) or self._decode_stubs[w.instance_id]
        try:
            await stub.Status(spb.EngineStatusRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            detail = f"{exc.code().name}: {exc.details()}"
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return ProbeResult.TIMEOUT, detail
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                return ProbeResult.DOWN, detail
            return ProbeResult.UP, detail      # it answered, if with an error
        return ProbeResult.UP, ""

    def status(self) -> spb.ConductorStatus:
        return spb.ConductorStatus(workers=[
            spb.WorkerState(instance_id=s.instance_id, role=s.role.value, address=s.address,
                            alive=s.alive, routed=s.routed, failures=s.failures,
                            last_error=s.last_error, since_ms=s.since_ms)
            for s in self.monitor.snapshot()])

    async def _cached_prefix(self, prompt: list[int], tenant: str = "") -> tuple[list[str], int]:
        """The prompt's block keys (of ``tenant``'s KV: docs/tenants.md), and how many
        leading ones the store holds."""
        keys = prefix_keys(prompt, tenant_namespace(self.namespace, tenant))
        if not keys or not self.use_cache:
            return keys, 0
        try:
            hits = await asyncio.to_thread(self.kv.batch_exists, keys)
        except KVStoreError as exc:
            # Only a scheduling hint: the prefill engine looks the prefix up again.
            log.warning("prefix lookup failed, scheduling as uncached: %s", exc)
            return keys, 0
        n = 0
        while n < len(hits) and hits[n]:
            n += 1
        return keys, n

    async def _drop_transfer_keys(self, request: spb.GenerateRequest,
                                  pre: spb.PrefillResponse) -> None:
        """No decode runs: remove the KV the prefill handed over under transfer keys
        (the decode engine does it otherwise). A failure is logged: the request
        itself is done."""
        keys = [k for k in [*pre.block_keys, pre.tail_key] if k and is_transfer_key(k)]
        if not keys:
            return
        try:
            errors = await asyncio.to_thread(self.kv.batch_remove, keys)
        except KVStoreError as exc:
            errors = [exc]
        failed = [e for e in errors if e is not None and not isinstance(e, NotFound)]
        if failed:
            log.warning("request %s: %d transfer keys not removed: %s", request.request_id,
                        len(failed), failed[0])

    def _schedule(self, req: SchedRequest, cached_blocks: int):
        """Algorithm 1 for ``req``, every instance holding the store's ``cached_blocks``."""
        now = self._clock()
        state = DecisionLog.state(self.scheduler) if self.decision_log is not None else None
        with self.view.holding(req.block_keys, cached_blocks):
            decision = self.scheduler.schedule(req, now)
        if self.decision_log is not None:
            self.decision_log.record(self.scheduler, state, req, cached_blocks, now, decision)
        return decision

    def _lookahead(self, inst, hit_keys: list[str]) -> None:
        """Queue-lookahead prefetch (DESIGN.md): a request that will wait in a
        prefill queue tells the store which blocks it will read, so the nodes
        promote them to DRAM and keep them until read or until the deadline.
        Bounded: only the first ``lookahead_window`` queued requests of an
        instance prefetch. Fire and forget: it never delays the request."""
        if not hit_keys or not 1 < inst.queued_requests <= self.lookahead_window:
            return
        deadline_ms = int(self.deadlines.prefill_s * 1000)

        def send() -> None:
            try:
                self.kv.prefetch(hit_keys, deadline_ms)
            except KVStoreError as exc:
                log.info("lookahead prefetch failed: %s", exc)
        task = asyncio.get_running_loop().run_in_executor(None, send)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def generate(self, request: spb.GenerateRequest) -> AsyncIterator[spb.GenerateChunk]:
        """Run one request; yields token chunks, then one chunk with ``done=True``.

        Never raises for a request's failure: the last chunk carries
        ``error`` / ``error_code`` (and ``rejected`` when it was refused).
        """
        t0 = _ms()
        prompt = list(request.prompt_tokens)
        metrics = spb.RequestMetrics(prompt_tokens=len(prompt))
        m = self.metrics
        if (not prompt or request.max_tokens < 1 or len(request.stop_token_ids) > MAX_STOP_TOKENS
                or not valid_tenant(request.tenant)):
            if m is not None:
                m.rejected.labels("invalid").inc()
                m.outcomes.labels("rejected").inc()
            yield spb.GenerateChunk(done=True, rejected=True, metrics=metrics,
                                    error=f"prompt must be non-empty, max_tokens >= 1, "
                                          f"stop_token_ids at most {MAX_STOP_TOKENS} and the "
                                          f"tenant \"\" or a tenant name",
                                    error_code=grpc.StatusCode.INVALID_ARGUMENT.name)
            return
        produced = 0
        self._seq += 1
        ticket = self.arrivals.ticket()
        try:
            keys, n_hit = await self._cached_prefix(prompt, request.tenant)
            await self.arrivals.turn(ticket)     # scheduled in arrival order
        finally:
            self.arrivals.done(ticket)           # the next one resumes after our first await
        req = SchedRequest(request_id=f"{self._seq}:{request.request_id}", prompt_tokens=len(prompt),
                           block_keys=tuple(keys))
        try:
            pre, planned = await self._prefill(request, req, n_hit, metrics, keys[:n_hit])
            t_first = _ms()
            metrics.ttft_ms = t_first - t0
            metrics.cached_tokens = pre.cached_tokens
            metrics.saved_blocks = pre.saved_blocks
            metrics.hit_blocks = pre.hit_blocks
            metrics.total_blocks = pre.total_blocks
            metrics.queue_ms = pre.queue_ms
            metrics.prefill_ms = pre.compute_ms
            if m is not None:
                m.ttft.observe(metrics.ttft_ms / 1000)
                m.hit_tokens.inc(pre.cached_tokens)
                m.prompt_tokens.inc(len(prompt))
            yield spb.GenerateChunk(tokens=[pre.first_token])
            produced = 1
            t_last = t_first
            if request.max_tokens == 1:
                await self._drop_transfer_keys(request, pre)
            else:
                def reprefill() -> Awaitable[tuple[spb.PrefillResponse, DecodeInstance | None]]:
                    return self._prefill(request, req, n_hit, metrics)
                async with aclosing(self._decode(request, req, pre, planned, reprefill,
                                                 metrics)) as stream:
                    async for tokens in stream:
                        produced += len(tokens)
                        now = _ms()
                        if m is not None:
                            m.tbt.observe((now - t_last) / 1000)
                        t_last = now
                        yield spb.GenerateChunk(tokens=tokens)
            metrics.output_tokens = produced
            metrics.tbt_ms = (t_last - t_first) / (produced - 1) if produced > 1 else 0.0
            if m is not None:
                m.outcomes.labels("completed").inc()
            yield spb.GenerateChunk(done=True, metrics=metrics)
        except _RequestFailed as exc:
            metrics.output_tokens = produced
            if m is not None:
                m.outcomes.labels("rejected" if exc.rejected else "failed").inc()
                if exc.rejected:
                    m.rejected.labels(exc.reason).inc()
            log.warning("request %s %s: %s", request.request_id,
                        "rejected" if exc.rejected else "failed", exc)
            yield spb.GenerateChunk(done=True, rejected=exc.rejected, metrics=metrics,
                                    error=str(exc), error_code=exc.code.name)
        finally:
            # Out of the forecast's requests in prefill, whatever happened (once
            # in decode it already is): no decode needed, refused, failed, abandoned.
            self.scheduler.dropped(req)

    async def _prefill(self, request: spb.GenerateRequest, req: SchedRequest, cached_blocks: int,
                       metrics: spb.RequestMetrics, hit_keys: list[str] | None = None
                       ) -> tuple[spb.PrefillResponse, DecodeInstance | None]:
        """Prefill where Algorithm 1 puts it, retrying elsewhere when an instance is
        unavailable; returns the answer and the decode instance bound at arrival."""
        attempts = max(2, len(self.scheduler.prefill))
        last = ""
        for attempt in range(1, attempts + 1):
            decision = self._schedule(req, cached_blocks)
            if not decision.accepted:      # refused before any work: an SLO, or no live instance
                rej = decision.rejection
                detail = rej.detail + (f" (after: {last})" if last and
                                       rej.reason is RejectReason.NO_INSTANCE else "")
                raise _RequestFailed.refused(rej.reason, detail)
            choice = decision.prefill
            inst = choice.instance
            metrics.prefill_attempts += 1      # counts a second prefill for a decode retry too
            metrics.prefill_instance = inst.instance_id
            self.monitor.routed(inst.instance_id)
            inst.queued_requests += 1
            inst.queued_tokens += choice.tokens_to_compute
            ticket = self.queues.dispatched(inst, choice.transfer_ms + choice.prefill_ms, self._clock())
            if hit_keys:
                self._lookahead(inst, hit_keys)
            try:
                service_ms = None
                pre = await self._prefill_stubs[inst.instance_id].Prefill(
                    spb.PrefillRequest(request_id=request.request_id, prompt_tokens=request.prompt_tokens,
                                       use_cache=self.use_cache, tenant=request.tenant),
                    timeout=self.deadlines.prefill_s)
                service_ms = pre.compute_ms
                return pre, decision.decode.instance if decision.decode else None
            except grpc.aio.AioRpcError as exc:
                last = f"prefill on {inst.instance_id}: {exc.code().name}: {exc.details()}"
                if exc.code() in RETRYABLE_STATUS:
                    alive = await self.monitor.suspect(inst.instance_id, last)
                    log.warning("request %s: %s (worker %s); retrying", request.request_id, last,
                                "alive" if alive else "dead")
                    continue
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    # Not retried: the work may still run there. A hung worker
                    # leaves the candidate set after its probes time out.
                    await self.monitor.suspect(inst.instance_id, last)
                    last = f"prefill on {inst.instance_id} took over {self.deadlines.prefill_s:.0f} s"
                raise _RequestFailed(exc.code(), last) from None
            finally:
                self.queues.answered(inst, ticket, self._clock(), service_ms)
                inst.queued_requests -= 1
                inst.queued_tokens -= choice.tokens_to_compute
        raise _RequestFailed(grpc.StatusCode.UNAVAILABLE,
                             f"prefill failed on {attempts} attempts; last: {last}")

    async def _decode(self, request: spb.GenerateRequest, req: SchedRequest,
                      pre: spb.PrefillResponse, planned: DecodeInstance | None,
                      reprefill: Callable[[], Awaitable[tuple[spb.PrefillResponse,
                                                              DecodeInstance | None]]],
                      metrics: spb.RequestMetrics) -> AsyncIterator[list[int]]:
        """Stream the decode tokens; retry on another instance until the first token.

        The instance is ``planned`` (bound at arrival) when the late check
        (:meth:`Scheduler.admit_decode`) lets it take the request under its
        live load; a planned instance that died meanwhile is replaced by the
        least-loaded live one that can take it.

        A retry prefills again first: the failed decoder may have loaded, and
        so removed, the request's transfer keys. The new prefill comes mostly
        from the prefix cache and gives the same first token (greedy,
        bit-identical).
        """
        attempts = max(2, len(self.scheduler.decode))
        last = ""
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                again, planned = await reprefill()
                if again.first_token != pre.first_token:
                    raise _RequestFailed(grpc.StatusCode.INTERNAL,
                                         f"prefill again gave first token {again.first_token}, "
                                         f"not {pre.first_token}: the engines are not deterministic")
                pre = again
            picked = self.scheduler.admit_decode(
                req, self._clock(), planned if planned is not None and planned.alive else None)
            if not isinstance(picked, DecodeChoice):   # the TBT SLO, KV room, or none live
                detail = picked.detail + (f" (after: {last})" if last else "")
                raise _RequestFailed.refused(picked.reason, detail)
            dec = picked.instance
            metrics.decode_attempts = attempt
            metrics.decode_instance = dec.instance_id
            self.monitor.routed(dec.instance_id)
            dec.active_requests += 1
            dec.context_tokens += req.prompt_tokens
            self.scheduler.decode_started(req, dec.instance_id, self._clock())
            call = self._decode_stubs[dec.instance_id].Decode(spb.DecodeRequest(
                request_id=request.request_id, prompt_tokens=request.prompt_tokens,
                first_token=pre.first_token, max_tokens=request.max_tokens,
                block_keys=pre.block_keys, tail_key=pre.tail_key,
                stop_token_ids=request.stop_token_ids))
            got = 0
            try:
                while True:
                    try:
                        chunk = await asyncio.wait_for(call.read(), self.deadlines.decode_idle_s)
                    except asyncio.TimeoutError:
                        last = (f"decode on {dec.instance_id} sent no token for "
                                f"{self.deadlines.decode_idle_s:.0f} s")
                        await self.monitor.suspect(dec.instance_id, last)
                        raise _RequestFailed(grpc.StatusCode.DEADLINE_EXCEEDED, last) from None
                    if chunk is grpc.aio.EOF:
                        return
                    if chunk.tokens:
                        got += len(chunk.tokens)
                        yield list(chunk.tokens)
            except grpc.aio.AioRpcError as exc:
                last = f"decode on {dec.instance_id}: {exc.code().name}: {exc.details()}"
                if exc.code() in RETRYABLE_STATUS:
                    alive = await self.monitor.suspect(dec.instance_id, last)
                    if got == 0:
                        log.warning("request %s: %s (worker %s); retrying", request.request_id,
                                    last, "alive" if alive else "dead")
                        continue
                raise _RequestFailed(exc.code(), last) from None
            finally:
                call.cancel()        # no-op once finished; stops the stream if we left early
                dec.active_requests -= 1
                dec.context_tokens -= req.prompt_tokens
                # Its time and length feed the forecast (the first token came from prefill).
                self.scheduler.decode_finished(req, dec.instance_id, self._clock(), got + 1)
        raise _RequestFailed(grpc.StatusCode.UNAVAILABLE,
                             f"decode failed on {attempts} attempts; last: {last}")


class ConductorServicer(spb_grpc.ConductorServicer):
    """gRPC face of :class:`Conductor`."""

    def __init__(self, conductor: Conductor):
        self.conductor = conductor

    async def Generate(self, request, context):
        async for chunk in self.conductor.generate(request):
            yield chunk

    async def Status(self, request, context):
        return self.conductor.status()


def _parse_instances(specs: tuple[str, ...], cls):
    out = []
    for i, spec in enumerate(specs):
        name, _, addr = spec.rpartition("=")
        out.append(cls(instance_id=name or f"{cls.__name__[:1].lower()}{i}", address=addr))
    return out


#: Which roles may call the conductor (admin may do all).
CONDUCTOR_METHOD_ROLES: dict[str, frozenset[Role]] = {
    "Generate": frozenset({Role.CLIENT}), "Status": frozenset({Role.CLIENT}),
}


async def _watch_engines(scheduler: Scheduler, health: Health, period_s: float = 0.25) -> None:
    """SERVING while a prefill and a decode instance are alive; otherwise up but
    not serving (``/health`` 503, ``/ready`` 200), as the HTTP front's /health says."""
    while True:
        _set_engine_state(scheduler, health)
        await asyncio.sleep(period_s)


def _set_engine_state(scheduler: Scheduler, health: Health) -> None:
    live = (any(p.alive for p in scheduler.prefill) and any(d.alive for d in scheduler.decode))
    health.set(State.SERVING if live else State.STANDBY)


async def serve(cfg: ConductorConfig) -> None:
    """Serve until SIGTERM / SIGINT (announces READY, with ``http_address`` when the front runs)."""
    authenticated = cfg.security.tokens is not None
    check_binding("conductor", cfg.host, authenticated, cfg.insecure)
    if cfg.http_port is not None:
        check_binding("conductor HTTP front", cfg.http_host, authenticated, cfg.insecure)
    check_metrics_binding("conductor", cfg.metrics, cfg.host, authenticated, cfg.insecure)
    mcfg = model_config(cfg.model)
    # Loaded before anything listens: a folder without tokenizer.json fails at startup.
    tokenizer = load_tokenizer(cfg.model, cfg.tokenizer, mcfg.vocab_size) \
        if cfg.http_port is not None else None
    namespace = namespace_for_model(cfg.model, cfg.block_tokens)
    slo = Slo(ttft_ms=cfg.ttft_slo_ms, tbt_ms=cfg.tbt_slo_ms)
    rejection = cfg.rejection
    if rejection == "auto":
        rejection = "early" if math.isfinite(slo.ttft_ms) or math.isfinite(slo.tbt_ms) else "none"
    scheduler = Scheduler(_parse_instances(cfg.prefill, PrefillInstance),
                          _parse_instances(cfg.decode, DecodeInstance),
                          cost_model=conductor_cost_model(cfg.cost_model, cfg.model),
                          slo=slo, rejection=rejection, block_tokens=cfg.block_tokens)
    kv = KVClient(cfg.master, token=cfg.creds.token, tls=cfg.creds.tls)
    metrics = ProcessMetrics("conductor")
    observed = cfg.metrics.port is not None
    conductor = Conductor(scheduler, kv, namespace, use_cache=cfg.use_cache,
                          deadlines=cfg.deadlines, creds=cfg.creds,
                          metrics=ConductorMetrics(metrics, scheduler),
                          decision_log=DecisionLog(cfg.decision_log) if cfg.decision_log else None)
    server = rpc.aio_server(cfg.security, CONDUCTOR_METHOD_ROLES, metrics if observed else None)
    health = Health(("kvstore.serving.v1.Conductor",))
    http = None
    try:
        port = rpc.listen(server, cfg.host, cfg.port, cfg.security)
        spb_grpc.add_ConductorServicer_to_server(ConductorServicer(conductor), server)
        health.attach_grpc(server)
        await server.start()
        if authenticated:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, cfg.security.tokens.reload)
        host = advertised_host(cfg.host, cfg.advertise_host, toward=cfg.master.split("|")[0])
        info = {"role": "conductor", "address": f"{host}:{port}", "port": port}
        if cfg.http_port is not None:
            from kvstore.conductor.http import HttpFront, LocalBackend

            http = HttpFront(LocalBackend(conductor), model_name=cfg.served_model_name or cfg.model,
                             tokenizer=tokenizer, security=cfg.security,
                             draining=lambda: health.state is State.DRAINING,
                             metrics=metrics if observed else None,
                             max_model_len=mcfg.max_position_embeddings)
            http_port = await http.start(cfg.http_host, cfg.http_port)
            http_host = advertised_host(cfg.http_host, cfg.advertise_host,
                                        toward=cfg.master.split("|")[0])
            info.update(http_address=f"{http_host}:{http_port}", http_port=http_port)
        mserver, maddress = start_metrics(cfg.metrics, cfg.host, metrics, health, cfg.security,
                                          host)
    except BaseException:
        # A failed start (a busy HTTP or metrics port): stop what already runs while
        # this loop is alive, or grpc stops the server from its finalizer after the
        # loop closed ("Event loop is closed" on stderr). The caller prints the error.
        if http is not None:
            await http.stop()
        await server.stop(None)
        await conductor.close()
        kv.close()
        raise
    if maddress:
        info["metrics_address"] = maddress
    conductor.start()      # probes the engines once everything listens: no log of a failed start
    _set_engine_state(scheduler, health)     # no longer "starting" once READY is out
    watch = asyncio.create_task(_watch_engines(scheduler, health))
    announce_ready(info)
    await wait_for_stop_signal()
    health.set(State.DRAINING)
    watch.cancel()
    if cfg.drain_s > 0:
        await asyncio.sleep(cfg.drain_s)
    if http is not None:
        await http.stop()
    await drain(health, server, 0.0)
    if mserver is not None:
        mserver.stop()
    await conductor.close()
    kv.close()
