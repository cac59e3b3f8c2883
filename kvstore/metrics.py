"""Prometheus metrics of one kvstore process, and the HTTP port that serves them.

Every service takes ``--metrics-port PORT`` (0 picks a free one; its READY
line then carries ``metrics_address``) and serves there::

    GET /metrics    Prometheus text format (prometheus-client's exposition)
    GET /health     200 while the process serves requests, else 503 (kvstore.health)
    GET /ready      200 once started and until draining (a standby is ready), else 503

The port follows the listener rules of :mod:`kvstore.binding` (it binds the
service's ``--host`` unless ``--metrics-host`` says otherwise) and of
:mod:`kvstore.auth`: with ``--auth``, ``/metrics`` needs ``Authorization:
Bearer TOKEN`` of role ``admin`` or ``metrics`` (401 without, 403 for other
roles); ``/health`` and ``/ready`` stay open, as probes carry no tokens and
they tell nothing but the state. With ``--tls-cert`` the port serves HTTPS
(no client certificates asked: scrapers and probes authenticate by token).

Names follow Prometheus' conventions: prefix ``kvstore_``, base units
(seconds, bytes), ``_total`` for counters, labels of bounded values. Every
process has the request pair::

    kvstore_requests_total{op,code}            calls by method and status code
    kvstore_request_duration_seconds{op}       histogram of their durations

and registers its own gauges and counters as collectors (:meth:`ProcessMetrics.collect`)
that read the process's own state at scrape time, so the hot path pays for
nothing but the request pair: each serving thread adds to a tally of its
own (no lock, about a microsecond), and a scrape sums the tallies.
"""

from __future__ import annotations

import inspect
import json
import logging
import socket
import re
import threading
from bisect import bisect_left
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable

import grpc
from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily, Metric)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvstore.auth import Role
from kvstore.binding import check_binding
from kvstore.health import Health
from kvstore.tls import TlsFiles, server_context

log = logging.getLogger(__name__)
disable_created_metrics()      # no *_created series: they double the exposition for nothing

#: Request duration buckets (s): 50 us to 30 s, for data ops and generations alike.
REQUEST_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                   0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
METRICS_ROLES = frozenset({Role.ADMIN, Role.METRICS})

__all__ = ["ProcessMetrics", "RequestTally", "MetricsServer", "RequestMetrics", "gauge",
           "counter", "REQUEST_BUCKETS"]


class _Collector:
    def __init__(self, fn: Callable[[], Iterable[Metric]]):
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        try:
            return list(self._fn())
        except Exception:        # a scrape must not break on one bad reading
            log.exception("metrics collector failed")
            return []


class RequestTally:
    """Request counts and duration histograms of one thread: no locks on the hot path
    (a dict add and a bisect). :class:`ProcessMetrics` sums every tally at scrape time.
    """

    __slots__ = ("counts", "hist")

    def __init__(self):
        self.counts: dict[tuple[str, str], int] = {}       # (op, code) -> requests
        self.hist: dict[str, list[float]] = {}             # op -> bucket counts..., +Inf, sum

    def observe(self, op: str, code: str, seconds: float) -> None:
        """One request ``op`` that ended with ``code`` after ``seconds``."""
        key = (op, code)
        self.counts[key] = self.counts.get(key, 0) + 1
        h = self.hist.get(op)
        if h is None:
            h = self.hist[op] = [0] * (len(REQUEST_BUCKETS) + 1) + [0.0]
        h[bisect_left(REQUEST_BUCKETS, seconds)] += 1
        h[-1] += seconds

    def observe_many(self, op: str, code: str, buckets: list[int], seconds: float) -> None:
        """Requests ``op`` that ended with ``code``, already counted per bucket of
        :data:`REQUEST_BUCKETS` (then +Inf) and summed (``seconds``): the native GET
        service's."""
        n = sum(buckets)
        if not n:
            return
        key = (op, code)
        self.counts[key] = self.counts.get(key, 0) + n
        h = self.hist.get(op)
        if h is None:
            h = self.hist[op] = [0] * (len(REQUEST_BUCKETS) + 1) + [0.0]
        for i, count in enumerate(buckets):
            h[i] += count
        h[-1] += seconds

    def add(self, other: "RequestTally") -> None:
        for key, n in _items(other.counts):
            self.counts[key] = self.counts.get(key, 0) + n
        for op, h in _items(other.hist):
            mine = self.hist.setdefault(op, [0] * (len(REQUEST_BUCKETS) + 1) + [0.0])
            for i, v in enumerate(list(h)):
                mine[i] += v


