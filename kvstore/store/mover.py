"""The store node's mover: copies objects between tiers off the node's lock.

One thread per node with slower tiers (kswapd for the object table). Each
round::

    flush_tiers()        queued SSD deletes, one lmdb transaction
    plan_reclaim()       under the lock: victims per tier, slowest first;
                         drops that need no copy happen here, demotions are planned
    run_moves()          off the lock: copy down; one durable SSD commit per batch
    finish_moves()       under the lock: install the copies, drop the faster ones,
                         queue DEMOTED / EVICTED events, wake waiting writers
    plan_prefetch() ...  the same for queued prefetch promotions (copy up to DRAM)
    sweep_protection()   lookahead deadlines that passed (prefetch wasted)

It runs when woken (a tier passed its high watermark, a writer waits for
room, a prefetch was queued) and every ``interval_s`` otherwise.

The mover drives the node's tier movement (:class:`MoverWork`, which
:class:`~kvstore.store.tiering.Tiering` is); it knows nothing else of the node.

Thread safety: the mover owns no table state; the :class:`MoverWork`
methods it calls take the node's lock themselves, and it touches extents
only through :class:`~kvstore.store.objects.Move`s, whose objects hold a
reference.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Protocol, Sequence

from kvstore.keys import value_checksum
from kvstore.store.objects import Move
from kvstore.store.tiers.base import Tier, TierIOError, copy_between

log = logging.getLogger(__name__)


class MoverWork(Protocol):
    """What one mover round calls (see the module docstring); each method takes the
    node's lock itself, the mover calls it holding none."""

    #: The node's tier chain, fastest first (a move's levels index it).
    tiers: Sequence[Tier]

    def flush_tiers(self) -> None: ...

    def plan_reclaim(self) -> list[Move]: ...

    def plan_prefetch(self) -> list[Move]: ...

    def finish_moves(self, moves: list[Move]) -> None: ...

    def sweep_protection(self) -> None: ...


def run_moves(tiers: Sequence[Tier], moves: list[Move]) -> None:
    """Copy each move's bytes off the node's lock and set ``ok`` / ``error``.

    Demotions into one tier share one ``write_many`` (one SSD commit);
    promotions are verified against the object's checksum once in DRAM.

    Args:
        tiers: the node's tier chain, indexed by the moves' levels.
        moves: planned moves; each object holds a reference while it runs.
    """
    by_dst: dict[int, list[Move]] = defaultdict(list)
    for move in moves:
        by_dst[move.dst_level].append(move)
    for dst_level, group in by_dst.items():
        dst = tiers[dst_level]
        if dst.view(group[0].dst_extent) is not None:     # into DRAM: promotions
            for move in group:
                src = tiers[move.src_level]
                try:
                    copy_between(src, move.obj.copy(move.src_level), dst, move.dst_extent)
                    actual = value_checksum(dst.view(move.dst_extent))
                    move.ok = actual == move.obj.checksum
                    if not move.ok:
                        move.error = f"checksum {actual:#x} != {move.obj.checksum:#x}"
                except TierIOError as exc:
                    move.error = str(exc)
            continue
        items = []
        try:
            for move in group:
                src = tiers[move.src_level]
                extent = move.obj.copy(move.src_level)
                view = src.view(extent)
                if view is None:                          # e.g. GPU -> SSD: stage in host memory
                    view = memoryview(bytearray(extent.size_bytes))
                    src.read_into(extent, view)
                items.append((move.dst_extent, view))
            dst.write_many(items)
        except TierIOError as exc:
            for move in group:
                move.error = str(exc)
            continue
        for move in group:
            move.ok = True


class TierMover:
    """The background thread that moves a node's objects between its tiers.

    Args:
        work: the node's tier movement, which plans and finishes the moves.
        interval_s: how often it looks for work when nobody wakes it.

    Thread safety: :meth:`wake` and :attr:`running` from any thread;
    :meth:`run_once` and :meth:`settle` from one thread at a time (the
    mover's own, or a test's while the thread is not started).
    """

    def __init__(self, work: MoverWork, interval_s: float = 0.05):
        self.work = work
        self.interval_s = interval_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tier-mover", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def wake(self) -> None:
        self._wake.set()

    def run_once(self) -> bool:
        """One round (see the module docstring); True when it moved something."""
        work = self.work
        work.flush_tiers()
        moves = work.plan_reclaim()
        if moves:
            try:
                run_moves(work.tiers, moves)
            finally:            # even after a bug: give back references and extents
                work.finish_moves(moves)
        promotions = work.plan_prefetch()
        if promotions:
            try:
                run_moves(work.tiers, promotions)
            finally:
                work.finish_moves(promotions)
        work.sweep_protection()
        return bool(moves or promotions)

    def settle(self, max_rounds: int = 1000) -> None:
        """Run rounds in the calling thread until there is nothing left to move (tests)."""
        for _ in range(max_rounds):
            if not self.run_once():
                return

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            try:
                while not self._stop.is_set() and self.run_once():
                    pass
            except Exception:   # a bug: keep the node serving, say so loudly
                log.exception("tier mover round failed")
