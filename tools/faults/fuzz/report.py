"""What a fuzz run counts, the invariants it judges, and the table it prints.

Per surface (``data-tcp``, ``data-unix``, ``master``, ``http``, ``resp``)::

    inputs            inputs sent
    answers           answers by kind: node codes (NOT_FOUND, ...), gRPC status
                      names, HTTP statuses, RESP reply types (+ - : $ * ...); OK / 200 included
    closed            connections the server closed as the input asked for (a refused
                      handshake, a frame it cannot trust, a malformed HTTP request)
    refused           connection attempts the server refused
    no_answer         inputs left without an answer within the driver's timeout
                      while the connection stayed open (a hang, for others too
                      if the checker's reads fail at the same time)
    unexpected        answers other than the server's rules say (a data connection
                      closed early or a reply that does not parse)
    inputs_sha256     SHA-256 of the inputs sent, in order (their canonical encodings):
                      two runs with one seed and one input count show the same

Per run: process exits, wrong bytes and failed reads of the reference
objects, probes per surface that got no answer, RSS of master, node,
conductor and the RESP front (start after the warm-up batch, max after every batch),
cross-tenant reads (one tenant's token reading or confirming another's object).
The run passes when no process exited, no reference read failed or returned other
bytes, every probe was answered, each RSS max is within
``max_rss_ratio`` of its start, and no read crossed tenants.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field

SURFACES = ("data-tcp", "data-unix", "master", "http", "resp")


@dataclass(slots=True)
class SurfaceStats:
    inputs: int = 0
    answers: Counter = field(default_factory=Counter)
    closed: int = 0
    refused: int = 0
    no_answer: int = 0
    unexpected: int = 0
    kinds: Counter = field(default_factory=Counter)     # inputs by generator case
    samples: list = field(default_factory=list)         # a few odd answers, for the report
    digest: "hashlib._Hash" = field(default_factory=hashlib.sha256)   # of the inputs sent

    def note(self, what: str, limit: int = 20) -> None:
        """Keep a description of an odd answer (the first ``limit`` only)."""
        if len(self.samples) < limit:
            self.samples.append(what[:500])

    def to_dict(self) -> dict:
        return {"inputs": self.inputs, "answers": dict(sorted(self.answers.items())),
                "closed": self.closed, "refused": self.refused, "no_answer": self.no_answer,
                "unexpected": self.unexpected, "inputs_sha256": self.digest.hexdigest(),
                "samples": list(self.samples)}


@dataclass(slots=True)
class RssTrack:
    """One process's resident memory: at the start (after warm-up) and the most seen."""

    start_bytes: int = 0
    max_bytes: int = 0
    last_bytes: int = 0

    def see(self, rss_bytes: int) -> None:
        self.last_bytes = rss_bytes
        self.max_bytes = max(self.max_bytes, rss_bytes)

    @property
    def ratio(self) -> float:
        return self.max_bytes / self.start_bytes if self.start_bytes else 0.0

    def to_dict(self) -> dict:
        return {"start_bytes": self.start_bytes, "max_bytes": self.max_bytes,
                "ratio": round(self.ratio, 3)}


