"""The replay releases requests in arrival order, trace order among equal times."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from kvstore.tools.demo.replay import _dispatch
from kvstore.tools.demo.trace import ScaledRequest


def _req(index: int, arrival_ms: float) -> ScaledRequest:
    return ScaledRequest(index=index, arrival_ms=arrival_ms,
                         prompt_tokens=np.zeros(4, dtype=np.uint32), max_tokens=1, num_blocks=1)


def test_a_burst_is_released_in_trace_order_and_later_arrivals_after_it():
    # 20 requests in one millisecond (as the Mooncake traces have them), one later.
    reqs = [_req(i, 5.0) for i in range(20)] + [_req(20, 30.0)]
    reqs = [reqs[20]] + reqs[:20]              # not in arrival order in the list

    async def main():
        loop = asyncio.get_running_loop()
        go = [loop.create_future() for _ in reqs]
        released = []
        for r, g in zip(reqs, go):
            g.add_done_callback(lambda _f, i=r.index: released.append(i))
        t0 = time.perf_counter()
        await _dispatch(reqs, go, t0)
        await asyncio.sleep(0)
        return released, time.perf_counter() - t0
    released, elapsed = asyncio.run(main())
    assert released == list(range(21))
    assert elapsed >= 0.030
