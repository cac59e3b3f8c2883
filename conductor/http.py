"""OpenAI-compatible HTTP front of the conductor (aiohttp).

Routes::

    POST /v1/completions        prompt as text or token ids (one or a batch), max_tokens,
                                stream (SSE, ``data: {...}`` events, then ``data: [DONE]``)
    POST /v1/chat/completions   messages through the model folder's chat template
                                (:mod:`kvstore.conductor.chat`), max_tokens /
                                max_completion_tokens, stream (``chat.completion.chunk``)
    GET  /v1/models             the one served model
    GET  /health                worker liveness; 200 while a prefill and a decode
                                instance are alive, else 503

The front is thin: it parses a request into :class:`CompletionRequest`
(:mod:`kvstore.conductor.openai_schema`), runs every prompt through a
:class:`Backend` (the in-process :class:`Conductor`, or a remote one over
gRPC) and writes OpenAI-shaped JSON. Text goes through the front's
tokenizer (:mod:`kvstore.conductor.tokenizer`): the byte tokenizer of the
demo model or a model folder's ``tokenizer.json``, whose stop tokens (EOS)
end generation. Decoding is greedy, so ``temperature``, ``top_p``, ``seed``
and the penalties are accepted and ignored (a wrong type or a value outside
OpenAI's range is still 400 naming the field); ``n``, ``best_of``, ``echo``,
``logprobs``, ``stop`` and ``suffix`` are refused with 400 unless they ask
for the default, and any other field (images, tools, ...) is refused with
400 naming it, never ignored.

Extensions to the OpenAI schema: every choice (and every streamed chunk)
carries ``token_ids``, the generated token ids; a finished choice carries
``metrics`` (the conductor's :class:`RequestMetrics`: TTFT, TBT, cache hits,
instances).

Status mapping (one table, :data:`HTTP_STATUS`; every error body is
OpenAI's ``{"error": {"message", "type", "param", "code"}}``, from
:class:`HttpError`)::

    400  invalid input: a field of the wrong type or out of range (named in
         ``param``), an unsupported field, a prompt longer than the model's
         context (``code`` ``context_length_exceeded``, the limit in tokens)
    401 / 403  no or an unknown token / a token of another role
    404  another model (``model_not_found``), or a path the front does not serve
    405  a method the path does not take
    413  a body over :data:`MAX_BODY_BYTES`
    429  refused under load: the TTFT or TBT SLO (early rejection), no KV room
         (with ``Retry-After``)
    503  no live prefill or decode engine, a worker failure before the first
         token, or the front draining
    504  a worker deadline

Rejections and failures are known before the first token, so a streamed
request gets them as an HTTP status too; a failure after tokens went out
ends the stream with an ``{"error": ...}`` event.

Thread safety: everything runs on the serving event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from kvstore._proto import serving_pb2 as spb
from kvstore import rpc
from kvstore.auth import Role, allows, bearer
from kvstore.binding import check_binding
from kvstore.rpc import ClientCredentials, ServerSecurity
from kvstore.tenants import DEFAULT_TENANT
from kvstore.tls import server_context
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.conductor.chat import ChatShape, parse_chat
from kvstore.conductor.openai_schema import (  # noqa: F401  (re-exported: the front's schema)
    DEFAULT_MAX_TOKENS, HTTP_STATUS, KNOWN_FIELDS, MAX_BATCH_PROMPTS, MAX_BODY_BYTES,
    MAX_TOKENS_LIMIT, CompletionRequest, HttpError, TextShape, failed, failure_of, parse_completion)
from kvstore.conductor.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer  # noqa: F401
from kvstore.process import announce_ready, wait_for_stop_signal

log = logging.getLogger(__name__)


class _ClientFaults(logging.Filter):
    """aiohttp logs every request it cannot parse (a bad Content-Length, chunk or
    header line) at ERROR with a traceback, though it answers 400 and the fault is
    the client's: before authentication, so any client could fill the log. Those
    become one INFO line each; errors of the front's own handlers stay ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError) and 400 <= (exc.code or 500) < 500:
            log.info("malformed HTTP request: answered %d (%s)", exc.code,
                     str(exc.message).strip()[:120])
            return False
        return True


