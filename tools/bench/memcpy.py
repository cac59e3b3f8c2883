"""The cold-memcpy limit: ``numpy.copyto`` between pools larger than the last-level cache.

Row ``memcpy cold get``: value ``i + 1`` of a source pool copied into slot
``i`` of a destination pool, both of ``pool_bytes`` (>= 2x the LLC), so
neither side is cached. It is the limit of kvstore's shm gets, which copy a
value from the node's segment into the caller's buffer.

It starts nothing of its own: its rounds take turns with those shm gets
(:func:`~kvstore.tools.bench.harness.timed_interleaved`, in
``kvstore_peer``), on the same pools, so that their ratio compares the two
under the same state of the machine. This module gives that measurement
its step and its row.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from kvstore.tools.bench.harness import DataPath, Op, Pool, Row, System, Timing, timed_row


def copy_step(src: Pool, dst: Pool) -> Callable[[int], None]:
    """The timed step: copy ``src[i + 1]`` into ``dst[i]`` (both rotate through their slots)."""
    return lambda i: np.copyto(dst[i], src[i + 1])


def limit_row(size_bytes: int, t: Timing) -> Row:
    """The ``memcpy cold get`` row of a timed :func:`copy_step`."""
    return timed_row(System.MEMCPY, DataPath.COLD, Op.GET, size_bytes, t)
