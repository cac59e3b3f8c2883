"""Whether a process is serving: one state behind ``/health``, ``/ready`` and gRPC health.

A process moves through these states::

    STARTING --> SERVING  <--> STANDBY      (a master that is not its shard's leader)
          \\________\\____________\\--> DRAINING   (SIGTERM: health flips first, then the
                                                  listener stops, then in-flight work ends)

    state       /health   /ready   gRPC health (grpc.health.v1, "" and the service name)
    STARTING    503       503      NOT_SERVING      (also: a standby master that cannot
                                                   reach etcd, so could never take over)
    SERVING     200       200      SERVING
    STANDBY     503       200      NOT_SERVING      (also: a conductor without live
                                                   engines, a node that cannot accept)
    DRAINING    503       503      NOT_SERVING

``/health`` says "send me requests"; ``/ready`` says "this process is up and
doing its job" (a standby's job is to stand by), which is what a Kubernetes
readiness probe and a PodDisruptionBudget should count for masters.

Thread safety: :meth:`Health.set` may be called from any thread; the gRPC
health servicer is updated on the event loop it was attached from.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    STANDBY = "standby"
    DRAINING = "draining"


class Health:
    """One process's serving state.

    Args:
        services: gRPC service names reported besides the overall ``""``
            (e.g. ``kvstore.Master``).
    """

    def __init__(self, services: tuple[str, ...] = ()):
        self.services = ("", *services)
        self._state = State.STARTING
        self.detail = ""           # why not SERVING, for /health (e.g. a master's warm-up)
        self._lock = threading.Lock()
        self._grpc = None          # grpc_health.v1 aio HealthServicer
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def state(self) -> State:
        return self._state

    @property
    def serving(self) -> bool:
        """``/health`` is 200."""
        return self._state is State.SERVING

    @property
    def ready(self) -> bool:
        """``/ready`` is 200."""
        return self._state in (State.SERVING, State.STANDBY)

    def set(self, state: State) -> None:
        """Move to ``state``; DRAINING is final (later calls are ignored)."""
        with self._lock:
            if self._state is State.DRAINING or self._state is state:
                return
            log.info("health: %s -> %s", self._state.value, state.value)
            self._state = state
        self._push()

    def attach_grpc(self, server) -> None:
        """Serve ``grpc.health.v1.Health`` on ``server`` (a grpc.aio server, before start;
        call on its event loop)."""
        from grpc_health.v1 import health_pb2_grpc
        from grpc_health.v1._async import HealthServicer

        self._grpc = HealthServicer()
        self._loop = asyncio.get_running_loop()
        health_pb2_grpc.add_HealthServicer_to_server(self._grpc, server)
        self._push()

    def _push(self) -> None:
        if self._grpc is None or self._loop is None or self._loop.is_closed():
            return
        from grpc_health.v1 import health_pb2

        status = (health_pb2.HealthCheckResponse.SERVING if self.serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)

        async def push():
            for name in self.services:
                await self._grpc.set(name, status)

        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._loop.create_task(push())
        else:
            asyncio.run_coroutine_threadsafe(push(), self._loop)


#: Longest wait (s) for calls in flight once a draining server stops accepting.
DRAIN_GRACE_S = 5.0


async def drain(health: Health, server, drain_s: float = 0.0,
                grace_s: float = DRAIN_GRACE_S) -> None:
    """Drain a grpc.aio ``server``: health flips to DRAINING first, then after
    ``drain_s`` (s; probes and load balancers see the flip) the server stops
    accepting, then calls in flight get up to ``grace_s`` (s) to finish."""
    health.set(State.DRAINING)
    if drain_s > 0:
        await asyncio.sleep(drain_s)
    await server.stop(grace_s)