def _items(d: dict) -> list:
    """``d``'s items, copied whole (under the GIL, as another thread adds to it)."""
    while True:
        try:
            return list(d.items())
        except RuntimeError:       # changed size during the copy: try again
            continue


class ProcessMetrics:
    """One process's registry: the request pair and its collectors.

    Args:
        service: ``master``, ``node``, ``prefill``, ``decode`` or ``conductor``
            (the ``component`` label of ``kvstore_process_info``; not ``service``,
            which Prometheus Operator sets on every target to its Service's name).

    Thread safety: each serving thread records into a tally of its own
    (:meth:`tally`; the event loop's is :attr:`loop_tally`, used by
    :meth:`observe`); a scrape sums them.
    """

    def __init__(self, service: str):
        self.service = service
        self.registry = CollectorRegistry()
        self.loop_tally = RequestTally()
        self._done = RequestTally()          # tallies of threads that ended
        self._live: set[RequestTally] = {self.loop_tally}
        self._lock = threading.Lock()
        self.collect(self._requests)
        self.collect(lambda: [gauge("kvstore_process_info", "This process's component.", 1,
                                    {"component": self.service})])

    def observe(self, op: str, code: str, seconds: float) -> None:
        """Count one request on the event loop's tally (see :meth:`RequestTally.observe`)."""
        self.loop_tally.observe(op, code, seconds)

    def tally(self) -> RequestTally:
        """A new tally for one thread; hand it back with :meth:`release`."""
        t = RequestTally()
        with self._lock:
            self._live.add(t)
        return t

    def release(self, tally: RequestTally) -> None:
        """Fold a finished thread's tally into the totals."""
        with self._lock:
            self._live.discard(tally)
            self._done.add(tally)

    def _requests(self) -> list[Metric]:
        total = RequestTally()
        with self._lock:
            total.add(self._done)
            for t in self._live:
                total.add(t)
        reqs = counter("kvstore_requests", "Requests served, by operation and status code.",
                       samples=[({"op": op, "code": code}, n)
                                for (op, code), n in sorted(total.counts.items())])
        hist = HistogramMetricFamily("kvstore_request_duration_seconds",
                                     "Time to serve a request (s), by operation.", labels=["op"])
        for op, h in sorted(total.hist.items()):
            cumulative, acc = [], 0
            for bound, n in zip((*REQUEST_BUCKETS, float("inf")), h[:-1]):
                acc += n
                cumulative.append((_bound(bound), acc))
            hist.add_metric([op], cumulative, sum_value=h[-1])
        return [reqs, hist]

    def collect(self, fn: Callable[[], Iterable[Metric]]) -> None:
        """Register ``fn``, called at each scrape, returning metric families
        (:func:`gauge`, :func:`counter`)."""
        self.registry.register(_Collector(fn))

    def text(self) -> bytes:
        """The Prometheus text exposition of everything registered."""
        return generate_latest(self.registry)


_TENANT_LABEL = re.compile(rb'[{,]tenant="([^"]*)"')


def only_tenants(text: bytes, scope) -> bytes:
    """The exposition ``text`` without the samples labelled with a tenant ``scope`` does
    not allow (what a metrics token bound to tenants reads: its tenants' figures only)."""
    out = []
    for line in text.splitlines(keepends=True):
        m = _TENANT_LABEL.search(line) if not line.startswith(b"#") else None
        if m is None or scope.allows_tenant(m.group(1).decode("utf-8", "replace")):
            out.append(line)
    return b"".join(out)


def _bound(b: float) -> str:
    return "+Inf" if b == float("inf") else repr(float(b))


