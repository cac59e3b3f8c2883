"""kvctl: look at and administer a running kvstore cluster.

    kvctl --master 127.0.0.1:50051 nodes
    KVSTORE_MASTER=127.0.0.1:50051 kvctl ls block/ --limit 20
    kvctl inspect KEY | evict KEY | rm KEY | stats
    kvctl top [--interval 2] [--conductor-metrics HOST:PORT]   (live; --once --json: one sample)
    kvctl events [--from SEQ|oldest|SHARD:EPOCH:SEQ] [--namespace PREFIX] [--json]
    KVSTORE_TOKEN=... kvctl --master HOST:PORT evict KEY     (a cluster started with --auth)

Every command takes ``--json``: machine-readable JSON on stdout, sizes as raw
bytes. Tables show sizes human-readable; on a terminal they fit its width,
piped or redirected each row is one line however wide. A failure prints one
line on stderr (``kvctl: error: NotFound: ...``) and exits non-zero: 2 for
NotFound, 1 for anything else; never a traceback.

kvctl only reads through SDK calls that leave access statistics alone
(``stat``, ``list``, ``inspect``): inspecting a key does not make it look hot
to eviction.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from typing import Annotated, Any, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kvstore.errors import KVStoreError, NotFound
from kvstore.keys import key_slot, validate_key
from kvstore.sizes import format_size
from kvstore.tools.cli import top as top_view
from kvstore.types import NodeStatus, ObjectMeta, TenantStatus, TierKind, TierStats

EXIT_ERROR = 1
EXIT_NOT_FOUND = 2

app = typer.Typer(name="kvctl", help="Inspect and administer a kvstore cluster.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON on stdout.")]

#: The tier a node's puts land in, which its flat sizes describe (NodeStatus.capacity_bytes).
_PUT_TIER = TierKind.DRAM.name


@dataclass(frozen=True, slots=True)
class Settings:
    master: str          # any master shard's address host:port
    timeout_s: float     # deadline of each RPC
    token_file: str = ""  # --token-file ("" : the environment's token, if any)


# ---- plumbing ----

class CommandFailed(Exception):
    """A usage problem detected by kvctl itself (exit 1)."""


@contextlib.contextmanager
def _client(ctx: typer.Context) -> Iterator[Any]:
    """A KVClient on the --master address; errors become one line on stderr and an exit code."""
    settings: Settings = ctx.obj
    kv = None
    try:
        if not settings.master:
            raise CommandFailed("no master address: pass --master HOST:PORT or set KVSTORE_MASTER")
        from kvstore.client import KVClient   # imported late: --help stays fast

        kv = KVClient(settings.master, prefer_shm=False, timeout_s=settings.timeout_s,
                      token=_token(settings))
        yield kv
    except KVStoreError as err:
        typer.echo(f"kvctl: error: {type(err).__name__}: {err}", err=True)
        raise typer.Exit(EXIT_NOT_FOUND if isinstance(err, NotFound) else EXIT_ERROR) from None
    except CommandFailed as err:
        typer.echo(f"kvctl: error: {err}", err=True)
        raise typer.Exit(EXIT_ERROR) from None
    finally:
        if kv is not None:
            kv.close()


def _token(settings: Settings) -> str | None:
    """The token of --token-file, else the environment's (None: anonymous).

    Raises:
        CommandFailed: the token file cannot be read.
    """
    from kvstore.auth import client_token

    try:
        return client_token(token_file=settings.token_file or None)
    except OSError as exc:
        raise CommandFailed(f"cannot read the token file: {exc}") from None


def _table(**kwargs) -> Table:
    """A table for 80-column terminals: no rules, underlined headers, no outer padding
    (piped, the console is wide enough that rows never wrap: see :func:`_console`)."""
    return Table(box=None, pad_edge=False, header_style="bold underline", **kwargs)


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False) + "\n")


#: Columns of a console that is not a terminal (a pipe, a file): wide enough that no
#: table row wraps (a key is up to 512 B), so a script reads one row per line.
_PIPE_COLUMNS = 1 << 16


def _console() -> Console:
    """stdout as rich sees it. A terminal keeps its own width. Anything else, where
    rich would wrap at 80 columns (or $COLUMNS), gets ``_PIPE_COLUMNS`` for the
    tables' rows and soft wrap for the rest: titles, captions and notes longer than
    their table stay one line (not centred)."""
    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console = Console(highlight=False, soft_wrap=True, width=_PIPE_COLUMNS)
    return console


def _fmt_ms(ms: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000)) if ms else "-"


def tier_json(t: TierStats) -> dict:
    return {"tier": t.kind.name, "capacity_bytes": t.capacity_bytes,
            "used_bytes": t.used_bytes, "free_bytes": t.free_bytes,
            "evictable_bytes": t.evictable_bytes, "num_objects": t.num_objects,
            "num_reading": t.num_reading, "num_pinned": t.num_pinned,
            "num_soft_pinned": t.num_soft_pinned, "num_protected": t.num_protected,
            "high_watermark": t.high_watermark, "low_watermark": t.low_watermark,
            "eviction_blocked": t.eviction_blocked}


def node_json(n: NodeStatus) -> dict:
    """A node as the master last saw it; the flat sizes are its DRAM tier (where puts
    land), ``tiers`` has every tier fastest first, ``counters`` the node's own."""
    a = n.address
    return {"node_id": a.node_id, "host": a.host, "data_port": a.data_port,
            "shm_name": a.shm_name, "host_id": a.host_id, "metrics_address": a.metrics_address,
            "alive": n.alive, "tier": _PUT_TIER,
            "capacity_bytes": n.capacity_bytes, "used_bytes": n.used_bytes,
            "free_bytes": max(0, n.capacity_bytes - n.used_bytes), "num_objects": n.num_objects,
            "last_heartbeat_ms": n.last_heartbeat_ms,
            "tiers": [tier_json(t) for t in n.tiers], "counters": dict(sorted(n.counters.items()))}


