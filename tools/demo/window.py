"""Which part of a trace the demo measures: a window whose prefix reuse is the trace's.

The first requests of a trace have had no time to share prefixes: on the
bundled conversation trace an infinite cache hits 6 % of the first 200
requests' blocks, against 37 % of the whole trace's. Measuring there shows
a cache that barely matters. The demo therefore measures a *window* of
``num_requests`` requests and, before it, replays ``warmup`` earlier
requests (not counted) that fill the store::

    trace   ... [ s - warmup ............ s ) [ s ............ s + num_requests ) ...
                  warm-up: fills the store      window: measured, both modes

The window is chosen from the trace alone: among starts ``s`` on a grid of
``step`` requests, the one whose block hit rate -- with an infinite cache
that holds exactly what the warm-up and the window's earlier requests put
there -- is closest to the whole trace's infinite-cache hit rate (ties: the
earliest). Hit rates count trace blocks (512-token ``hash_ids``) with prefix
semantics, as :mod:`kvstore.tools.sim.cache` does; the live store counts full
scaled blocks, so a partial last block makes its rate a little lower.

Thread safety: pure functions and a frozen record.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvstore.errors import InvalidArgument
from kvstore.tools.demo.trace import TraceRecord, intern_chains


@dataclass(frozen=True, slots=True)
class Window:
    """The measured requests of a trace and the warm-up before them."""

    start: int  # index of the window's first request in the trace
    num_requests: int  # requests measured, from ``start``
    warmup: int  # requests before ``start`` replayed first, not counted
    hit_rate: float  # infinite-cache block hit rate of the window after its warm-up
    trace_hit_rate: float  # infinite-cache block hit rate of the whole trace
    trace_requests: int  # requests in the whole trace
    chosen: bool  # True: ``start`` was picked by :func:`pick_window`; False: given

    @property
    def warmup_start(self) -> int:
        """Index of the first warm-up request."""
        return self.start - self.warmup

    def describe(self) -> str:
        """One line for the CLI and the README."""
        how = "picked as closest to the whole trace's" if self.chosen else "whole trace"
        warm = (f"after a warm-up of {self.warmup} ({self.warmup_start}..{self.start - 1}, "
                f"not counted)" if self.warmup else "without warm-up")
        return (f"requests {self.start}..{self.start + self.num_requests - 1} of "
                f"{self.trace_requests} {warm}; infinite-cache block hit rate "
                f"{100 * self.hit_rate:.1f} % ({how}: {100 * self.trace_hit_rate:.1f} %)")


def prefix_hits(chains: Sequence[tuple[int, ...]], begin: int, count_from: int,
                end: int) -> tuple[int, int]:
    """Blocks hit and blocks looked up by requests ``count_from..end-1`` with an
    infinite cache that starts empty at ``begin`` and keeps every block.

    Args:
        chains: each request's interned block chain (:func:`intern_chains`).
        begin: first request that fills the cache.
        count_from: first request counted (``begin <= count_from <= end``).
        end: one past the last request.

    Returns:
        ``(hit_blocks, total_blocks)`` of the counted requests.
    """
    seen: set[int] = set()
    hits = total = 0
    for i in range(begin, end):
        chain = chains[i]
        n = 0
        while n < len(chain) and chain[n] in seen:
            n += 1
        if i >= count_from:
            hits += n
            total += len(chain)
        seen.update(chain)
    return hits, total


def _rate(hits_total: tuple[int, int]) -> float:
    hits, total = hits_total
    return hits / total if total else 0.0


def pick_window(records: Sequence[TraceRecord], num_requests: int, warmup: int,
                start: int | None = None, step: int = 100) -> Window:
    """The window of ``num_requests`` requests (after ``warmup`` more) to measure.

    Args:
        records: the whole trace, in order.
        num_requests: requests to measure (at most the trace's length).
        warmup: requests before the window that fill the store (cut to what
            the trace has before the window).
        start: the window's first request; None picks it (see the module).
        step: grid of candidate starts, in requests.

    Returns:
        The window.

    Raises:
        InvalidArgument: an empty trace, ``num_requests < 1``, a negative warm-up,
            or ``start`` beyond the trace.
    """
    n_all = len(records)
    if n_all == 0:
        raise InvalidArgument("the trace has no requests")
    if num_requests < 1 or warmup < 0 or step < 1:
        raise InvalidArgument(f"need num_requests >= 1, warmup >= 0, step >= 1; got "
                         f"{num_requests}, {warmup}, {step}")
    num_requests = min(num_requests, n_all)
    chains = intern_chains(records)
    whole = _rate(prefix_hits(chains, 0, 0, n_all))
    if start is not None:
        if not 0 <= start <= n_all - num_requests:
            raise InvalidArgument(f"window start {start} with {num_requests} requests is beyond "
                             f"the trace's {n_all} requests")
        w = min(warmup, start)
        rate = _rate(prefix_hits(chains, start - w, start, start + num_requests))
        return Window(start, num_requests, w, rate, whole, n_all, chosen=False)
    warmup = min(warmup, n_all - num_requests)
    best: tuple[float, int, float] | None = None   # (distance, start, rate)
    for s in range(warmup, n_all - num_requests + 1, step):
        rate = _rate(prefix_hits(chains, s - warmup, s, s + num_requests))
        if best is None or abs(rate - whole) < best[0]:
            best = (abs(rate - whole), s, rate)
    assert best is not None  # the range holds at least s = warmup
    return Window(best[1], num_requests, warmup, best[2], whole, n_all, chosen=True)


__all__ = ["Window", "pick_window", "prefix_hits"]
