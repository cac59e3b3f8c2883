"""OpenAI-compatible HTTP front of the conductor (aiohttp).

Routes::

    POST /v1/completions   prompt as text or token ids (one or a batch), max_tokens,
                           stream (SSE, ``data: {...}`` events, then ``data: [DONE]``)
    GET  /v1/models        the one served model
    GET  /health           worker liveness; 200 while a prefill and a decode
                           instance are alive, else 503

The front is thin: it parses a request into :class:`CompletionRequest`, runs
every prompt through a :class:`Backend` (the in-process :class:`Conductor`,
or a remote one over gRPC) and writes OpenAI-shaped JSON. Decoding is
greedy, so ``temperature``, ``top_p``, ``seed`` and the penalties are
accepted and ignored; ``n``, ``best_of``, ``echo``, ``logprobs``, ``stop``
and ``suffix`` are refused with 400 unless they ask for the default, and any
other field (images, tools, ...) is refused with 400 naming it, never ignored.

Extensions to the OpenAI schema: every choice (and every streamed chunk)
carries ``token_ids``, the generated token ids; a finished choice carries
``metrics`` (the conductor's :class:`RequestMetrics`: TTFT, TBT, cache hits,
instances).

Status mapping (one table, :data:`HTTP_STATUS`): a request the conductor
rejected (overload, SLO, no live worker) is 429 with the reason; invalid
input is 400; a worker failure before the first token is 503 (504 on a
deadline). Rejections and failures are known before the first token, so a
streamed request gets them as an HTTP status too; a failure after tokens
went out ends the stream with an ``{"error": ...}`` event.

Thread safety: everything runs on the serving event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import grpc
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from google.protobuf.json_format import MessageToDict

from kvstore._proto import serving_pb2 as spb
from kvstore import rpc
from kvstore.auth import Role, allows
from kvstore.binding import check_binding
from kvstore.rpc import ClientCredentials, ServerSecurity
from kvstore.tls import server_context
from kvstore._proto import serving_pb2_grpc as spb_grpc
from kvstore.conductor.tokenizer import ByteTokenizer
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

DEFAULT_MAX_TOKENS = 16     # OpenAI's default for /v1/completions
MAX_TOKENS_LIMIT = 2**32 - 1    # what GenerateRequest.max_tokens (uint32) can carry
MAX_BATCH_PROMPTS = 64

#: gRPC status name of a failed request -> HTTP status. A request with
#: ``rejected`` set is always 429; a name not listed is 500.
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 429: "rejected",
               503: "service_unavailable", 504: "timeout"}


# --------------------------------------------------------------------------- requests

_ROUTES = frozenset({"POST /v1/completions", "GET /v1/models", "GET /health"})


class HttpError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": _ERROR_TYPE.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return web.json_response(self.body(), status=self.status, headers=headers)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A parsed ``/v1/completions`` body."""

    model: str
    prompts: tuple[tuple[int, ...], ...]   # token ids of each prompt (a batch: several)
    max_tokens: int                        # per prompt, the first token included
    stream: bool
    include_usage: bool                    # stream_options.include_usage