def _tiers_table(title: str, rows: list[tuple[str, TierStats]]) -> Table:
    """One row per (node, tier): used / free / evictable; why eviction is blocked
    goes under the table (a sentence does not fit a column)."""
    blocked = [f"{node_id} {t.kind.name}: eviction blocked: {t.eviction_blocked}"
               for node_id, t in rows if t.eviction_blocked]
    table = _table(title=title, caption="\n".join(blocked) or None, caption_justify="left")
    for col in ("node", "tier", "used", "free", "evictable", "capacity", "objects", "pinned",
                "protected"):
        table.add_column(col, justify="left" if col in ("node", "tier") else "right",
                         no_wrap=True)
    for node_id, t in rows:
        table.add_row(node_id, t.kind.name, format_size(t.used_bytes), format_size(t.free_bytes),
                      format_size(t.evictable_bytes), format_size(t.capacity_bytes),
                      str(t.num_objects), str(t.num_pinned), str(t.num_protected))
    return table


def meta_json(m: ObjectMeta) -> dict:
    return {"key": m.key, "size_bytes": m.size_bytes, "checksum": f"{m.checksum:016x}",
            "object_id": m.object_id, "created_ms": m.created_ms,
            "access_count": m.access_count, "last_access_ms": m.last_access_ms,
            "replicas": [{"node_id": r.node.node_id, "host": r.node.host,
                          "data_port": r.node.data_port, "tier": r.tier.name,
                          # the master only ever returns complete replicas
                          "state": "COMPLETE"} for r in m.replicas]}


def _nodes(kv) -> list[NodeStatus]:
    """Every node any shard knows, once each (by node id)."""
    return top_view.latest_nodes(kv.stat())


# ---- commands ----

@app.callback()
def _options(
    ctx: typer.Context,
    master: Annotated[Optional[str], typer.Option(
        "--master", envvar="KVSTORE_MASTER", show_envvar=True,
        help="Address HOST:PORT of any master shard.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0.1,
                                           help="Seconds to wait for each call.")] = 5.0,
    token_file: Annotated[Optional[str], typer.Option(
        "--token-file", help="A file holding the token for a cluster started with --auth "
                             "(default: $KVSTORE_TOKEN, $KVSTORE_TOKEN_FILE).")] = None,
) -> None:
    ctx.obj = Settings(master or "", timeout, token_file or "")