#: The front's aiohttp request handlers log here (see _ClientFaults).
_server_log = logging.getLogger(__name__ + ".server")
_server_log.addFilter(_ClientFaults())

# --------------------------------------------------------------------------- routes

_ROUTES = frozenset({"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
                     "GET /health"})


# --------------------------------------------------------------------------- backends

class Backend(Protocol):
    """What the front needs from a conductor."""

    def generate(self, request: spb.GenerateRequest) -> AsyncIterator[spb.GenerateChunk]:
        """Token chunks, then one ``done`` chunk; never raises for a failed request."""

    async def status(self) -> spb.ConductorStatus:
        """The workers' liveness."""


class LocalBackend:
    """The conductor in this process."""

    def __init__(self, conductor):
        self.conductor = conductor

    def generate(self, request: spb.GenerateRequest) -> AsyncIterator[spb.GenerateChunk]:
        return self.conductor.generate(request)

    async def status(self) -> spb.ConductorStatus:
        return self.conductor.status()


class GrpcBackend:
    """A conductor in another process, over its gRPC service (with ``creds``)."""

    def __init__(self, address: str, creds: ClientCredentials | None = None):
        self._channel = rpc.aio_channel(address, creds)
        self._stub = spb_grpc.ConductorStub(self._channel)

    async def generate(self, request: spb.GenerateRequest) -> AsyncIterator[spb.GenerateChunk]:
        call = self._stub.Generate(request)
        try:
            async for chunk in call:
                yield chunk
        except grpc.aio.AioRpcError as exc:
            yield spb.GenerateChunk(done=True, error=f"conductor: {exc.details()}",
                                    error_code=exc.code().name)
        finally:
            call.cancel()

    async def status(self) -> spb.ConductorStatus:
        return await self._stub.Status(spb.ConductorStatusRequest(), timeout=5.0)

    async def close(self) -> None:
        await self._channel.close()


# --------------------------------------------------------------------------- the front

