"""What one conductor process serves: its settings and how its cost model is chosen.

``kvstore conductor`` builds a :class:`ConductorConfig` from its options and
hands it to :func:`kvstore.conductor.service.serve`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.conductor.cost_model import CostModel, load_cost_model
from kvstore.metrics import MetricsConfig
from kvstore.rpc import ClientCredentials, ServerSecurity


@dataclass(frozen=True, slots=True)
class Deadlines:
    """Time limits that keep a request from waiting on a stuck worker."""

    prefill_s: float = 60.0        # one Prefill RPC, the engine's queue included
    decode_idle_s: float = 30.0    # longest wait for the next decode token
    probe_s: float = 2.0           # one Status probe
    probe_interval_s: float = 0.5  # between probe rounds
    probe_misses: int = 3          # probe timeouts in a row that mark a worker dead


@dataclass(frozen=True, slots=True)
class ConductorConfig:
    """What one conductor process serves (``kvstore conductor``)."""

    master: str                          # kvstore master address host:port
    prefill: tuple[str, ...]             # prefill engines as [ID=]host:port
    decode: tuple[str, ...]              # decode engines as [ID=]host:port
    model: str = "tiny"                  # "tiny" or a Hugging Face style folder
    tokenizer: str = ""                  # HTTP front: "" the model's own, "byte", or a folder
    block_tokens: int = 16
    use_cache: bool = True               # False: never read the prefix cache
    host: str = "127.0.0.1"
    port: int = 0                        # 0: a free port
    http_port: int | None = None         # also serve the HTTP front (0: a free port); None: off
    http_host: str = "127.0.0.1"
    served_model_name: str = ""          # model id of the HTTP front ("" : ``model``)
    deadlines: Deadlines = Deadlines()
    security: ServerSecurity = ServerSecurity()      # --auth / --tls-* of gRPC and HTTP
    creds: ClientCredentials = ClientCredentials()   # its token to the store and the engines
    insecure: bool = False               # allow a non-loopback bind without --auth (warned)
    advertise_host: str = ""             # the address in its READY line ("" : kvstore.binding)
    metrics: MetricsConfig = MetricsConfig()   # --metrics-port, --metrics-host
    drain_s: float = 0.0               # SIGTERM: NOT_SERVING this long before stopping
    cost_model: str = "auto"             # estimates: a bundled name, a file, "auto" or "none" (tokens)
    ttft_slo_ms: float = float("inf")    # refuse at arrival when the estimated TTFT is above it
    tbt_slo_ms: float = float("inf")     # decode instances whose predicted TBT is above it are not chosen
    rejection: str = "auto"              # early rejection policy; "auto": "early" with an SLO, else "none"
    decision_log: str = ""               # JSON lines of each decision and its state ("" : none)


#: The cost model of the bundled engines (``kvstore profile`` fits it): what "auto" picks
#: for ``--model tiny``, so the live conductor runs Algorithm 1 on the simulator's model.
BUNDLED_COST_MODEL = "tiny-cpu"


def conductor_cost_model(name: str, model: str) -> CostModel | None:
    """The conductor's cost model: ``name`` a bundled model or a JSON file; "auto": the
    bundled engines' profiled model for ``model`` "tiny", none for other models (no
    profile known: estimates count queued tokens); "none" or "": none.

    Raises:
        FileNotFoundError, ValueError: ``name`` is no bundled model and no valid file.
    """
    if name == "auto":
        name = BUNDLED_COST_MODEL if model == "tiny" else ""
    return load_cost_model(name) if name and name != "none" else None
