"""A process that races another one putting the same keys (test_concurrent_put.py).

Lives in its own module so that ``multiprocessing`` (spawn) can import it
in the child without importing the test module.
"""

from __future__ import annotations

import hashlib


def round_value(round_no: int, who: int, size_bytes: int = 64 * 1024) -> bytes:
    """The value worker ``who`` puts in ``round_no``: equal for both on even rounds."""
    seed = f"{round_no}" if round_no % 2 == 0 else f"{round_no}/{who}"
    block = hashlib.sha256(seed.encode()).digest()
    return (block * (size_bytes // len(block) + 1))[:size_bytes]


def race(master: str, prefer_shm: bool, prefix: str, rounds: int, who: int, barrier,
         results) -> None:
    """Put ``prefix + round`` in each round, all workers released together by ``barrier``.

    Sends ``(who, outcomes)`` on ``results``; an outcome is "written",
    "present", "conflict" or "error:<type>:<message>".
    """
    from kvstore.client import KVClient
    from kvstore.errors import KeyConflict

    outcomes: list[str] = []
    try:
        with KVClient(master, prefer_shm=prefer_shm) as kv:
            kv.exists(prefix + "warm-up")         # connect before the first round
            for r in range(rounds):
                value = round_value(r, who)
                barrier.wait(timeout=30)
                try:
                    outcomes.append("written" if kv.put(f"{prefix}{r}", value) else "present")
                except KeyConflict:
                    outcomes.append("conflict")
                except Exception as exc:  # reported to the test, which fails on it
                    outcomes.append(f"error:{type(exc).__name__}:{exc}")
    finally:
        results.put((who, outcomes))
