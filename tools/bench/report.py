"""What a run's rows mean: issue 4's and issue 14's targets, checked, and the rows as rich tables.

The measurement table has a row per measurement and three ratio columns,
kvstore's ops/s over a baseline's at the same size and op: ``vs limit``
(shm / cold memcpy, tcp / socket reqresp, tcp-batch / socket stream; a
``+tls`` row has its plain path's limit), and ``vs redis`` and ``vs
mooncake`` for the tcp rows. A run with ``--tls`` adds the TLS table: each
``+tls`` row beside its plain twin, and their ratio (:func:`tls_vs_plain`).
The targets table gives each target of :data:`TARGETS` at the sizes the run
measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.tools.bench.harness import PLAIN_OF, DataPath, MiB, Op, System, verify_label


@dataclass(frozen=True, slots=True)
class Target:
    """One of issue 4's targets: ``row / baseline >= ratio`` (or ``ops/s >= ratio``)."""

    name: str
    row: tuple[System, DataPath, Op]
    baseline: tuple[System, DataPath, Op] | None     # None: an absolute ops/s floor
    ratio: float
    sizes_bytes: tuple[int, ...]


TARGETS = (
    Target("shm get >= 0.6x cold memcpy", (System.KVSTORE, DataPath.SHM, Op.GET),
           (System.MEMCPY, DataPath.COLD, Op.GET), 0.6, (MiB, 4 * MiB)),
    Target("tcp get >= 0.6x socket reqresp", (System.KVSTORE, DataPath.TCP, Op.GET),
           (System.SOCKET, DataPath.REQRESP, Op.GET), 0.6, (MiB,)),
    Target("tcp-batch get >= 0.5x socket stream",
           (System.KVSTORE, DataPath.TCP_BATCH, Op.GET),
           (System.SOCKET, DataPath.STREAM, Op.GET), 0.5, (64 * 1024,)),
    Target("tcp get >= 2x redis GET", (System.KVSTORE, DataPath.TCP, Op.GET),
           (System.REDIS, DataPath.TCP, Op.GET), 2.0, (MiB,)),
    Target("tcp get >= 1.5x mooncake get", (System.KVSTORE, DataPath.TCP, Op.GET),
           (System.MOONCAKE, DataPath.TCP, Op.GET), 1.5, (MiB,)),
    Target("batch_exists >= 200k keys/s", (System.KVSTORE, DataPath.TCP, Op.EXISTS), None,
           200_000, (0,)),
    # Issue 14 (one-round-trip puts).
    Target("tcp put >= 0.8x redis SET", (System.KVSTORE, DataPath.TCP, Op.PUT),
           (System.REDIS, DataPath.TCP, Op.PUT), 0.8, (MiB, 4 * MiB)),
    Target("tcp put >= 0.4x redis SET", (System.KVSTORE, DataPath.TCP, Op.PUT),
           (System.REDIS, DataPath.TCP, Op.PUT), 0.4, (64 * 1024,)),
    Target("tcp put >= 1.5x mooncake put", (System.KVSTORE, DataPath.TCP, Op.PUT),
           (System.MOONCAKE, DataPath.TCP, Op.PUT), 1.5, (64 * 1024, MiB, 4 * MiB)),
    Target("shm put >= 0.5x cold memcpy", (System.KVSTORE, DataPath.SHM, Op.PUT),
           (System.MEMCPY, DataPath.COLD, Op.GET), 0.5, (4 * MiB,)),
    Target("tcp-batch put >= 0.8x socket stream", (System.KVSTORE, DataPath.TCP_BATCH, Op.PUT),
           (System.SOCKET, DataPath.STREAM, Op.PUT), 0.8, (MiB,)),
    Target("tcp-batch put >= 0.5x socket stream", (System.KVSTORE, DataPath.TCP_BATCH, Op.PUT),
           (System.SOCKET, DataPath.STREAM, Op.PUT), 0.5, (64 * 1024,)),
    Target("tcp get >= 0.9x socket reqresp", (System.KVSTORE, DataPath.TCP, Op.GET),
           (System.SOCKET, DataPath.REQRESP, Op.GET), 0.9, (MiB,)),
    Target("async-64 get >= 0.8x socket stream", (System.KVSTORE, DataPath.ASYNC_64, Op.GET),
           (System.SOCKET, DataPath.STREAM, Op.GET), 0.8, (64 * 1024,)),
    Target("async-64 put >= 0.5x socket stream", (System.KVSTORE, DataPath.ASYNC_64, Op.PUT),
           (System.SOCKET, DataPath.STREAM, Op.PUT), 0.5, (64 * 1024,)),
    # Issue 16 (the RESP front, with --resp).
    Target("resp redis-benchmark get >= 0.5x redis-server",
           (System.KVSTORE_RESP, DataPath.REDIS_BENCHMARK, Op.GET),
           (System.REDIS, DataPath.REDIS_BENCHMARK, Op.GET), 0.5, (64 * 1024,)),
    Target("resp redis-py get >= 0.7x redis-server",
           (System.KVSTORE_RESP, DataPath.REDIS_PY, Op.GET),
           (System.REDIS, DataPath.REDIS_PY, Op.GET), 0.7, (MiB,)),
)

#: Ratio columns: kvstore (path) -> baseline (system, path); the memcpy row serves both ops.
_LIMIT_OF = {DataPath.SHM: (System.MEMCPY, DataPath.COLD),
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
    """Issue 4's targets at the sizes ``rows`` measured: (name, size_bytes, measured, passed).

    ``measured`` is the ratio to the baseline, or ops/s for an absolute
    target; both are None when a row is missing (a peer that was skipped).
    """
    measured = {r["size_bytes"] for r in rows}
    out = []
    for t in TARGETS:
        for size in t.sizes_bytes:
            if size not in measured:
                continue
            row = _find(rows, *t.row, size)
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

    # Fits 80 columns: no rules, two-line ratio headers, the limits named in the caption.
    table = Table(title="kvstore bench (GB/s = 10^9 B/s)", box=None, pad_edge=False,
                  caption="vs limit: shm / cold memcpy, tcp / socket reqresp,\n"
                          "tcp-batch / socket stream. kvstore-resp: vs redis-server.\n"
                          f"gets verify checksums: {verify_label(verify)}",
                  caption_justify="left")
    for name in ("system", "path", "op", "size"):
        table.add_column(name, no_wrap=True)
    for name in ("GB/s", "ops/s", "vs\nlimit", "vs\nredis", "vs\nmooncake"):
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
        table.add_row(r["system"], r["path"], r["op"],
                      _short_size(r["size_bytes"]) if r["size_bytes"] else "-",
                      f"{r['gbps']:.3f}" if r["size_bytes"] else "-", f"{r['ops_per_s']:,.0f}",
                      limit, redis, mooncake)
    targets = Table(title="targets (issues 4, 14 and 16)", box=None, pad_edge=False)
    for name in ("target", "size", "measured", "result"):
        targets.add_column(name)
    for name, size, value, ok in check_targets(rows):
        if value is None:
            targets.add_row(name, _short_size(size) if size else "-", "-", "not measured")
            continue
        targets.add_row(name, _short_size(size) if size else "-",
                        f"{value:,.0f} keys/s" if not size else f"{value:.2f}x",
                        "[green]pass[/]" if ok else "[red]miss[/]")
    pairs = tls_vs_plain(rows)
    return Group(table, *([_tls_table(pairs)] if pairs else []), targets)