#: Every field of a /v1/completions body the front honours or checks; any other is 400.
#: temperature, top_p, seed and the penalties are accepted and change nothing
#: (greedy decoding); user is the caller's label.
KNOWN_FIELDS = frozenset({
    "model", "prompt", "max_tokens", "stream", "stream_options", "n", "best_of", "echo",
    "logprobs", "suffix", "stop", "temperature", "top_p", "seed", "frequency_penalty",
    "presence_penalty", "logit_bias", "user"})


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_completion(body, model_name: str, tokenizer: ByteTokenizer) -> CompletionRequest:
    """Validate a ``/v1/completions`` JSON body.

    Raises:
        HttpError: 400 for invalid or unsupported fields, 404 for another model.
    """
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        # Never ignored: a field the front cannot honour (an image, a tool call,
        # a sampling option it has no code for) would change what the caller
        # gets, or which cached KV a different input reuses.
        raise HttpError(400, f"'{unknown[0]}' is not supported here (known fields: "
                             f"{', '.join(sorted(KNOWN_FIELDS))})", unknown[0])
    if body.get("logit_bias") not in (None, {}):
        raise HttpError(400, "'logit_bias' is not supported (greedy decoding)", "logit_bias")
    model = body.get("model")
    if not isinstance(model, str):
        raise HttpError(400, "'model' is required", "model")
    if model != model_name:
        raise HttpError(404, f"model {model!r} is not served here; this server serves {model_name!r}",
                        "model", "model_not_found")
    prompts = _parse_prompts(body.get("prompt"), tokenizer)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if not _is_int(max_tokens) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
        raise HttpError(400, f"'max_tokens' must be an integer in [1, {MAX_TOKENS_LIMIT}], "
                             f"got {str(max_tokens)[:40]}", "max_tokens")
    for name, default in (("n", 1), ("best_of", 1), ("echo", False), ("logprobs", None),
                          ("suffix", None)):
        value = body.get(name)
        if value is not None and value != default:
            raise HttpError(400, f"'{name}'={value!r} is not supported (greedy decoding, one choice)",
                            name)
    if body.get("stop") not in (None, [], ""):
        raise HttpError(400, "'stop' is not supported", "stop")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise HttpError(400, "'stream' must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise HttpError(400, "'stream_options' must be an object", "stream_options")
    if set(options) - {"include_usage"}:
        raise HttpError(400, f"'stream_options.{sorted(set(options) - {'include_usage'})[0]}' "
                             f"is not supported", "stream_options")
    return CompletionRequest(model, prompts, max_tokens, stream,
                             bool(stream and options.get("include_usage")))


def _parse_prompts(prompt, tokenizer: ByteTokenizer) -> tuple[tuple[int, ...], ...]:
    """str | list[str] | list[int] | list[list[int]] -> token ids per prompt."""
    if isinstance(prompt, str):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt:
        batch = prompt
    else:
        raise HttpError(400, "'prompt' must be a non-empty string, list of strings, list of token "
                        "ids or list of token id lists", "prompt")
    if len(batch) > MAX_BATCH_PROMPTS:
        raise HttpError(400, f"at most {MAX_BATCH_PROMPTS} prompts per request, got {len(batch)}",
                        "prompt")
    out = []
    for p in batch:
        if isinstance(p, str):
            try:
                ids = tokenizer.encode(p)
            except UnicodeEncodeError:      # JSON may escape a lone surrogate ("\ud800")
                raise HttpError(400, "a text prompt must be valid Unicode (it holds a lone "
                                     "surrogate)", "prompt") from None
        elif isinstance(p, list) and all(_is_int(t) for t in p):
            ids = p
        else:
            raise HttpError(400, "a batch must hold only strings or only token id lists", "prompt")
        if not ids:
            raise HttpError(400, "a prompt must hold at least one token", "prompt")
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise HttpError(400, f"token id {bad[0]} is outside the vocabulary "
                            f"[0, {tokenizer.vocab_size})", "prompt")
        out.append(tuple(ids))
    return tuple(out)


def failure_of(chunk: spb.GenerateChunk) -> HttpError:
    """The HTTP error of a failed request's last chunk (see :data:`HTTP_STATUS`)."""
    status = 429 if chunk.rejected and chunk.error_code != "INVALID_ARGUMENT" else \
        HTTP_STATUS.get(chunk.error_code, 500)
    return HttpError(status, chunk.error or "request failed", code=(chunk.error_code or None)
                     and chunk.error_code.lower())


def _failed(chunk: spb.GenerateChunk) -> bool:
    return chunk.done and (chunk.rejected or bool(chunk.error))


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
        tokenizer: text <-> token ids.
        security: with tokens, every request but ``/health`` needs
            ``Authorization: Bearer TOKEN`` of a client (or admin): 401 without
            or with an unknown one, 403 for another role; with TLS files the
            front speaks HTTPS. ``/health`` answers anyone, its workers only
            to an authenticated caller.
    """

    def __init__(self, backend: Backend, model_name: str, tokenizer: ByteTokenizer,
                 security: ServerSecurity | None = None, draining=lambda: False,
                 metrics=None):
        self.backend = backend
        self.draining = draining       # () -> bool: the process got SIGTERM
        self.metrics = metrics         # a kvstore.metrics.ProcessMetrics: requests counted
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.security = security or ServerSecurity()
        self.app = web.Application(middlewares=[self._count, self._authenticate])
        self.app.add_routes([web.post("/v1/completions", self.completions),
                             web.get("/v1/models", self.models),
                             web.get("/health", self.health)])
        self._runner: web.AppRunner | None = None

    def _role(self, request: web.Request) -> Role | None:
        return self.security.role_of([("authorization", request.headers.get("Authorization", ""))])

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
        """Listen on ``host:port`` (0: a free port); returns the port."""
        self._runner = web.AppRunner(self.app, access_log=None, logger=_server_log)
        await self._runner.setup()
        tls = self.security.tls
        site = web.TCPSite(self._runner, host, port,
                           ssl_context=server_context(tls) if tls is not None else None)
        await site.start()
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
            req = parse_completion(body, self.model_name, self.tokenizer)
        except HttpError as exc:
            return exc.response()
        run = _Completion(self, req)
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
    """One ``/v1/completions`` request: its prompts' streams, merged by choice index."""

    def __init__(self, front: HttpFront, req: CompletionRequest):
        self.front = front
        self.req = req
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.gens = [front.backend.generate(spb.GenerateRequest(
            request_id=f"{self.id}-{i}", prompt_tokens=p, max_tokens=req.max_tokens,
            arrival_ms=time.time() * 1000.0)) for i, p in enumerate(req.prompts)]
        self.firsts: list[spb.GenerateChunk] = []
        self._tasks: list[asyncio.Task] = []

    async def admit(self) -> HttpError | None:
        """Wait for every prompt's first chunk; the error if any was refused or failed.

        Rejection and failures before the first token end the request here,
        so they reach the client as an HTTP status, streamed or not.
        """
        self.firsts = list(await asyncio.gather(*(g.__anext__() for g in self.gens)))
        bad = [c for c in self.firsts if _failed(c)]
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

    def _choice(self, i: int, text: str, token_ids: list[int], done: spb.GenerateChunk | None) -> dict:
        c = {"index": i, "text": text, "logprobs": None, "finish_reason": None,
             "token_ids": token_ids}
        if done is not None:
            c["finish_reason"] = "length" if done.metrics.output_tokens >= self.req.max_tokens \
                else "stop"
            c["metrics"] = MessageToDict(done.metrics, preserving_proto_field_name=True)
        return c

    def _usage(self, completion_tokens: int) -> dict:
        prompt_tokens = sum(len(p) for p in self.req.prompts)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def _envelope(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.req.model, "choices": choices}

    async def collect(self) -> web.Response:
        tokens: list[list[int]] = [[] for _ in self.gens]
        done: list[spb.GenerateChunk | None] = [None] * len(self.gens)
        async with aclosing(self._events()) as events:
            async for i, chunk in events:
                if _failed(chunk):
                    return failure_of(chunk).response()
                tokens[i].extend(chunk.tokens)
                if chunk.done:
                    done[i] = chunk
        tok = self.front.tokenizer
        out = self._envelope([self._choice(i, tok.decode(t), t, done[i]) for i, t in enumerate(tokens)])
        out["usage"] = self._usage(sum(len(t) for t in tokens))
        return web.json_response(out)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        decoders = [self.front.tokenizer.stream_decoder() for _ in self.gens]
        produced = 0
        try:
            async with aclosing(self._events()) as events:
                async for i, chunk in events:
                    if _failed(chunk):
                        await _sse(resp, failure_of(chunk).body())
                        return resp
                    produced += len(chunk.tokens)
                    text = decoders[i].feed(list(chunk.tokens))
                    if chunk.done:
                        text += decoders[i].flush()
                    if chunk.tokens or chunk.done:
                        await _sse(resp, self._envelope([self._choice(
                            i, text, list(chunk.tokens), chunk if chunk.done else None)]))
            if self.req.include_usage:
                last = self._envelope([])
                last["usage"] = self._usage(produced)
                await _sse(resp, last)
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
    backend = GrpcBackend(cfg.conductor, cfg.creds)
    front = HttpFront(backend, cfg.served_model_name or cfg.model,
                      ByteTokenizer(model_config(cfg.model).vocab_size), cfg.security)
    port = await front.start(cfg.host, cfg.port)
    if cfg.security.tokens is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, cfg.security.tokens.reload)
    announce_ready({"role": "http", "address": f"{cfg.host}:{port}", "port": port,
                    "http_address": f"{cfg.host}:{port}", "conductor": cfg.conductor})
    await wait_for_stop_signal()
    await front.stop()
    await backend.close()