class HttpFront:
    """The aiohttp application and its listener.

    Args:
        backend: where requests run.
        model_name: the model id clients name in ``model``.
        tokenizer: text <-> token ids, the stop tokens and the chat template
            (:func:`kvstore.conductor.tokenizer.load_tokenizer`).
        max_model_len: the model's context in tokens (bounds a chat request's
            default ``max_tokens``); None: unknown.
        security: with tokens, every request but ``/health`` needs
            ``Authorization: Bearer TOKEN`` of a client (or admin): 401 without
            or with an unknown one, 403 for another role; with TLS files the
            front speaks HTTPS. ``/health`` answers anyone, its workers only
            to an authenticated caller.
    """

    def __init__(self, backend: Backend, model_name: str, tokenizer: Tokenizer,
                 security: ServerSecurity | None = None, draining=lambda: False,
                 metrics=None, max_model_len: int | None = None):
        self.backend = backend
        self.draining = draining       # () -> bool: the process got SIGTERM
        self.metrics = metrics         # a kvstore.metrics.ProcessMetrics: requests counted
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.security = security or ServerSecurity()
        self.app = web.Application(middlewares=[self._count, self._json_errors,
                                                self._authenticate],
                                   client_max_size=MAX_BODY_BYTES)
        self.app.add_routes([web.post("/v1/completions", self.completions),
                             web.post("/v1/chat/completions", self.chat_completions),
                             web.get("/v1/models", self.models),
                             web.get("/health", self.health)])
        self._runner: web.AppRunner | None = None

    def _role(self, request: web.Request) -> Role | None:
        return self.security.role_of([("authorization", request.headers.get("Authorization", ""))])

    def _tenant(self, request: web.Request) -> str:
        """The tenant whose KV the caller's requests use: the one its token is bound to
        (``tenants=NAME`` in the ``--auth`` file); "" (the default tenant) without auth,
        for a token bound to several tenants, or to every one (admin)."""
        tokens = self.security.tokens
        if tokens is None:
            return ""
        creds = tokens.credentials_of(bearer([("authorization",
                                                request.headers.get("Authorization", ""))]))
        names = creds[1].tenants if creds is not None else None
        if names is None or len(names) != 1:
            return ""
        (name,) = names
        return "" if name == DEFAULT_TENANT else name

    @web.middleware
    async def _count(self, request: web.Request, handler):
        """kvstore_requests_total{op="POST /v1/completions", code="200"} and its duration
        (op: the route, or "other" for paths the front does not serve)."""
        if self.metrics is None:
            return await handler(request)
        t0 = time.perf_counter()
        route = f"{request.method} {request.path}"
        op = route if route in _ROUTES else "other"
        code = "500"
        try:
            response = await handler(request)
            code = str(response.status)
            return response
        except web.HTTPException as exc:
            code = str(exc.status)
            raise
        finally:
            self.metrics.observe(op, code, time.perf_counter() - t0)

    @web.middleware
    async def _json_errors(self, request: web.Request, handler):
        """aiohttp's own errors (404 unknown path, 405 wrong method, 413 body too
        large while a handler reads it) in the front's JSON shape, not plain text."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if isinstance(exc, web.HTTPRequestEntityTooLarge):
                message = f"the request body is over {MAX_BODY_BYTES} bytes"
            else:
                message = f"{exc.reason} ({request.method} {request.path[:100]})"
            response = HttpError(exc.status, message).response()
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
            return response

    @web.middleware
    async def _authenticate(self, request: web.Request, handler):
        if request.path == "/health" or self.security.tokens is None:
            return await handler(request)
        role = self._role(request)
        if role is None:
            return HttpError(401, "missing or unknown credentials "
                                  "(Authorization: Bearer TOKEN)").response()
        if not allows(role, frozenset({Role.CLIENT})):
            return HttpError(403, f"role {role.value!r} may not use the completions API").response()
        return await handler(request)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port.

        Raises:
            OSError: the address cannot be bound (taken, or not this host's); one
                line naming it, and nothing is left listening.
        """
        self._runner = web.AppRunner(self.app, access_log=None, logger=_server_log)
        await self._runner.setup()
        tls = self.security.tls
        site = web.TCPSite(self._runner, host, port,
                           ssl_context=server_context(tls) if tls is not None else None)
        try:
            await site.start()
        except OSError as exc:
            await self.stop()
            reason = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise OSError(f"HTTP front: cannot listen on {host}:{port}: {reason}") from None
        bound = self._runner.addresses[0][1]
        log.info("HTTP front on http://%s:%d/v1 (model %s)", host, bound, self.model_name)
        return bound

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "kvstore"}]})

    async def health(self, request: web.Request) -> web.Response:
        if self.draining():
            return web.json_response({"status": "draining"}, status=503)
        try:
            st = await self.backend.status()
        except grpc.aio.AioRpcError as exc:
            return web.json_response({"status": "unavailable", "error": exc.details()}, status=503)
        workers = [{"instance_id": w.instance_id, "role": w.role, "address": w.address,
                    "alive": w.alive, "routed": w.routed, "failures": w.failures,
                    "last_error": w.last_error, "since_ms": round(w.since_ms, 1)}
                   for w in st.workers]
        live = {r: any(w.alive for w in st.workers if w.role == r) for r in ("prefill", "decode")}
        ok = all(live.values())
        status = "unavailable" if not ok else "ok" if all(w.alive for w in st.workers) else "degraded"
        body = {"status": status, "model": self.model_name}
        if self.security.tokens is None or self._role(request) is not None:
            body["workers"] = workers            # addresses: for authenticated callers only
        return web.json_response(body, status=200 if ok else 503)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/completions``: 200 (JSON, or SSE when streamed), else an error of
        the module's table: 400 bad input or a prompt too long for the context, 401 /
        403, 404, 413, 429 refused under load, 503 no live engine, 504."""
        return await self._serve(request, lambda body: parse_completion(
            body, self.model_name, self.tokenizer, self.max_model_len))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``: the statuses of :meth:`completions` (400 also
        for a model without a chat template)."""
        return await self._serve(request, lambda body: parse_chat(
            body, self.model_name, self.tokenizer, self.max_model_len))

    async def _serve(self, request: web.Request, parse) -> web.StreamResponse:
        if self.draining():
            return HttpError(503, "this front is draining (shutting down); retry on "
                                  "another").response()
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            # Not JSON, not UTF-8, an integer of over 4300 digits, or nested
            # deeper than the parser's recursion allows: all the body's fault.
            return HttpError(400, "the body is not valid JSON").response()
        except ConnectionError:
            log.info("a client went away before its request body was complete")
            return HttpError(400, "the request body ended early").response()
        try:
            req = parse(body)
        except HttpError as exc:
            return exc.response()
        run = _Completion(self, req, self._tenant(request))
        try:
            failure = await run.admit()
            if failure is not None:
                return failure.response()
            if req.stream:
                return await run.stream(request)
            return await run.collect()
        finally:
            await run.close()


