"""Two client processes put the same key at the same moment, round after round.

Exactly one put commits; the other sees "already present" (equal bytes) or
KeyConflict (different bytes); the stored value is one of the two, intact,
and the master keeps serving.
"""

from __future__ import annotations

import multiprocessing as mp

from kvstore.client import KVClient
from kvstore.keys import value_checksum
from put_race_worker import race, round_value

ROUNDS = 60   # even rounds: equal bytes; odd rounds: different bytes


def test_same_key_put_concurrently(cluster, transport, key_prefix):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [ctx.Process(target=race, args=(cluster.master, transport == "shm", key_prefix,
                                            ROUNDS, who, barrier, results))
             for who in (0, 1)]
    for p in procs:
        p.start()
    try:
        outcomes = dict(results.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert len(outcomes[0]) == len(outcomes[1]) == ROUNDS

    with KVClient(cluster.master, prefer_shm=transport == "shm") as kv:
        values = kv.batch_get([f"{key_prefix}{r}" for r in range(ROUNDS)])
        for r in range(ROUNDS):
            pair = sorted([outcomes[0][r], outcomes[1][r]])
            expected_loser = "present" if r % 2 == 0 else "conflict"
            assert pair == sorted(["written", expected_loser]), f"round {r}: {pair}"
            winner = 0 if outcomes[0][r] == "written" else 1
            stored = values[r]
            assert stored == round_value(r, winner), f"round {r}: stored value is not the winner's"
            (meta,) = kv.lookup([f"{key_prefix}{r}"])
            assert meta.checksum == value_checksum(stored)
    cluster.procs.check()   # the master and nodes are all still running
