"""What a run's rows mean: the issues' targets, checked, and the rows as rich tables.

The measurement table has a row per measurement and three ratio columns,
kvstore's ops/s over a baseline's at the same size and op: ``vs limit``
(shm / cold memcpy, tcp / socket reqresp, tcp-batch / socket stream; a
``+tls`` row has its plain path's limit), and ``vs redis`` and ``vs
mooncake`` for the tcp rows. A run with ``--tls`` adds the TLS table: each
``+tls`` row beside its plain twin, and their ratio (:func:`tls_vs_plain`).
Four CPU columns follow (:func:`cpu_columns`): µs of CPU per operation of the
row's server side, master and client, and CPU seconds of all its processes
per GiB moved. The targets table gives each target of :data:`TARGETS` at
the sizes the run measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.tools.bench.harness import PLAIN_OF, DataPath, MiB, Op, System, verify_label


@dataclass(frozen=True, slots=True)
class Target:
    """One target: ``row / baseline >= ratio``, or ``ops/s >= ratio`` (no baseline), or,
    with ``cpu_of``, that process's µs of CPU per operation ``<= ratio``."""

    name: str
    row: tuple[System, DataPath, Op]
    baseline: tuple[System, DataPath, Op] | None     # None: an absolute floor (or ceiling)
    ratio: float
    sizes_bytes: tuple[int, ...]
    cpu_of: str = ""     # a process of the row: its cpu_us_per_op must stay <= ratio


TARGETS = (
    Target("shm get >= 0.8x cold memcpy", (System.KVSTORE, DataPath.SHM, Op.GET),
           (System.MEMCPY, DataPath.COLD, Op.GET), 0.8, (MiB,)),
    Target("shm get >= 0.6x cold memcpy", (System.KVSTORE, DataPath.SHM, Op.GET),
           (System.MEMCPY, DataPath.COLD, Op.GET), 0.6, (4 * MiB,)),
    Target("tcp get >= 0.6x socket reqresp", (System.KVSTORE, DataPath.TCP, Op.GET),
           (System.SOCKET, DataPath.REQRESP, Op.GET), 0.6, (MiB,)),
    Target("tcp-batch get >= 0.5x socket stream",
           (System.KVSTORE, DataPath.TCP_BATCH, Op.GET),
           (System.SOCKET, DataPath.STREAM, Op.GET), 0.5, (64 * 1024,)),
    Target("tcp get >= 2x redis GET", (System.KVSTORE, DataPath.TCP, Op.GET),
           (System.REDIS, DataPath.TCP, Op.GET), 2.0, (MiB,)),
    Target("tcp get >= 2x mooncake get", (System.KVSTORE, DataPath.TCP, Op.GET),
           (System.MOONCAKE, DataPath.TCP, Op.GET), 2.0, (MiB,)),
    Target("batch_exists >= 200k keys/s", (System.KVSTORE, DataPath.TCP, Op.EXISTS), None,
           200_000, (0,)),
    # Issue 14 (one-round-trip puts); the put and get ratios as issue 33 raised them.
    Target("tcp put >= 0.8x redis SET", (System.KVSTORE, DataPath.TCP, Op.PUT),
           (System.REDIS, DataPath.TCP, Op.PUT), 0.8, (MiB, 4 * MiB)),
    Target("tcp put >= 0.6x redis SET", (System.KVSTORE, DataPath.TCP, Op.PUT),
           (System.REDIS, DataPath.TCP, Op.PUT), 0.6, (64 * 1024,)),
    Target("tcp put >= 1.5x mooncake put", (System.KVSTORE, DataPath.TCP, Op.PUT),
           (System.MOONCAKE, DataPath.TCP, Op.PUT), 1.5, (64 * 1024, MiB, 4 * MiB)),
    Target("shm put >= 0.6x cold memcpy", (System.KVSTORE, DataPath.SHM, Op.PUT),
           (System.MEMCPY, DataPath.COLD, Op.GET), 0.6, (4 * MiB,)),
    Target("tcp-batch put >= 0.9x socket stream", (System.KVSTORE, DataPath.TCP_BATCH, Op.PUT),
           (System.SOCKET, DataPath.STREAM, Op.PUT), 0.9, (MiB,)),
    Target("tcp-batch put >= 0.7x socket stream", (System.KVSTORE, DataPath.TCP_BATCH, Op.PUT),
           (System.SOCKET, DataPath.STREAM, Op.PUT), 0.7, (64 * 1024,)),
    Target("tcp get >= 0.9x socket reqresp", (System.KVSTORE, DataPath.TCP, Op.GET),
           (System.SOCKET, DataPath.REQRESP, Op.GET), 0.9, (MiB,)),
    Target("async-64 get >= 0.8x socket stream", (System.KVSTORE, DataPath.ASYNC_64, Op.GET),
           (System.SOCKET, DataPath.STREAM, Op.GET), 0.8, (64 * 1024,)),
    Target("async-64 put >= 0.8x socket stream", (System.KVSTORE, DataPath.ASYNC_64, Op.PUT),
           (System.SOCKET, DataPath.STREAM, Op.PUT), 0.8, (64 * 1024,)),
    # Issue 16 (the RESP front, with --resp).
    Target("resp redis-benchmark get >= 0.5x redis-server",
           (System.KVSTORE_RESP, DataPath.REDIS_BENCHMARK, Op.GET),
           (System.REDIS, DataPath.REDIS_BENCHMARK, Op.GET), 0.5, (64 * 1024,)),
    Target("resp redis-py get >= 0.7x redis-server",
           (System.KVSTORE_RESP, DataPath.REDIS_PY, Op.GET),
           (System.REDIS, DataPath.REDIS_PY, Op.GET), 0.7, (MiB,)),
    # Issue 33 (a native data core): the node's CPU per operation.
    Target("tcp put: node CPU <= 20 us/op", (System.KVSTORE, DataPath.TCP, Op.PUT), None,
           20.0, (64 * 1024,), cpu_of="node"),
    Target("tcp get: node CPU <= 10 us/op", (System.KVSTORE, DataPath.TCP, Op.GET), None,
           10.0, (64 * 1024,), cpu_of="node"),
)
_TARGET_OF = {t.name: t for t in TARGETS}

