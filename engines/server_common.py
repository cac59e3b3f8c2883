"""What the prefill and decode engine processes share: their config, model and serving loop."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

import grpc
import torch

from kvstore import rpc
from kvstore.auth import Role
from kvstore.binding import advertised_host, check_binding
from kvstore.rpc import ClientCredentials, ServerSecurity

from kvstore.engines.kv_cache import PagedKVCache
from kvstore.engines.model import LlamaModel
from kvstore.client.models import TINY, model_config, namespace_for_model
from kvstore.errors import InvalidArgument, NoSpace, status_code
from kvstore.keys import Namespace
from kvstore.health import Health, State, drain
from kvstore.metrics import (MetricsConfig, MetricsServer, ProcessMetrics, check_metrics_binding,
                             start_metrics)
from kvstore.process import announce_ready, wait_for_stop_signal


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What one engine process runs (``kvstore prefill`` / ``kvstore decode``)."""

    master: str                    # kvstore master address host:port
    model: str = TINY              # "tiny" (seeded random) or a Hugging Face style folder
    block_tokens: int = 16         # tokens per KV block / page
    kv_pages: int = 4096           # pages in the engine's KV cache
    instance_id: str = ""          # name in logs and metrics ("" : a random one)
    threads: int = 1               # torch intra-op threads
    host: str = "127.0.0.1"
    port: int = 0                  # 0: a free port
    save_mode: str = ""            # prefill: a name in kv_saver.SAVE_MODES ("" : the default)
    security: ServerSecurity = ServerSecurity()      # --auth / --tls-* of its own port
    creds: ClientCredentials = ClientCredentials()   # its token to the store
    insecure: bool = False         # allow a non-loopback bind without --auth (warned)
    advertise_host: str = ""       # the address in its READY line ("" : see kvstore.binding)
    metrics: MetricsConfig = MetricsConfig()   # --metrics-port, --metrics-host
    drain_s: float = 0.0               # SIGTERM: NOT_SERVING this long before stopping


#: Which roles may call an engine (the conductor holds a client token; admin may do all).
ENGINE_METHOD_ROLES: dict[str, frozenset[Role]] = {
    "Prefill": frozenset({Role.CLIENT}), "Decode": frozenset({Role.CLIENT}),
    "Status": frozenset({Role.CLIENT}),
}


@dataclass
class ServedEngine:
    """A started engine server and what serving it needs until it drains."""

    server: grpc.aio.Server
    port: int
    info: dict                          # the READY line
    health: Health
    metrics_server: MetricsServer | None
    drain_s: float


async def start_engine_server(cfg: EngineConfig, role: str, add_servicer,
                              metrics: ProcessMetrics) -> ServedEngine:
    """The engine's gRPC server (with the gRPC health service), secured and
    started, and its metrics port when ``cfg.metrics`` names one.

    Raises:
        OSError: a port cannot be bound.
    """
    observed = cfg.metrics.port is not None
    server = rpc.aio_server(cfg.security, ENGINE_METHOD_ROLES, metrics if observed else None)
    port = rpc.listen(server, cfg.host, cfg.port, cfg.security)
    add_servicer(server)
    health = Health((_SERVICE_NAMES[role],))
    health.attach_grpc(server)
    await server.start()
    if cfg.security.tokens is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, cfg.security.tokens.reload)
    host = advertised_host(cfg.host, cfg.advertise_host, toward=cfg.master.split("|")[0])
    info = {"role": role, "address": f"{host}:{port}", "port": port}
    mserver, maddress = start_metrics(cfg.metrics, cfg.host, metrics, health, cfg.security, host)
    if maddress:
        info["metrics_address"] = maddress
    health.set(State.SERVING)
    return ServedEngine(server, port, info, health, mserver, cfg.drain_s)


_SERVICE_NAMES = {"prefill": "kvstore.serving.v1.PrefillEngine",
                  "decode": "kvstore.serving.v1.DecodeEngine"}


def load_engine(cfg: EngineConfig, role: str) -> tuple[LlamaModel, PagedKVCache]:
    """The model and its paged KV cache, with torch set to ``cfg.threads`` threads.

    Raises:
        BindRefused: ``cfg`` binds a non-loopback address without --auth or
            --insecure (checked first: no model is loaded for nothing).
    """
    check_binding(role, cfg.host, cfg.security.tokens is not None, cfg.insecure)
    check_metrics_binding(role, cfg.metrics, cfg.host, cfg.security.tokens is not None,
                          cfg.insecure)
    torch.set_num_threads(cfg.threads)
    mcfg = model_config(cfg.model)
    model = LlamaModel.random(mcfg) if cfg.model == TINY else LlamaModel.from_pretrained(cfg.model)
    cache = PagedKVCache.for_model(mcfg, cfg.kv_pages, cfg.block_tokens)
    return model, cache


def namespace_of(cfg: EngineConfig) -> Namespace:
    return namespace_for_model(cfg.model, cfg.block_tokens)


def abort_code(exc: Exception) -> grpc.StatusCode:
    """The status an engine fails a request with, from the error table (kvstore.errors).

    No room (the store's NoSpace, the engine's own OutOfPages) and bad input
    keep their codes; any other failure means this engine could not serve
    the request and another one may: UNAVAILABLE, which the conductor retries
    elsewhere.
    """
    if isinstance(exc, ValueError):
        exc = InvalidArgument(str(exc))
    if isinstance(exc, (NoSpace, InvalidArgument)):
        return status_code(exc)
    return grpc.StatusCode.UNAVAILABLE


async def serve_until_signal(served: ServedEngine, info: dict, on_stop=None) -> None:
    """Announce READY (``served.info`` and ``info``), run until SIGTERM/SIGINT, then
    drain: NOT_SERVING first, stop accepting, let calls in flight end, then ``on_stop``."""
    announce_ready({**served.info, **info})
    await wait_for_stop_signal()
    await drain(served.health, served.server, served.drain_s)
    if on_stop is not None:
        on_stop()
    if served.metrics_server is not None:
        served.metrics_server.stop()