@dataclass(slots=True)
class FuzzReport:
    seed: int
    surfaces: dict[str, SurfaceStats]
    batches: int = 0
    elapsed_s: float = 0.0
    process_exits: dict[str, int] = field(default_factory=dict)   # name -> exit code
    wrong_bytes: int = 0            # reference reads that returned other bytes
    failed_reads: int = 0           # reference reads that raised
    reads: int = 0
    probe_failures: dict[str, int] = field(default_factory=dict)   # surface -> checks it failed
    cross_tenant_tries: int = 0     # another tenant's objects asked for (0: not checked)
    cross_tenant_reads: int = 0     # ... answers that returned or confirmed one
    rss: dict[str, RssTrack] = field(default_factory=dict)
    max_rss_ratio: float = 1.5

    @property
    def inputs(self) -> int:
        return sum(s.inputs for s in self.surfaces.values())

    def failures(self) -> list[str]:
        """Every invariant the run broke ([]: it passed)."""
        out = [f"{name} exited with code {code}" for name, code in self.process_exits.items()]
        if self.wrong_bytes:
            out.append(f"{self.wrong_bytes} reference read(s) returned wrong bytes")
        if self.failed_reads:
            out.append(f"{self.failed_reads} reference read(s) failed")
        if self.cross_tenant_reads:
            out.append(f"{self.cross_tenant_reads} cross-tenant read(s)")
        out += [f"{name} did not answer its probe after {n} batch(es)"
                for name, n in self.probe_failures.items()]
        out += [f"{name} RSS grew {t.ratio:.2f}x (limit {self.max_rss_ratio}x)"
                for name, t in self.rss.items() if t.ratio > self.max_rss_ratio]
        return out

    def to_dict(self) -> dict:
        return {"seed": self.seed, "inputs": self.inputs, "batches": self.batches,
                "elapsed_s": round(self.elapsed_s, 1),
                "surfaces": {n: s.to_dict() for n, s in self.surfaces.items()},
                "process_exits": self.process_exits, "wrong_bytes": self.wrong_bytes,
                "failed_reads": self.failed_reads, "reads": self.reads,
                "probe_failures": self.probe_failures,
                "cross_tenant_tries": self.cross_tenant_tries,
                "cross_tenant_reads": self.cross_tenant_reads,
                "rss": {n: t.to_dict() for n, t in self.rss.items()},
                "max_rss_ratio": self.max_rss_ratio, "passed": not self.failures(),
                "failures": self.failures()}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _answers(c: Counter, width: int = 6) -> str:
    top = c.most_common()
    text = ", ".join(f"{k} {v:,}" for k, v in top[:width])
    return text + (f", +{len(top) - width} more" if len(top) > width else "")


def render(report: FuzzReport, console) -> None:
    """Print the run's tables on a rich console."""
    from rich.table import Table

    t = Table(title=f"kvstore fuzz: seed {report.seed}, {report.inputs:,} inputs, "
                    f"{report.batches} batches, {report.elapsed_s:.0f} s")
    for col in ("surface", "inputs", "answers (by kind)", "closed", "refused", "no answer",
                "unexpected"):
        t.add_column(col, justify="left" if col.startswith(("surface", "answers")) else "right")
    for name, s in report.surfaces.items():
        t.add_row(name, f"{s.inputs:,}", _answers(s.answers), f"{s.closed:,}", f"{s.refused:,}",
                  f"{s.no_answer:,}", f"{s.unexpected:,}")
    console.print(t)
    r = Table(title="invariants")
    for col in ("check", "value", "limit", "result"):
        r.add_column(col, justify="left" if col == "check" else "right")

    def row(check: str, value: str, limit: str, ok: bool) -> None:
        r.add_row(check, value, limit, "[green]pass[/]" if ok else "[red]FAIL[/]")

    exits = ", ".join(f"{n} ({c})" for n, c in report.process_exits.items()) or "0"
    row("process exits", exits, "0", not report.process_exits)
    row("wrong bytes (reference reads)", f"{report.wrong_bytes:,} of {report.reads:,}", "0",
        not report.wrong_bytes)
    row("failed reads", f"{report.failed_reads:,}", "0", not report.failed_reads)
    probes = ", ".join(f"{n} ({c})" for n, c in report.probe_failures.items()) or "0"
    row("surfaces not answering a probe", probes, "0", not report.probe_failures)
    if report.cross_tenant_tries:
        row("cross-tenant reads", f"{report.cross_tenant_reads:,} of "
            f"{report.cross_tenant_tries:,}", "0", not report.cross_tenant_reads)
    for name, track in report.rss.items():
        row(f"{name} RSS MiB (start -> max)",
            f"{_mib(track.start_bytes)} -> {_mib(track.max_bytes)} ({track.ratio:.2f}x)",
            f"{report.max_rss_ratio}x", track.ratio <= report.max_rss_ratio)
    console.print(r)
