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

Thread safety: the mover owns no table state; it calls the node's public
mover-side methods, which take the node's lock, and touches extents only
through :class:`~kvstore.store.objects.Move`s, whose objects hold a reference.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import TYPE_CHECKING

from kvstore.keys import value_checksum
from kvstore.store.objects import Move
from kvstore.store.tiers.base import TierIOError, copy_between

if TYPE_CHECKING:
    from kvstore.store.node import StoreNode

log = logging.getLogger(__name__)


def run_moves(node: "StoreNode", moves: list[Move]) -> None:
    """Copy each move's bytes off the node's lock and set ``ok`` / ``error``.

    Demotions into one tier share one ``write_many`` (one SSD commit);
    promotions are verified against the object's checksum once in DRAM.
    """
    by_dst: dict[int, list[Move]] = defaultdict(list)
    for move in moves:
        by_dst[move.dst_level].append(move)
    for dst_level, group in by_dst.items():
        dst = node.levels[dst_level].tier
        if dst.view(group[0].dst_extent) is not None:     # into DRAM: promotions
            for move in group:
                src = node.levels[move.src_level].tier
                try:
                    copy_between(src, move.obj.copies[move.src_level], dst, move.dst_extent)
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
                src = node.levels[move.src_level].tier
                extent = move.obj.copies[move.src_level]
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
        node: the node whose tiers it serves.
        interval_s: how often it looks for work when nobody wakes it.
    """

    def __init__(self, node: "StoreNode", interval_s: float = 0.05):
        self.node = node
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
        node = self.node
        node.flush_tiers()
        moves = node.plan_reclaim()
        if moves:
            try:
                run_moves(node, moves)
            finally:            # even after a bug: give back references and extents
                node.finish_moves(moves)
        promotions = node.plan_prefetch()
        if promotions:
            try:
                run_moves(node, promotions)
            finally:
                node.finish_moves(promotions)
        node.sweep_protection()
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