#: Ratio columns: kvstore (path) -> baseline (system, path); the memcpy row serves both ops.
_LIMIT_OF = {DataPath.SHM: (System.MEMCPY, DataPath.COLD),
             DataPath.ASYNC_16_SHM: (System.MEMCPY, DataPath.COLD),
             DataPath.TCP: (System.SOCKET, DataPath.REQRESP),
             DataPath.TCP_BATCH: (System.SOCKET, DataPath.STREAM),
             DataPath.ASYNC_16: (System.SOCKET, DataPath.STREAM),
             DataPath.ASYNC_64: (System.SOCKET, DataPath.STREAM)}
_LIMIT_OF |= {tls: _LIMIT_OF[plain] for tls, plain in PLAIN_OF.items()}


def _short_size(size_bytes: int) -> str:
    """``64KiB``, ``4MiB``, ``1000B``: exact, for table cells."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if size_bytes >= scale and size_bytes % scale == 0:
            return f"{size_bytes // scale}{unit}"
    return f"{size_bytes}B"


def _find(rows: list[dict], system: System, path: DataPath, op: Op | str | None,
          size: int) -> dict | None:
    """The row dict of ``(system, path, op)`` at ``size`` (any op when ``op`` is None)."""
    for r in rows:
        if (r["system"], r["path"], r["size_bytes"]) == (system, path, size) and (
                op is None or r["op"] == op):
            return r
    return None


def cpu_columns(row: dict) -> tuple[float | None, float | None, float | None, float | None]:
    """A row's CPU as the table shows it: µs per operation of its server side (every
    process but ``master`` and ``client``: kvstore's node, redis-server, Mooncake's
    holder, the socket server, the RESP front with its node), of its ``master`` and of
    its ``client``, then CPU seconds of all of them per GiB moved. None: not metered."""
    per_op, per_gib = row.get("cpu_us_per_op") or {}, row.get("cpu_us_per_gib") or {}
    servers = [v for name, v in per_op.items() if name not in ("master", "client")]
    return (sum(servers) if servers else None, per_op.get("master"), per_op.get("client"),
            sum(per_gib.values()) / 1e6 if per_gib else None)


def _us(x: float | None) -> str:
    return "" if x is None else f"{x:.1f}" if x < 100 else f"{x:,.0f}"


def _ratio(row: dict | None, base: dict | None) -> float | None:
    if row is None or base is None or not base["ops_per_s"]:
        return None
    return row["ops_per_s"] / base["ops_per_s"]


def tls_vs_plain(rows: list[dict]) -> list[dict]:
    """Each kvstore ``+tls`` row beside its plain twin (same op and size), in row order.

    One dict per pair: ``path`` (the plain one: tcp, tcp-batch), ``op``,
    ``size_bytes``, ``plain_ops_per_s``, ``tls_ops_per_s`` and
    ``tls_over_plain`` (their ratio; below 1.0 by what TLS costs). A row
    whose twin is missing is left out.
    """
    out = []
    for r in rows:
        if r["system"] != System.KVSTORE or r["path"] not in PLAIN_OF:
            continue
        path = PLAIN_OF[DataPath(r["path"])]
        base = _find(rows, System.KVSTORE, path, r["op"], r["size_bytes"])
        x = _ratio(r, base)
        if x is not None:
            out.append({"path": path.value, "op": r["op"], "size_bytes": r["size_bytes"],
                        "plain_ops_per_s": base["ops_per_s"], "tls_ops_per_s": r["ops_per_s"],
                        "tls_over_plain": x})
    return out


def check_targets(rows: list[dict]) -> list[tuple[str, int, float | None, bool | None]]:
    """The targets at the sizes ``rows`` measured: (name, size_bytes, measured, passed).

    ``measured`` is the ratio to the baseline, ops/s for an absolute target,
    or µs of CPU per operation for a CPU one; both are None when a row is
    missing (a peer that was skipped) or was not metered.
    """
    measured = {r["size_bytes"] for r in rows}
    out = []
    for t in TARGETS:
        for size in t.sizes_bytes:
            if size not in measured:
                continue
            row = _find(rows, *t.row, size)
            if t.cpu_of:
                value = row.get("cpu_us_per_op", {}).get(t.cpu_of) if row else None
                out.append((t.name, size, value, None if value is None else value <= t.ratio))
                continue
            if t.baseline is None:
                value = row["ops_per_s"] if row else None
            else:
                value = _ratio(row, _find(rows, *t.baseline, size))
            out.append((t.name, size, value, None if value is None else value >= t.ratio))
    return out


def _tls_table(pairs: list[dict]):
    """The TLS table: a line per :func:`tls_vs_plain` pair."""
    from rich.table import Table

    table = Table(title="TLS: kvstore with and without it", box=None, pad_edge=False,
                  caption="+tls: mutual TLS, tokens checked (--auth).\n"
                          "tls/plain: ops/s with TLS / without.", caption_justify="left")
    for name in ("path", "op", "size"):
        table.add_column(name, no_wrap=True)
    for name in ("plain ops/s", "+tls ops/s", "tls/plain"):
        table.add_column(name, justify="right", no_wrap=True)
    for p in pairs:
        table.add_row(p["path"], p["op"], _short_size(p["size_bytes"]),
                      f"{p['plain_ops_per_s']:,.0f}", f"{p['tls_ops_per_s']:,.0f}",
                      f"{p['tls_over_plain']:.2f}x")
    return table


def render(rows: list[dict], verify: bool | None):
    """The results as rich tables: measurements, TLS beside plain (``--tls``), the targets."""
    from rich.console import Group
    from rich.table import Table

    # No rules, two-line headers, the limits and the CPU columns named in the caption:
    # 80 columns up to "vs mooncake", the CPU ones beyond.
    table = Table(title="kvstore bench (GB/s = 10^9 B/s)", box=None, pad_edge=False,
                  caption="vs limit: shm / cold memcpy, tcp / socket reqresp,\n"
                          "tcp-batch / socket stream. kvstore-resp: vs redis-server.\n"
                          f"gets verify checksums: {verify_label(verify)}\n"
                          "CPU over the timed rounds, µs per value (key for exists\n"
                          "and lookup):\n"
                          "server: node, redis-server, Mooncake's holder, socket\n"
                          "server (kvstore-resp: front + node); master; client: the\n"
                          "timed loop's process(es). s/GiB: all of them per GiB moved.",
                  caption_justify="left")
    for name in ("system", "path", "op", "size"):
        table.add_column(name, no_wrap=True)
    for name in ("GB/s", "ops/s", "vs\nlimit", "vs\nredis", "vs\nmooncake", "server\nµs/op",
                 "master\nµs/op", "client\nµs/op", "CPU\ns/GiB"):
        table.add_column(name, justify="right", no_wrap=True)
    for r in rows:
        limit = redis = mooncake = ""
        ours, path = r["system"] == System.KVSTORE, DataPath(r["path"])
        if ours and path in _LIMIT_OF:
            sys_, base_path = _LIMIT_OF[path]
            op = None if sys_ == System.MEMCPY else r["op"]
            x = _ratio(r, _find(rows, sys_, base_path, op, r["size_bytes"]))
            limit = f"{x:.2f}x" if x is not None else ""
        front = r["system"] == System.KVSTORE_RESP
        if (ours and path == DataPath.TCP) or front:
            x = _ratio(r, _find(rows, System.REDIS, path, r["op"], r["size_bytes"]))
            redis = f"{x:.2f}x" if x is not None else ""
        if ours and path == DataPath.TCP:
            x = _ratio(r, _find(rows, System.MOONCAKE, DataPath.TCP, r["op"], r["size_bytes"]))
            mooncake = f"{x:.2f}x" if x is not None else ""
        server, master, client, s_per_gib = cpu_columns(r)
        table.add_row(r["system"], r["path"], r["op"],
                      _short_size(r["size_bytes"]) if r["size_bytes"] else "-",
                      f"{r['gbps']:.3f}" if r["size_bytes"] else "-", f"{r['ops_per_s']:,.0f}",
                      limit, redis, mooncake, _us(server), _us(master), _us(client),
                      "" if s_per_gib is None else f"{s_per_gib:.2f}")
    targets = Table(title="targets (issues 4, 14, 16 and 33)", box=None, pad_edge=False)
    for name in ("target", "size", "measured", "result"):
        targets.add_column(name)
    for name, size, value, ok in check_targets(rows):
        if value is None:
            targets.add_row(name, _short_size(size) if size else "-", "-", "not measured")
            continue
        shown = (f"{value:.1f} µs" if _TARGET_OF[name].cpu_of else
                 f"{value:,.0f} keys/s" if not size else f"{value:.2f}x")
        targets.add_row(name, _short_size(size) if size else "-", shown,
                        "[green]pass[/]" if ok else "[red]miss[/]")
    pairs = tls_vs_plain(rows)
    return Group(table, *([_tls_table(pairs)] if pairs else []), targets)
