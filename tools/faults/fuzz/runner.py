"""The fuzz loop: inputs split across surfaces, in batches, invariants after each.

    inputs N ──batches: the warm-up, then --batch inputs each──> each batch split by weight
            data-tcp 3 : data-unix 3 : master 3 : http 1 : resp 2 (largest remainder; only the
            surfaces asked for); every surface sends its share of the batch in
            its own thread (the servers see the surfaces at once), then the checker
            runs (:mod:`.checks`): processes alive, reference reads byte-exact,
            one probe per surface, RSS sampled, cross-tenant reads (where the
            target has the two tenants' tokens)

Reproducible: each surface draws from its own ``random.Random(f"{seed}:{surface}")``,
so a surface's inputs depend only on the seed and how many it sends, never on
the batch size, the other surfaces or what the servers answered (the
servers' answers only decide where connections break, see
:mod:`.data_driver`).

Warm-up: the first batch, of ``warmup`` inputs (20,000 by default, at most
half the run), is not counted for memory. RSS at the start is taken after
it, once the allocators, the caches the servers fill on first use, the
master's placement grants (fuzzed GrantPlacements live for their validity
and the put timeout, 32 s, up to ``kvstore.master.grants.MAX_GRANTS``) and the node's
fuzzed objects have reached their working size; the run's maximum is taken
after every later batch.

The HTTP share is the smallest: a valid completion runs the model, and the
front answers a few hundred inputs per second where the data port and the
master answer over a thousand.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Callable

from kvstore.tools.faults.fuzz.checks import Checker, TenantCheck, exited, rss_bytes
from kvstore.tools.faults.fuzz.cluster import Target
from kvstore.tools.faults.fuzz.data_driver import DataDriver, tcp_connector, unix_connector
from kvstore.tools.faults.fuzz.frames import FrameGenerator
from kvstore.tools.faults.fuzz.grpc_driver import GrpcDriver
from kvstore.tools.faults.fuzz.grpc_inputs import GrpcGenerator
from kvstore.tools.faults.fuzz.http_driver import HttpDriver
from kvstore.tools.faults.fuzz.http_inputs import HttpGenerator
from kvstore.tools.faults.fuzz.report import SURFACES, FuzzReport, RssTrack, SurfaceStats
from kvstore.tools.faults.fuzz.resp_driver import RespDriver
from kvstore.tools.faults.fuzz.resp_inputs import RespGenerator

#: Relative share of the inputs per surface (see the module docstring).
WEIGHTS = {"data-tcp": 3, "data-unix": 3, "master": 3, "http": 1, "resp": 2}
#: Processes whose memory is tracked (the engines hold a model and a KV cache of fixed size).
RSS_WATCHED = ("master", "node", "conductor", "resp")


def generator(surface: str, seed: int):
    """The input generator of ``surface`` for ``seed`` (``.next()`` gives the next input)."""
    rng = random.Random(f"{seed}:{surface}")
    if surface in ("data-tcp", "data-unix"):
        return FrameGenerator(rng)
    if surface == "master":
        return GrpcGenerator(rng)
    if surface == "http":
        return HttpGenerator(rng)
    if surface == "resp":
        return RespGenerator(rng)
    raise ValueError(f"unknown surface {surface!r}; known: {', '.join(SURFACES)}")


def split(inputs: int, surfaces: list[str]) -> dict[str, int]:
    """How many inputs each surface sends (weights, largest remainder)."""
    total_w = sum(WEIGHTS[s] for s in surfaces)
    exact = {s: inputs * WEIGHTS[s] / total_w for s in surfaces}
    out = {s: int(v) for s, v in exact.items()}
    for s in sorted(surfaces, key=lambda s: out[s] - exact[s])[: inputs - sum(out.values())]:
        out[s] += 1
    return out


def _driver(surface: str, target: Target, stats: SurfaceStats):
    token = target.tokens["client"]
    if surface == "data-tcp":
        return DataDriver(tcp_connector(*target.node_tcp), token, stats)
    if surface == "data-unix":
        return DataDriver(unix_connector(target.node_unix), token, stats)
    if surface == "master":
        return GrpcDriver(target.master, target.tokens, stats)
    if surface == "resp":
        return RespDriver(target.resp, target.tokens, stats)
    return HttpDriver(target.http, target.tokens, stats)


def batch_sizes(inputs: int, batch: int, warmup: int) -> list[int]:
    """Inputs per batch: the warm-up (at most half the run), then ``batch`` at a time."""
    inputs = max(2, inputs)
    first = max(1, min(warmup, inputs // 2))
    rest = inputs - first
    return [first] + [batch] * (rest // batch) + ([rest % batch] if rest % batch else [])


def run_fuzz(target: Target, *, inputs: int, seed: int = 1, surfaces: list[str] | None = None,
             batch: int = 5000, warmup: int = 20_000, popen: dict | None = None,
             max_rss_ratio: float = 1.5,
             on_batch: Callable[[FuzzReport, int], None] | None = None) -> FuzzReport:
    """Fuzz ``target`` with ``inputs`` inputs; see the module docstring.

    Args:
        surfaces: a subset of :data:`~.report.SURFACES` (default: all the target has).
        batch: inputs between two checks.
        warmup: inputs of the first batch, after which memory is first sampled.
        popen: name -> Popen of processes started here (exit codes); others are
            watched by pid.
        on_batch: called after each batch with the report so far and the inputs done.

    Raises:
        ValueError: an unknown surface, or one the target does not serve.
        KVStoreError: the reference objects cannot be put.
    """
    served = {"http": target.http, "resp": target.resp}
    surfaces = list(surfaces or [s for s in SURFACES if served.get(s, True)])
    for s in surfaces:
        if s not in WEIGHTS:
            raise ValueError(f"unknown surface {s!r}; known: {', '.join(SURFACES)}")
    if "http" in surfaces and not target.http:
        raise ValueError("the target has no HTTP front")
    if "resp" in surfaces and not target.resp:
        raise ValueError("the target has no RESP front")
    if "data-unix" in surfaces and not target.node_unix:
        raise ValueError("the target has no node Unix socket")
    sizes = batch_sizes(inputs, max(1, batch), warmup)
    report = FuzzReport(seed, {s: SurfaceStats() for s in surfaces}, max_rss_ratio=max_rss_ratio)
    per_batch = [split(n, surfaces) for n in sizes]
    gens = {s: generator(s, seed) for s in surfaces}
    drivers = {s: _driver(s, target, report.surfaces[s]) for s in surfaces}
    checker = Checker(target, seed)
    tenants = TenantCheck(target, seed) if TenantCheck.available(target) else None
    watched = {n: p for n, p in target.pids.items() if n in RSS_WATCHED}
    t0 = time.monotonic()
    done = 0
    try:
        for b, shares in enumerate(per_batch):
            errors: list[BaseException] = []
            threads = [threading.Thread(target=_send, args=(gens[s], drivers[s], shares[s], errors),
                                        name=f"fuzz-{s}", daemon=True) for s in surfaces]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise errors[0]           # a fuzzer bug: the run's counts would be wrong
            done += sum(shares.values())
            report.batches = b + 1
            report.process_exits = exited(target.pids, popen)
            if report.process_exits:
                break
            reads, wrong, failed = checker.read_references()
            report.reads += reads
            report.wrong_bytes += wrong
            report.failed_reads += failed
            if tenants is not None:
                tries, crossed = tenants.check()
                report.cross_tenant_tries += tries
                report.cross_tenant_reads += crossed
            for s in checker.probe():
                report.probe_failures[s] = report.probe_failures.get(s, 0) + 1
            for name, pid in watched.items():
                track = report.rss.setdefault(name, RssTrack())
                rss = rss_bytes(pid)
                if b == 0:
                    track.start_bytes = track.max_bytes = track.last_bytes = rss
                else:
                    track.see(rss)
            report.elapsed_s = time.monotonic() - t0
            if on_batch is not None:
                on_batch(report, done)
    finally:
        for d in drivers.values():
            d.close()
        checker.close()
        if tenants is not None:
            tenants.close()
    report.elapsed_s = time.monotonic() - t0
    return report


def _send(gen, driver, n: int, errors: list[BaseException]) -> None:
    try:
        digest = driver.stats.digest
        for _ in range(n):
            item = gen.next()
            digest.update(item.fingerprint())
            driver.send(item)
        driver.flush()
    except BaseException as exc:          # handed to the main thread
        errors.append(exc)
