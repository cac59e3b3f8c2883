"""One face of the scheduler: the live conductor's decisions recomputed by the simulator's.

``kvstore conductor --decision-log FILE`` writes, for every arrival, the state
the scheduler decided from and what it chose (:class:`kvstore.conductor.live_state.DecisionLog`).
:func:`recompute` feeds each recorded state to the scheduler the simulator
builds (:func:`kvstore.tools.sim.simulate.simulator_scheduler`, from a
:class:`~kvstore.tools.sim.simulate.SimConfig` made of the log's header), with the
simulator's own cache view (one pool per prefill instance, each holding the
blocks the store held), and compares the choices: prefill instance, decode
instance, rejection reason and estimated TTFT.

    kvstore simulate-parity FILE      # a line per decision that differs; exit 1 if any

Limits: the ``random`` policy draws from the conductor's generator, whose
state is not recorded, so its logs are refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import typer

from kvstore.conductor.cost_model import CostModel
from kvstore.conductor.instances import DecodeInstance, PrefillInstance, SchedRequest
from kvstore.errors import InvalidArgument
from kvstore.tools.sim.cluster import LocalPool
from kvstore.tools.sim.simulate import PoolView, SimConfig, simulator_scheduler


@dataclass(frozen=True, slots=True)
class Recomputed:
    """One recorded decision beside the simulator's."""

    request_id: str
    live: dict[str, Any]  # the log's choice
    simulated: dict[str, Any]  # the same fields, recomputed

    @property
    def equal(self) -> bool:
        a, b = self.live, self.simulated
        if (a["prefill"], a["decode"], a["rejected"]) != (b["prefill"], b["decode"], b["rejected"]):
            return False
        x, y = a["estimated_ttft_ms"], b["estimated_ttft_ms"]
        return (x is None) == (y is None) and (x is None or math.isclose(x, y, rel_tol=1e-9,
                                                                         abs_tol=1e-9))


def _read(path: str | Path) -> tuple[dict, Iterator[dict]]:
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not lines or "header" not in json.loads(lines[0]):
        raise InvalidArgument(f"{path}: not a conductor decision log (no header line)")
    return json.loads(lines[0])["header"], (json.loads(x) for x in lines[1:] if x.strip())


def recompute(path: str | Path) -> list[Recomputed]:
    """Every decision of the log at ``path``, recomputed from its recorded state.

    Raises:
        InvalidArgument: not a decision log, or one of the ``random`` policy.
    """
    head, records = _read(path)
    if head["policy"] == "random":
        raise InvalidArgument("the random policy's draws are not recorded; its decisions cannot "
                              "be recomputed")
    cost = CostModel.from_dict(head["cost_model"])
    slo = head["slo"]
    cfg = SimConfig(scheduler=head["policy"], rejection=head["rejection"],
                    num_prefill=len(head["prefill"]), num_decode=len(head["decode"]),
                    ttft_slo_ms=float(slo["ttft_ms"]), tbt_slo_ms=float(slo["tbt_ms"]),
                    balance_ratio=head["balance_ratio"], block_tokens=head["block_tokens"])
    out = []
    for rec in records:
        pre = [PrefillInstance(p["id"], alive=p["alive"], busy_until_ms=p["busy_until_ms"],
                               queued_ms=p["queued_ms"], queued_requests=p["queued_requests"],
                               queued_tokens=p["queued_tokens"]) for p in rec["prefill"]]
        dec = [DecodeInstance(d["id"], alive=d["alive"], active_requests=d["active_requests"],
                              context_tokens=d["context_tokens"]) for d in rec["decode"]]
        keys = tuple(range(rec["blocks"]))
        pools = {}
        for p in pre:                              # every instance reads the one store
            pools[p.instance_id] = LocalPool(max(rec["blocks"], 1))
            pools[p.instance_id].store(keys[:rec["cached_blocks"]], 0.0)
        sched = simulator_scheduler(pre, dec, cfg, cost, PoolView(pools))
        sched.forecast.restore(rec["forecast"])
        d = sched.schedule(SchedRequest(rec["request_id"], rec["prompt_tokens"], keys), rec["t_ms"])
        simulated = {"prefill": d.prefill.instance.instance_id if d.accepted else None,
                     "decode": d.decode.instance.instance_id if d.decode else None,
                     "estimated_ttft_ms": d.prefill.estimated_ttft_ms if d.prefill else None,
                     "rejected": d.rejection.reason.value if d.rejection else None}
        out.append(Recomputed(rec["request_id"], rec["choice"], simulated))
    return out


def simulate_parity_command(
    log_file: str = typer.Argument(..., metavar="DECISION_LOG",
                                   help="what `kvstore conductor --decision-log` wrote"),
) -> None:
    """Recompute a live conductor's decisions with the simulator's scheduler; exit 1 when
    any differs (each difference is printed)."""
    try:
        results = recompute(log_file)
    except (InvalidArgument, OSError, KeyError, ValueError) as exc:
        typer.echo(f"error: {getattr(exc, 'message', None) or exc}", err=True)
        raise typer.Exit(2)
    differ = [r for r in results if not r.equal]
    for r in differ:
        typer.echo(f"{r.request_id}: live {r.live} simulated {r.simulated}")
    typer.echo(f"{len(results) - len(differ)} of {len(results)} decisions equal")
    if differ:
        raise typer.Exit(1)
