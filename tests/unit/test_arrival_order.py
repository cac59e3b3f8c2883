"""ArrivalOrder: requests reach the scheduler in the order they arrived, whatever
order their prefix lookups finish in."""

from __future__ import annotations

import asyncio

import pytest

from kvstore.conductor.arrival_order import ArrivalOrder


def _run(coro):
    return asyncio.run(coro)


def test_lookups_finishing_in_reverse_are_scheduled_in_arrival_order():
    async def main():
        order, scheduled = ArrivalOrder(), []

        async def request(i: int, lookup_s: float):
            t = order.ticket()
            try:
                await asyncio.sleep(lookup_s)     # the store lookup
                await order.turn(t)
            finally:
                order.done(t)
            scheduled.append(i)                   # before the next await, as the conductor does
            await asyncio.sleep(0)

        await asyncio.gather(*(request(i, 0.05 - 0.01 * i) for i in range(5)))
        return scheduled
    assert _run(main()) == [0, 1, 2, 3, 4]


def test_a_request_abandoned_while_waiting_does_not_hold_the_others():
    async def main():
        order, scheduled = ArrivalOrder(), []
        t0, t1, t2 = order.ticket(), order.ticket(), order.ticket()

        async def waiter(i, t):
            try:
                await order.turn(t)
            finally:
                order.done(t)
            scheduled.append(i)

        w1 = asyncio.create_task(waiter(1, t1))
        w2 = asyncio.create_task(waiter(2, t2))
        await asyncio.sleep(0)
        assert order.waiting == 2
        w1.cancel()                               # its client went away
        await asyncio.gather(w1, return_exceptions=True)
        assert scheduled == []
        order.done(t0)                            # the oldest is scheduled
        await w2
        return scheduled, order.waiting
    assert _run(main()) == ([2], 0)


def test_the_oldest_request_does_not_wait():
    async def main():
        order = ArrivalOrder()
        t = order.ticket()
        await asyncio.wait_for(order.turn(t), 0.1)
        order.done(t)
        t2 = order.ticket()
        await asyncio.wait_for(order.turn(t2), 0.1)
    _run(main())


def test_tickets_done_out_of_turn_are_skipped_once_the_older_ones_finish():
    async def main():
        order = ArrivalOrder()
        ts = [order.ticket() for _ in range(4)]
        order.done(ts[2])
        order.done(ts[1])
        order.done(ts[0])
        await asyncio.wait_for(order.turn(ts[3]), 0.1)    # 0-2 done: 3 is the oldest
        with pytest.raises(asyncio.TimeoutError):
            t5 = order.ticket()
            await asyncio.wait_for(order.turn(t5), 0.05)  # 3 is not done
    _run(main())
