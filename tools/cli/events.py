"""``kvctl events``: print the store-wide event log, replaying then following it.

    kvctl events                          from now on, every shard, until Ctrl-C
    kvctl events --from oldest --json     everything the shards still hold, then live
    kvctl events --from 0:1733:120        shard 0, epoch 1733, from seq 120 (a resume)
    kvctl events --namespace lmcache: --count 10

Each shard numbers its events 1, 2, 3, ... (``seq``) within an ``epoch`` (a
new one after a master restart or failover); a line shows both, and a resume
names them (``--from SHARD:EPOCH:SEQ``, the last seen seq + 1), so after a
disconnect nothing is missed and nothing repeats. A broken stream is opened
again by itself. When a shard no longer holds what was asked (the ring went
past it, or a new epoch began) kvctl says so on stderr and exits 3, or with
``--resume-after-loss`` prints a ``lost`` line and goes on from what it holds.
Needs a ``metrics`` or ``admin`` token on a cluster started with ``--auth``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Annotated, Optional

import typer

from kvstore.errors import EventsLost, KVStoreError

EXIT_ERROR = 1          # as kvctl's other commands
EXIT_EVENTS_LOST = 3


def parse_from(values: list[str]) -> tuple[dict, bool, bool]:
    """``--from`` values -> (per-shard cursors, a seq for every shard or None, oldest).

    Raises:
        typer.BadParameter: not now, oldest, SEQ, SHARD:SEQ or SHARD:EPOCH:SEQ, or a
            number past what the wire carries (2**64).
    """
    from kvstore.client.events import Cursor, check_start
    from kvstore.errors import InvalidArgument

    cursors: dict[int, Cursor] = {}
    every: int | None = None
    oldest = False
    for v in values:
        parts = v.split(":")
        try:
            if v in ("now", "oldest"):
                oldest = oldest or v == "oldest"
            elif len(parts) == 1:
                every = int(v)
            elif len(parts) == 2:
                cursors[int(parts[0])] = Cursor(0, int(parts[1]))
            elif len(parts) == 3:
                cursors[int(parts[0])] = Cursor(int(parts[1]), int(parts[2]))
            else:
                raise ValueError(v)
        except ValueError:
            raise typer.BadParameter(f"{v!r}: give now, oldest, SEQ, SHARD:SEQ or "
                                     f"SHARD:EPOCH:SEQ") from None
        if any(c.next_seq < 1 for c in cursors.values()) or (every is not None and every < 1):
            raise typer.BadParameter(f"{v!r}: sequences start at 1")
        try:
            check_start(cursors, every or 0, ())
        except InvalidArgument as err:
            raise typer.BadParameter(f"{v!r}: {err}") from None
    return cursors, every, oldest


def _line(ev, as_json: bool) -> str:
    from kvstore.client.events import Lost

    if isinstance(ev, Lost):
        if as_json:
            return json.dumps({"shard": ev.shard_id, "lost": ev.reason})
        return f"shard {ev.shard_id} LOST: {ev.reason}"
    if as_json:
        return json.dumps({"shard": ev.shard_id, "epoch": ev.epoch, "seq": ev.seq,
                           "kind": ev.kind, "key": ev.key, "object_id": ev.object_id,
                           "size_bytes": ev.size_bytes, "time_ms": ev.time_ms,
                           "node_id": ev.node_id})
    when = time.strftime("%H:%M:%S", time.localtime(ev.time_ms / 1000))
    node = f" node={ev.node_id}" if ev.node_id else ""
    return (f"{when} shard {ev.shard_id} epoch {ev.epoch} seq {ev.seq} {ev.kind:<7} "
            f"{ev.key} {ev.size_bytes} B{node}")


def events(
    ctx: typer.Context,
    start: Annotated[Optional[list[str]], typer.Option(
        "--from", help="Where to start: now (default), oldest, SEQ (every shard), SHARD:SEQ "
                       "or SHARD:EPOCH:SEQ (a resume: the last seq seen + 1). Repeatable.")] = None,
    namespace: Annotated[Optional[list[str]], typer.Option(
        "--namespace", help="Only keys starting with this prefix. Repeatable.")] = None,
    count: Annotated[int, typer.Option("--count", min=0,
                                       help="Exit after this many events (0: never).")] = 0,
    idle: Annotated[float, typer.Option(
        "--idle", min=0, help="Exit after this many seconds without an event (0: never).")] = 0,
    resume_after_loss: Annotated[bool, typer.Option(
        "--resume-after-loss", help="When events were lost, print a 'lost' line and go on "
                                    "(else exit 3).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object a line.")] = False,
) -> None:
    """Print the store's events (key STORED / EVICTED / REMOVED), replaying then following."""
    from kvstore.client.events import EventWatcher
    from kvstore.rpc import ClientCredentials

    settings = ctx.obj            # kvctl's Settings
    cursors, every, oldest = parse_from(start or [])
    if not settings.master:
        typer.echo("kvctl: error: no master address: pass --master HOST:PORT or set "
                   "KVSTORE_MASTER", err=True)
        raise typer.Exit(EXIT_ERROR)
    try:
        creds = ClientCredentials.resolve(token_file=settings.token_file or None)
    except OSError as err:
        typer.echo(f"kvctl: error: cannot read the token file: {err}", err=True)
        raise typer.Exit(EXIT_ERROR) from None
    watcher = None
    try:
        watcher = EventWatcher(settings.master, creds=creds, start=cursors,
                               from_seq=every or 0, oldest=oldest,
                               key_prefixes=namespace or (), resume_after_loss=resume_after_loss,
                               timeout_s=settings.timeout_s)
        n = 0
        for ev in watcher.events(timeout_s=idle or None):
            sys.stdout.write(_line(ev, as_json) + "\n")
            sys.stdout.flush()
            n += 1
            if count and n >= count:
                break
    except EventsLost as err:
        typer.echo(f"kvctl: error: EventsLost: {err}", err=True)
        raise typer.Exit(EXIT_EVENTS_LOST) from None
    except KVStoreError as err:
        typer.echo(f"kvctl: error: {type(err).__name__}: {err}", err=True)
        raise typer.Exit(EXIT_ERROR) from None
    except BrokenPipeError:
        # The reader went away (`kvctl events | head -1`): done, as any filter.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except KeyboardInterrupt:
        pass
    finally:
        if watcher is not None:
            watcher.close()