def gauge(name: str, doc: str, value: float | None = None,
          labels: dict[str, str] | None = None,
          samples: Iterable[tuple[dict[str, str], float]] = ()) -> GaugeMetricFamily:
    """A gauge family: one ``value`` (with ``labels``) or ``samples`` of (labels, value)."""
    return _family(GaugeMetricFamily, name, doc, value, labels, samples)


def counter(name: str, doc: str, value: float | None = None,
            labels: dict[str, str] | None = None,
            samples: Iterable[tuple[dict[str, str], float]] = ()) -> CounterMetricFamily:
    """A counter family (``name`` without ``_total``; the exposition adds it)."""
    return _family(CounterMetricFamily, name, doc, value, labels, samples)


def _family(cls, name, doc, value, labels, samples):
    rows = list(samples)
    if value is not None:
        rows.append((labels or {}, value))
    keys = sorted({k for lab, _ in rows for k in lab})
    fam = cls(name, doc, labels=keys)
    for lab, v in rows:
        fam.add_metric([lab.get(k, "") for k in keys], v)
    return fam


# ---- gRPC ----

class RequestMetrics(grpc.aio.ServerInterceptor):
    """Counts and times every call of a grpc.aio server (put it first, so refusals
    by the auth interceptor are counted with their codes)."""

    def __init__(self, metrics: ProcessMetrics):
        self.metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler           # probes are not requests (and Watch streams forever)
        op = details.method.rsplit("/", 1)[-1]
        observe = self.metrics.observe
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary(request, context):
                t0 = time.perf_counter()
                code = "UNKNOWN"
                try:
                    reply = await inner(request, context)
                    code = _code(context, "OK")
                    return reply
                except BaseException:
                    code = _code(context, "UNKNOWN")
                    raise
                finally:
                    observe(op, code, time.perf_counter() - t0)

            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(
                getattr(handler.unary_stream, "__func__", handler.unary_stream)):
            inner_stream = handler.unary_stream

            async def stream(request, context):
                t0 = time.perf_counter()
                code = "UNKNOWN"
                try:
                    async for item in inner_stream(request, context):
                        yield item
                    code = _code(context, "OK")
                except BaseException:
                    code = _code(context, "CANCELLED")
                    raise
                finally:
                    observe(op, code, time.perf_counter() - t0)

            return grpc.unary_stream_rpc_method_handler(stream, **kw)
        return handler        # stream-in (a node's StreamEvents): one long call, not timed


def _code(context, default: str) -> str:
    try:
        code = context.code()
    except Exception:
        return default
    if isinstance(code, grpc.StatusCode):
        return code.name
    return _BY_VALUE.get(code, default)      # an int, or None: not set


_BY_VALUE = {c.value[0]: c.name for c in grpc.StatusCode}


# ---- HTTP ----

