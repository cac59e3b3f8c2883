"""``kvstore scale``: one master shard and one node holding millions of small objects.

What an infra team asks before trusting a cache tier with a node's worth of
KV blocks: how much memory each object costs the master and the node, and
whether a restart loses anything. The run::

    start    a master (--state-dir) and a node (DRAM, and SSD with --ssd) on loopback
    insert   N objects of --value-bytes by batch_put             -> rate, RSS, bytes/object
    master   kill -9, start again; from READY on, poll sampled old keys until every
             one is found: NotFound must never be answered (Unavailable while the
             index is incomplete is fine)      -> to READY, to a whole index, stalls
    node     (--restart node) kill -9 the node, start it again on its SSD; from its
             READY on, every sampled key that was on its SSD is found

RSS is the process's own memory (``VmRSS - RssShmem`` from ``/proc/PID/status``:
the DRAM tier's shared segment is counted apart), read after the insert
settles; bytes per object are its growth over the idle process, divided by
N. Keys are 32 hex characters (xxh3-128 of the object's number), like the
chained prefix hashes engines write.

Long steps print their progress on stderr; the result is a table, or JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import typer
import xxhash

from kvstore.errors import NotFound, Unavailable
from kvstore.sizes import format_size, parse_size


#: Keys per Lookup while polling after a restart.
LOOKUP_BATCH = 100


def scale_key(i: int) -> str:
    """The key of object ``i`` of a scale run."""
    return xxhash.xxh3_128_hexdigest(i.to_bytes(8, "little"))


def own_rss_bytes(pid: int) -> tuple[int, int]:
    """(RSS without shared memory, shared memory) of process ``pid``, in bytes."""
    fields = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            fields[name] = value
    kib = lambda name: int(fields.get(name, "0 kB").split()[0]) * 1024   # noqa: E731
    return kib("VmRSS") - kib("RssShmem"), kib("RssShmem")


@dataclass(frozen=True, slots=True)
class ScaleConfig:
    objects: int = 1_000_000
    value_bytes: int = 64
    batch: int = 2048                  # keys per batch_put
    dram_bytes: int = 0                # 0: room for every object (no SSD) or 64 MiB (SSD)
    ssd_bytes: int = 0                 # SSD tier (0: none); objects past DRAM are demoted
    restart: tuple[str, ...] = ("master",)   # "master", "node"
    samples: int = 1000                # old keys polled after each restart
    start_timeout_s: float = 1800.0    # a restarted process's READY, at most
    log_dir: str | None = None


@dataclass(slots=True)
class RestartResult:
    what: str                          # "master" or "node"
    ready_s: float                     # kill to READY
    whole_s: float                     # READY to every sampled key found
    not_found: int                     # sampled keys answered NotFound after READY (must be 0)
    unavailable: int                   # lookups answered Unavailable (index incomplete)
    lookups: int                       # lookups made after READY
    loop_stall_max_ms: float = 0.0     # the restarted master's longest event-loop stall
    inventory_items: int = 0           # objects the node announced


@dataclass(slots=True)
class ScaleResult:
    objects: int
    value_bytes: int
    insert_s: float
    insert_errors: int
    master_rss_bytes: int
    node_rss_bytes: int
    node_shm_bytes: int
    master_bytes_per_object: float
    node_bytes_per_object: float       # beyond the value (its DRAM or SSD copy)
    restarts: list[RestartResult] = field(default_factory=list)


def _say(line: str) -> None:
    print(f"scale: {line}", file=sys.stderr, flush=True)


def _settled_rss(pid: int, wait_s: float = 1.0) -> tuple[int, int]:
    time.sleep(wait_s)
    return own_rss_bytes(pid)


def run_scale(cfg: ScaleConfig) -> ScaleResult:
    """Run it (see the module docstring).

    Raises:
        ChildFailed: a process did not come up.
    """
    from kvstore.client import KVClient
    from kvstore.tools.cluster.launcher import start_store_cluster

    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="kvstore-scale-")
    dram = cfg.dram_bytes or (64 << 20 if cfg.ssd_bytes else
                              max(64 << 20, int(cfg.objects * max(64, cfg.value_bytes) * 1.25)))
    ssd_dir = tempfile.mkdtemp(prefix="kvstore-scale-ssd-") if cfg.ssd_bytes else ""
    cluster = start_store_cluster(
        1, 1, dram=str(dram), log_dir=log_dir, eviction_policy="default" if cfg.ssd_bytes else "none",
        ssd=str(cfg.ssd_bytes) if cfg.ssd_bytes else "", ssd_dir=ssd_dir,
        node_args=("--no-prefault",))
    try:
        master, node = cluster.shards[0][0], cluster.nodes["n0"]
        idle_master, _ = _settled_rss(master.proc.pid, 0.5)
        idle_node, _ = own_rss_bytes(node.proc.pid)
        _say(f"master and node up (logs in {log_dir}); inserting {cfg.objects} objects of "
             f"{cfg.value_bytes} B")
        value = b"v" * cfg.value_bytes
        errors = 0
        t0 = last = time.monotonic()
        with KVClient(cluster.master, timeout_s=60, failover_wait_s=60) as client:
            for start in range(0, cfg.objects, cfg.batch):
                keys = [scale_key(i) for i in range(start, min(cfg.objects, start + cfg.batch))]
                errors += sum(r is not None for r in client.batch_put(keys, [value] * len(keys)))
                if time.monotonic() - last > 10:
                    last = time.monotonic()
                    done = start + len(keys)
                    _say(f"  {done}/{cfg.objects} ({done / (last - t0):.0f}/s)")
        insert_s = time.monotonic() - t0
        _say(f"inserted in {insert_s:.1f} s ({errors} errors); waiting for the node to settle")
        master_rss, _ = _settled_rss(master.proc.pid, 3.0)
        node_rss, node_shm = own_rss_bytes(node.proc.pid)
        result = ScaleResult(
            cfg.objects, cfg.value_bytes, insert_s, errors, master_rss, node_rss, node_shm,
            (master_rss - idle_master) / cfg.objects, (node_rss - idle_node) / cfg.objects)
        sample = [scale_key(i * cfg.objects // cfg.samples) for i in range(cfg.samples)]
        for what in cfg.restart:
            keys = sample
            if what == "node":
                # A node restart keeps its SSD only: poll the keys served from there.
                with KVClient(cluster.master, timeout_s=60) as client:
                    keys = [k for k, where in zip(sample, client.locate(sample))
                            if not isinstance(where, Exception)
                            and any(tier == "SSD" for _, tier in where)]
                _say(f"node: {len(keys)} of the {len(sample)} sampled keys are on its SSD")
            result.restarts.append(_restart(cluster, what, keys, cfg))
        return result
    finally:
        cluster.stop()
        if ssd_dir:
            import shutil
            shutil.rmtree(ssd_dir, ignore_errors=True)


def _restart(cluster, what: str, sample: list[str], cfg: ScaleConfig) -> RestartResult:
    """kill -9 the master or the node, start it again, and poll ``sample`` from READY on."""
    from kvstore.client import KVClient

    _say(f"{what}: kill -9 and start again")
    old = cluster.shards[0][0] if what == "master" else cluster.nodes["n0"]
    os.kill(old.proc.pid, signal.SIGKILL)
    old.proc.wait()
    t0 = time.monotonic()
    if what == "master":
        cluster.restart_master(0, timeout_s=cfg.start_timeout_s)
    else:
        cluster.start_node("n0", timeout_s=cfg.start_timeout_s)
    ready = time.monotonic()
    _say(f"{what}: READY after {ready - t0:.1f} s; polling {len(sample)} old keys")
    out = RestartResult(what, ready - t0, 0.0, 0, 0, 0)
    missing = set(sample)
    with KVClient(cluster.master, timeout_s=10, failover_wait_s=0.0) as client:
        last = time.monotonic()
        while missing:
            # 100 keys a call, about what an engine asks for one prompt: a 1000-key
            # Lookup holds the master's loop about 30 ms by itself.
            batch = sorted(missing)[:LOOKUP_BATCH]
            try:
                answers = client.lookup(batch)
            except Unavailable:
                out.unavailable += len(batch)
                time.sleep(0.05)
                continue
            for key, meta in zip(batch, answers):
                out.lookups += 1
                if isinstance(meta, NotFound):
                    out.not_found += 1
                elif isinstance(meta, Unavailable):
                    out.unavailable += 1
                elif not isinstance(meta, Exception):
                    missing.discard(key)
            if out.not_found and missing:
                break             # a lost key: the result says so; no use waiting on
            if time.monotonic() - last > 10:
                last = time.monotonic()
                _say(f"  {len(sample) - len(missing)}/{len(sample)} found")
            if missing and not missing.isdisjoint(batch):
                time.sleep(0.05)      # none of the batch found yet: the index is not whole
        out.whole_s = time.monotonic() - ready
        st = client.stat()[0]
        out.loop_stall_max_ms = st.loop_stall_max_ms
    out.inventory_items = cfg.objects
    _say(f"{what}: whole {out.whole_s:.1f} s after READY; NotFound {out.not_found}; "
         f"longest loop stall {out.loop_stall_max_ms:.1f} ms")
    return out


def render(r: ScaleResult) -> str:
    """The result as text tables."""
    lines = [f"{r.objects} objects of {r.value_bytes} B inserted in {r.insert_s:.1f} s "
             f"({r.objects / max(r.insert_s, 1e-9):.0f}/s, {r.insert_errors} errors)",
             "",
             f"{'process':<8} {'own RSS':>12} {'bytes/object':>13}",
             f"{'master':<8} {format_size(r.master_rss_bytes):>12} {r.master_bytes_per_object:>13.0f}",
             f"{'node':<8} {format_size(r.node_rss_bytes):>12} {r.node_bytes_per_object:>13.0f}"
             f"   (+ {format_size(r.node_shm_bytes)} of DRAM tier touched)"]
    if r.restarts:
        lines += ["", f"{'restart':<8} {'to READY s':>10} {'to whole s':>10} {'NotFound':>9} "
                      f"{'Unavail.':>9} {'max stall ms':>12}"]
        for x in r.restarts:
            lines.append(f"{x.what:<8} {x.ready_s:>10.1f} {x.whole_s:>10.1f} {x.not_found:>9} "
                         f"{x.unavailable:>9} {x.loop_stall_max_ms:>12.1f}")
    return "\n".join(lines)


def _count(text: str) -> int:
    """``"2M"``, ``"500k"`` or ``"1000"`` as a number (decimal multiples)."""
    mult = {"k": 10**3, "K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1:], 1)
    try:
        n = int(float(text[:-1] if mult > 1 else text) * mult)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a count (e.g. 2M, 500k)",
                                 param_hint="--objects") from None
    if n < 1:
        raise typer.BadParameter("at least 1", param_hint="--objects")
    return n


def scale_command(
    objects: str = typer.Option("1M", help="objects to insert: 500k, 2M, 10M, ..."),
    value_bytes: int = typer.Option(64, help="bytes per value"),
    batch: int = typer.Option(2048, help="keys per batch_put"),
    dram: str = typer.Option("", help="the node's DRAM tier (default: room for every object, "
                                      "or 64MiB with --ssd)"),
    ssd: str = typer.Option("", help="an SSD tier of this size: objects past DRAM are demoted "
                                     "(needed for --restart node)"),
    restart: str = typer.Option("master", help="what to kill -9 and start again, in order: "
                                               "master, node, or master,node ('' none)"),
    samples: int = typer.Option(1000, help="old keys polled after each restart"),
    json_out: bool = typer.Option(False, "--json", help="the result as JSON"),
    log_dir: str = typer.Option("", help="the processes' logs (default: a temp dir)"),
) -> None:
    """Insert OBJECTS small objects into one master and one node, measure memory per
    object, kill -9 and restart (``--restart master,node``), and check no old key is
    ever answered NotFound after READY."""
    n = _count(objects)
    restarts = tuple(x for x in restart.split(",") if x)
    if any(x not in ("master", "node") for x in restarts):
        raise typer.BadParameter("master and/or node", param_hint="--restart")
    if "node" in restarts and not ssd:
        raise typer.BadParameter("a node restart keeps only its SSD: give --ssd",
                                 param_hint="--restart")
    if batch < 1 or samples < 1 or value_bytes < 0:
        raise typer.BadParameter("--batch and --samples must be >= 1, --value-bytes >= 0")
    cfg = ScaleConfig(objects=n, value_bytes=value_bytes, batch=batch,
                      dram_bytes=parse_size(dram) if dram else 0,
                      ssd_bytes=parse_size(ssd) if ssd else 0, restart=restarts,
                      samples=samples, log_dir=log_dir or None)
    result = run_scale(cfg)
    print(json.dumps(asdict(result), indent=2) if json_out else render(result))