class _Completion:
    """One completions or chat request: its prompts' streams, merged by choice index;
    generation stops after the tokenizer's stop tokens."""

    def __init__(self, front: HttpFront, req: CompletionRequest, tenant: str = ""):
        self.front = front
        self.req = req
        self.shape = ChatShape() if req.chat else TextShape()
        self.id = f"{self.shape.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.stops = frozenset(front.tokenizer.stop_token_ids)
        self.gens = [front.backend.generate(spb.GenerateRequest(
            request_id=f"{self.id}-{i}", prompt_tokens=p, max_tokens=req.max_tokens,
            arrival_ms=time.time() * 1000.0, stop_token_ids=sorted(self.stops), tenant=tenant))
            for i, p in enumerate(req.prompts)]
        self.firsts: list[spb.GenerateChunk] = []
        self._tasks: list[asyncio.Task] = []

    async def admit(self) -> HttpError | None:
        """Wait for every prompt's first chunk; the error if any was refused or failed.

        Rejection and failures before the first token end the request here,
        so they reach the client as an HTTP status, streamed or not.
        """
        self.firsts = list(await asyncio.gather(*(g.__anext__() for g in self.gens)))
        bad = [c for c in self.firsts if failed(c)]
        if not bad:
            return None
        return failure_of(next((c for c in bad if c.rejected), bad[0]))

    async def _events(self) -> AsyncIterator[tuple[int, spb.GenerateChunk]]:
        """(choice index, chunk) as chunks arrive from every prompt."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            await queue.put((i, self.firsts[i]))
            if not self.firsts[i].done:
                async for chunk in self.gens[i]:
                    await queue.put((i, chunk))
        self._tasks = [asyncio.create_task(pump(i)) for i in range(len(self.gens))]
        remaining = len(self.gens)
        while remaining:
            i, chunk = await queue.get()
            remaining -= chunk.done
            yield i, chunk

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for g in self.gens:
            await g.aclose()

    def _finish(self, done: spb.GenerateChunk | None, last: int | None) -> str | None:
        """finish_reason: "stop" after a stop token (or fewer tokens than asked), else "length"."""
        if done is None:
            return None
        if last in self.stops or done.metrics.output_tokens < self.req.max_tokens:
            return "stop"
        return "length"

    def _usage(self, completion_tokens: int) -> dict:
        prompt_tokens = sum(len(p) for p in self.req.prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _envelope(self, choices: list[dict], chunk: bool = False) -> dict:
        return {"id": self.id, "object": self.shape.chunk_object if chunk else self.shape.object,
                "created": self.created, "model": self.req.model, "choices": choices}

    async def collect(self) -> web.Response:
        tokens: list[list[int]] = [[] for _ in self.gens]
        done: list[spb.GenerateChunk | None] = [None] * len(self.gens)
        async with aclosing(self._events()) as events:
            async for i, chunk in events:
                if failed(chunk):
                    return failure_of(chunk).response()
                tokens[i].extend(chunk.tokens)
                if chunk.done:
                    done[i] = chunk
        tok = self.front.tokenizer
        out = self._envelope([self.shape.choice(i, tok.decode(t), t,
                                                self._finish(done[i], t[-1] if t else None), done[i])
                              for i, t in enumerate(tokens)])
        out["usage"] = self._usage(sum(len(t) for t in tokens))
        return web.json_response(out)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        decoders = [self.front.tokenizer.stream_decoder() for _ in self.gens]
        last: list[int | None] = [None] * len(self.gens)
        produced = 0
        try:
            for i in range(len(self.gens)):
                first = self.shape.first_chunk(i)
                if first is not None:
                    await _sse(resp, self._envelope([first], chunk=True))
            async with aclosing(self._events()) as events:
                async for i, chunk in events:
                    if failed(chunk):
                        await _sse(resp, failure_of(chunk).body())
                        return resp
                    produced += len(chunk.tokens)
                    if chunk.tokens:
                        last[i] = chunk.tokens[-1]
                    text = decoders[i].feed(list(chunk.tokens))
                    if chunk.done:
                        text += decoders[i].flush()
                    if chunk.tokens or chunk.done:
                        done = chunk if chunk.done else None
                        await _sse(resp, self._envelope([self.shape.chunk_choice(
                            i, text, list(chunk.tokens), self._finish(done, last[i]), done)],
                            chunk=True))
            if self.req.include_usage:
                tail = self._envelope([], chunk=True)
                tail["usage"] = self._usage(produced)
                await _sse(resp, tail)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionError:
            log.info("client of %s went away; request cancelled", self.id)
        return resp


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


# --------------------------------------------------------------------------- standalone

@dataclass(frozen=True, slots=True)
class FrontConfig:
    """The HTTP front as its own process, in front of a conductor's gRPC address."""

    conductor: str                 # conductor gRPC address host:port
    model: str = "tiny"            # "tiny" or a Hugging Face style folder
    tokenizer: str = ""            # "" : the model's own; "byte"; or a folder with tokenizer.json
    served_model_name: str = ""    # model id clients use ("" : ``model``)
    host: str = "127.0.0.1"
    port: int = 0                  # 0: a free port
    security: ServerSecurity = ServerSecurity()      # its own --auth / --tls-*
    creds: ClientCredentials = ClientCredentials()   # its token to the conductor
    insecure: bool = False         # allow a non-loopback bind without --auth (warned)


async def serve_front(cfg: FrontConfig) -> None:
    """Serve until SIGTERM / SIGINT (announces READY once listening)."""
    from kvstore.client.models import model_config

    check_binding("http", cfg.host, cfg.security.tokens is not None, cfg.insecure)
    mcfg = model_config(cfg.model)
    tokenizer = load_tokenizer(cfg.model, cfg.tokenizer, mcfg.vocab_size)
    backend = GrpcBackend(cfg.conductor, cfg.creds)
    front = HttpFront(backend, cfg.served_model_name or cfg.model, tokenizer, cfg.security,
                      max_model_len=mcfg.max_position_embeddings)
    try:
        port = await front.start(cfg.host, cfg.port)
    except BaseException:
        await backend.close()          # on this loop: nothing left for a finalizer
        raise
    if cfg.security.tokens is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, cfg.security.tokens.reload)
    announce_ready({"role": "http", "address": f"{cfg.host}:{port}", "port": port,
                    "http_address": f"{cfg.host}:{port}", "conductor": cfg.conductor})
    await wait_for_stop_signal()
    await front.stop()
    await backend.close()