class MetricsServer:
    """``/metrics``, ``/health`` and ``/ready`` on a thread of their own.

    Args:
        metrics: what ``/metrics`` shows.
        health: what ``/health`` and ``/ready`` answer.
        host, port: where to listen (0: a free port).
        tokens: a :class:`kvstore.auth.TokenFile`; None: ``/metrics`` is open.
        tls: serve HTTPS with these files (the CA is not used: no client certificates).

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, metrics: ProcessMetrics, health: Health, host: str = "127.0.0.1",
                 port: int = 0, tokens=None, tls: TlsFiles | None = None):
        handler = _handler(metrics, health, tokens)
        server_class = _QuietServer6 if ":" in host else _QuietServer
        self._httpd = server_class((host.strip("[]"), port), handler)
        self._httpd.daemon_threads = True
        if tls is not None:
            ctx = server_context(TlsFiles(tls.cert, tls.key))
            self._httpd.socket = ctx.wrap_socket(self._httpd.socket, server_side=True,
                                                 do_handshake_on_connect=False)
        self.port = self._httpd.server_address[1]
        self.scheme = "https" if tls is not None else "http"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="metrics-http")

    def start(self) -> "MetricsServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


class _QuietServer(ThreadingHTTPServer):
    request_queue_size = 128      # scrapers and probes arrive in bursts
    def handle_error(self, request, client_address):
        # A failed TLS handshake or a dropped scrape: not worth a traceback.
        log.debug("metrics request from %s failed", client_address, exc_info=True)


class _QuietServer6(_QuietServer):
    address_family = socket.AF_INET6


def _handler(metrics: ProcessMetrics, health: Health, tokens):
    from kvstore.auth import allows, bearer

    class Handler(BaseHTTPRequestHandler):
        server_version = "kvstore-metrics"
        timeout = 10.0           # s: an idle or slow connection does not hold a thread
        protocol_version = "HTTP/1.1"

        def do_GET(self):   # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/health":
                return self._state(health.serving)
            if path == "/ready":
                return self._state(health.ready)
            if path != "/metrics":
                return self._reply(404, b"not found\n")
            scope = None
            if tokens is not None:
                creds = tokens.credentials_of(bearer([("authorization",
                                                       self.headers.get("Authorization", ""))]))
                role, scope = creds if creds is not None else (None, None)
                if role is None:
                    return self._reply(401, b"missing or unknown credentials "
                                            b"(Authorization: Bearer TOKEN)\n",
                                       extra={"WWW-Authenticate": "Bearer"})
                if not allows(role, METRICS_ROLES):
                    return self._reply(403, f"role {role.value!r} may not read "
                                            f"/metrics\n".encode())
            text = metrics.text()
            if scope is not None and not scope.everything:
                text = only_tenants(text, scope)
            self._reply(200, text, CONTENT_TYPE_LATEST)

        def _state(self, ok: bool):
            doc = {"status": health.state.value}
            if health.detail:
                doc["detail"] = health.detail       # e.g. what a warming-up index waits for
            body = (json.dumps(doc) + "\n").encode()
            self._reply(200 if ok else 503, body, "application/json")

        def _reply(self, code: int, body: bytes, ctype: str = "text/plain; charset=utf-8",
                   extra: dict[str, str] | None = None):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (extra or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt, *args):   # scrapes every few seconds: not worth a log line
            pass

    return Handler


# ---- a service's metrics port ----

@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """``--metrics-port`` / ``--metrics-host`` of a service."""

    port: int | None = None     # None: no metrics port; 0: a free one
    host: str = ""              # "" : the service's own bind address


def check_metrics_binding(service: str, cfg: MetricsConfig, service_host: str,
                          authenticated: bool, insecure: bool) -> None:
    """The binding rule (kvstore.binding) for a service's metrics port, checked
    before the service starts serving.

    Raises:
        BindRefused: a non-loopback metrics port without ``--auth`` or ``--insecure``.
    """
    if cfg.port is not None:
        check_binding(f"{service} metrics port", cfg.host or service_host, authenticated,
                      insecure)


def start_metrics(cfg: MetricsConfig, service_host: str, metrics: ProcessMetrics,
                  health: Health, security=None,
                  advertise: str = "") -> tuple[MetricsServer | None, str]:
    """Start a service's metrics port as configured.

    Args:
        service_host: the service's bind address (the default for ``cfg.host``).
        security: the service's :class:`kvstore.rpc.ServerSecurity` (tokens, TLS).
        advertise: the host others reach the service by (names the address).

    Returns:
        ``(server, "host:port")``, or ``(None, "")`` without a metrics port.

    Raises:
        OSError: the address cannot be bound.
    """
    if cfg.port is None:
        return None, ""
    host = cfg.host or service_host
    try:
        server = MetricsServer(metrics, health, host, cfg.port,
                               tokens=security.tokens if security is not None else None,
                               tls=security.tls if security is not None else None).start()
    except OSError as exc:
        raise OSError(f"metrics port: cannot listen on {host}:{cfg.port}: "
                      f"{(exc.strerror or str(exc)).lower()}") from None
    shown = advertise if host in ("0.0.0.0", "::", "") and advertise else host
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"            # an IPv6 address
    return server, f"{shown}:{server.port}"