@app.command()
def nodes(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Store nodes: liveness, memory used, objects; per tier used / free / evictable."""
    with _client(ctx) as kv:
        found = _nodes(kv)
    if as_json:
        _emit_json({"nodes": [node_json(n) for n in found]})
        return
    now = time.time() * 1000
    table = _table(title=f"{len(found)} store node(s)")
    for col in ("node", "address", "alive", "tier", "used", "capacity", "used %", "objects",
                "heartbeat"):
        right = col in ("used", "capacity", "used %", "objects", "heartbeat")
        table.add_column(col, justify="right" if right else "left",
                         overflow="fold" if col in ("node", "address") else "ellipsis")
    for n in found:
        pct = 100.0 * n.used_bytes / n.capacity_bytes if n.capacity_bytes else 0.0
        age = f"{(now - n.last_heartbeat_ms) / 1000:.1f} s ago" if n.last_heartbeat_ms else "-"
        table.add_row(n.address.node_id, f"{n.address.host}:{n.address.data_port}",
                      "yes" if n.alive else "[red]DEAD[/red]", _PUT_TIER,
                      format_size(n.used_bytes), format_size(n.capacity_bytes), f"{pct:.1f}",
                      str(n.num_objects), age)
    console = _console()
    console.print(table)
    rows = [(n.address.node_id, t) for n in found for t in n.tiers]
    if rows:
        console.print(_tiers_table("tiers", rows))


@app.command("ls")
def list_objects(
    ctx: typer.Context,
    prefix: Annotated[str, typer.Argument(help="Only keys starting with this.")] = "",
    limit: Annotated[int, typer.Option("--limit", "-n", min=1,
                                       help="Show at most this many objects.")] = 100,
    as_json: JsonOpt = False,
) -> None:
    """Objects in key order, optionally under a key prefix."""
    with _client(ctx) as kv:
        objects: list[ObjectMeta] = []
        truncated = False
        for meta in kv.list(prefix, page_size=min(limit + 1, 1000)):
            if len(objects) == limit:
                truncated = True
                break
            objects.append(meta)
    if as_json:
        _emit_json({"prefix": prefix, "objects": [meta_json(m) for m in objects],
                    "count": len(objects), "truncated": truncated})
        return
    more = " (more not shown; raise --limit)" if truncated else ""
    table = _table(title=f"{len(objects)} object(s){more}")
    table.add_column("key", overflow="fold")
    table.add_column("size", justify="right")
    table.add_column("replicas")
    table.add_column("lookups", justify="right")     # at the master: see inspect
    table.add_column("created")
    for m in objects:
        table.add_row(m.key, format_size(m.size_bytes),
                      ",".join(f"{r.node.node_id}:{r.tier.name}" for r in m.replicas),
                      str(m.access_count), _fmt_ms(m.created_ms))
    _console().print(table)


@app.command()
def inspect(ctx: typer.Context, key: Annotated[str, typer.Argument(help="The object's key.")],
            as_json: JsonOpt = False) -> None:
    """One object's metadata: size, checksum, replicas, access statistics.

    The lookups are the master's: a client reading through its cached
    metadata goes straight to a node and counts none; eviction goes by the
    nodes' own access times, not these."""
    with _client(ctx) as kv:
        meta = kv.inspect(key)
        shard = kv.shard_map.shard_for_key(key)
    slot = key_slot(key)
    if as_json:
        _emit_json({**meta_json(meta), "slot": slot, "shard_id": shard.shard_id,
                    "shard_address": str(shard)})
        return
    table = _table(title=f"object {key}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("size", f"{format_size(meta.size_bytes)} ({meta.size_bytes} B)")
    table.add_row("checksum", f"xxh3-64 {meta.checksum:016x}")
    table.add_row("object id", str(meta.object_id))
    table.add_row("slot / shard", f"{slot} / {shard.shard_id} ({shard})")
    table.add_row("created", _fmt_ms(meta.created_ms))
    table.add_row("master lookups", f"{meta.access_count} (reads through a client's "
                                    "cached metadata count none)")
    table.add_row("last lookup", _fmt_ms(meta.last_access_ms))
    for r in meta.replicas:
        table.add_row("replica", f"{r.node.node_id} {r.node.host}:{r.node.data_port} "
                                 f"{r.tier.name}")
    _console().print(table)


def _remove(ctx: typer.Context, key: str, reason: str, as_json: bool) -> None:
    with _client(ctx) as kv:
        validate_key(key)
        kv.remove(key, reason=reason)
    if as_json:
        _emit_json({"key": key, "removed": True, "reason": reason})
    else:
        typer.echo(f"{'evicted' if reason == 'evict' else 'removed'} {key}")


@app.command()
def evict(ctx: typer.Context, key: Annotated[str, typer.Argument(help="The object's key.")],
          as_json: JsonOpt = False) -> None:
    """Evict an object (freed on its nodes once no reader holds it; counted as an eviction)."""
    _remove(ctx, key, "evict", as_json)


@app.command("rm")
def remove(ctx: typer.Context, key: Annotated[str, typer.Argument(help="The object's key.")],
           as_json: JsonOpt = False) -> None:
    """Remove an object (freed on its nodes once no reader holds it)."""
    _remove(ctx, key, "remove", as_json)


@app.command()
def stats(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Per-shard object counts, bytes, counters, node totals and per-tier use.

    Every shard knows every node: a shard's row sums the nodes as that shard
    sees them, and the totals, the tier table and the node counters count
    each live node once (its latest view, as ``kvctl nodes`` shows it).
    """
    with _client(ctx) as kv:
        shards = kv.stat()
        shard_map = kv.shard_map
    live = [n for n in top_view.latest_nodes(shards) if n.alive]
    addresses = {r.shard_id: str(r) for r in shard_map.ranges}
    out = []
    for st in shards:
        alive = [n for n in st.nodes if n.alive]
        tiers: dict[str, dict[str, int]] = {}
        node_counters: dict[str, int] = {}
        for n in alive:
            for t in n.tiers:
                agg = tiers.setdefault(t.kind.name, dict.fromkeys(
                    ("capacity_bytes", "used_bytes", "free_bytes", "evictable_bytes",
                     "num_objects"), 0))
                for k in agg:
                    agg[k] += getattr(t, k)
            for k, v in n.counters.items():
                node_counters[k] = node_counters.get(k, 0) + v
        out.append({
            "shard_id": st.shard_id, "address": addresses.get(st.shard_id, ""),
            "shard_map_version": st.shard_map_version, "num_objects": st.num_objects,
            "unavailable_objects": st.unavailable_objects,
            "total_bytes": st.total_bytes,
            "index_complete": st.warmup_left_ms == 0, "warmup_left_ms": st.warmup_left_ms,
            "loop_stall_max_ms": round(st.loop_stall_max_ms, 1), "loop_stalls": st.loop_stalls,
            "warmup_waiting": [{"node_id": w.node_id, "state": w.state,
                                "items_applied": w.items_applied} for w in st.warmup_nodes],
            "nodes": len(st.nodes), "nodes_alive": len(alive),
            "capacity_bytes": sum(n.capacity_bytes for n in alive),
            "used_bytes": sum(n.used_bytes for n in alive),
            "counters": dict(sorted(st.counters.items())),
            "tiers": tiers,
            "node_counters": dict(sorted(node_counters.items())),
        })
    if as_json:
        totals = {k: sum(s[k] for s in out) for k in ("num_objects", "total_bytes",
                                                       "unavailable_objects")}
        totals.update(capacity_bytes=sum(n.capacity_bytes for n in live),
                      used_bytes=sum(n.used_bytes for n in live), nodes_alive=len(live))
        _emit_json({"shards": out, "totals": totals})
        return
    console = _console()
    table = _table(title="shards")
    for col in ("shard", "address", "objects", "bytes", "nodes alive", "used", "capacity"):
        table.add_column(col, justify="left" if col in ("shard", "address") else "right",
                         overflow="fold" if col == "address" else "ellipsis")
    for s in out:
        table.add_row(str(s["shard_id"]), s["address"], str(s["num_objects"]),
                      format_size(s["total_bytes"]), f"{s['nodes_alive']}/{s['nodes']}", format_size(s["used_bytes"]),
                      format_size(s["capacity_bytes"]))
    console.print(table)
    for s in out:
        if s["unavailable_objects"]:
            console.print(f"shard {s['shard_id']}: {s['unavailable_objects']} more object(s) "
                          f"on dead nodes only, not readable (not counted above; kept until "
                          f"--node-forget-ms in case a node comes back)")
        if not s["index_complete"]:
            waiting = ", ".join(
                f"{w['node_id']} ({w['items_applied']} inventory items applied)"
                if w["state"] == "syncing" else f"{w['node_id']} (not registered)"
                for w in s["warmup_waiting"]) or "nodes to register (the shard has no roster)"
            console.print(f"[yellow]shard {s['shard_id']}: index incomplete (its master just "
                          f"started; client calls answer Unavailable): waiting for "
                          f"{escape(waiting)}; at most {s['warmup_left_ms']} ms more for "
                          f"nodes not registered[/]")
    counters = _table(title="counters")
    counters.add_column("counter")
    counters.add_column("value", justify="right")
    names = sorted({k for s in out for k in s["counters"]})
    for name in names:
        counters.add_row(name, str(sum(s["counters"].get(name, 0) for s in out)))
    console.print(counters)
    tiers = _table(title="tiers (live nodes)")
    for col in ("tier", "used", "free", "evictable", "capacity", "objects"):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    names = sorted({t.kind.name for n in live for t in n.tiers}, key=lambda n: TierKind[n])
    for name in names:
        agg = {k: sum(getattr(t, k) for n in live for t in n.tiers if t.kind.name == name)
               for k in ("used_bytes", "free_bytes", "evictable_bytes", "capacity_bytes",
                         "num_objects")}
        tiers.add_row(name, format_size(agg["used_bytes"]), format_size(agg["free_bytes"]),
                      format_size(agg["evictable_bytes"]), format_size(agg["capacity_bytes"]),
                      str(agg["num_objects"]))
    if names:
        console.print(tiers)
    node_counters = _table(title="node counters (evictions, demotions, promotions, prefetch)")
    node_counters.add_column("counter")
    node_counters.add_column("value", justify="right")
    for name in sorted({k for n in live for k in n.counters}):
        node_counters.add_row(name, str(sum(n.counters.get(name, 0) for n in live)))
    if node_counters.row_count:
        console.print(node_counters)


def tenant_json(t: TenantStatus) -> dict:
    return {"tenant": t.tenant, "objects": t.objects, "bytes": t.bytes,
            "max_objects": t.max_objects, "max_bytes": t.max_bytes,
            "counters": dict(sorted(t.counters.items()))}


@app.command()
def tenants(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Each tenant's objects, bytes, hard limits and counters (puts, lookup hits and
    misses, evictions, puts refused over a limit), over every shard.

    An admin token sees every tenant; a client or metrics token its own tenants only
    (docs/tenants.md).
    """
    with _client(ctx) as kv:
        rows = [tenant_json(t) for t in kv.tenant_stats()]
    if as_json:
        _emit_json({"tenants": rows})
        return
    table = _table(title="tenants")
    cols = ("tenant", "objects", "bytes", "max objects", "max bytes", "puts", "hits", "misses",
            "evictions", "refusals")
    for col in cols:
        table.add_column(col, justify="left" if col == "tenant" else "right")
    for r in rows:
        c = r["counters"]
        table.add_row(escape(r["tenant"]), str(r["objects"]), format_size(r["bytes"]),
                      str(r["max_objects"] or "-"),
                      format_size(r["max_bytes"]) if r["max_bytes"] else "-",
                      *(str(c.get(k, 0)) for k in ("puts", "hits", "misses", "evictions",
                                                   "refusals")))
    _console().print(table)


@app.command()
def top(
    ctx: typer.Context,
    interval: Annotated[float, typer.Option(
        "--interval", min=0.1, help="Seconds between refreshes (with --once: between the "
                                    "two samples).")] = 2.0,
    once: Annotated[bool, typer.Option(
        "--once", help="Take two samples --interval apart, show them once and exit.")] = False,
    conductors: Annotated[Optional[list[str]], typer.Option(
        "--conductor-metrics", metavar="HOST:PORT",
        help="A conductor's metrics port (repeatable): TTFT, rejections.")] = None,
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON object on stdout (implies --once).")] = False,
) -> None:
    """Live view: tier use and evictions/s per node; objects, lookups/s and hit rate per
    shard; requests/s and p99 per op of every process with a metrics port."""
    from kvstore.tls import TlsFiles

    with _client(ctx) as kv:
        settings: Settings = ctx.obj
        scraper = top_view.Scraper(_token(settings), TlsFiles.client_from_env(),
                                   settings.timeout_s)
        watched = tuple(conductors or ())
        before = top_view.take_sample(kv, scraper, watched)
        if once or as_json:
            time.sleep(interval)
            summary = top_view.summarize(before, top_view.take_sample(kv, scraper, watched))
            if as_json:
                _emit_json(summary)
            else:
                _console().print(top_view.render(summary, _table))
            return
        _live(kv, scraper, watched, interval, before)


def _live(kv, scraper, watched: tuple[str, ...], interval: float, before) -> None:
    """Redraw every ``interval`` s until Ctrl-C; a failed Stat shows and is retried."""
    from rich.console import Group
    from rich.live import Live

    console = _console()
    if not console.is_terminal:
        # A pipe, a file, ``watch``'s log: no redrawing; one titled table per
        # interval, appended, until Ctrl-C.
        try:
            for summary, err in _windows(kv, scraper, watched, interval, before):
                if err is not None:
                    console.print(f"{time.strftime('%H:%M:%S')} {type(err).__name__}: {err}")
                    continue
                console.print(top_view.render(summary, _table, f"kvctl top  "
                                              f"{time.strftime('%H:%M:%S')}  window "
                                              f"{summary['interval_s']:.1f} s"))
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        return
    shown = None
    with Live(f"sampling every {interval:g} s ...", console=console,
              auto_refresh=False) as live:
        try:
            for summary, err in _windows(kv, scraper, watched, interval, before):
                if err is not None:
                    note = f"[red]{time.strftime('%H:%M:%S')} {type(err).__name__}: {err}[/red]"
                    live.update(Group(*(x for x in (shown, note) if x is not None)),
                                refresh=True)
                    continue
                title = (f"[bold]kvctl top[/bold]  {time.strftime('%H:%M:%S')}  window "
                         f"{summary['interval_s']:.1f} s  (Ctrl-C quits)")
                shown = top_view.render(summary, _table, title)
                live.update(shown, refresh=True)
        except KeyboardInterrupt:
            pass


def _windows(kv, scraper, watched: tuple[str, ...], interval: float, before):
    """Every ``interval`` s, the summary of the window since the last good sample and
    None, or (None, the error) when a sample failed (it is taken again next time)."""
    due = time.monotonic()
    while True:
        due += interval
        time.sleep(max(0.0, due - time.monotonic()))
        try:
            after = top_view.take_sample(kv, scraper, watched)
        except KVStoreError as err:
            yield None, err
            continue
        yield top_view.summarize(before, after), None
        before = after


from kvstore.tools.cli.events import events as _events   # noqa: E402 (its own module)

app.command("events")(_events)


def main() -> None:
    """Console-script entry point (``kvctl``)."""
    app(prog_name="kvctl")


if __name__ == "__main__":
    main()
