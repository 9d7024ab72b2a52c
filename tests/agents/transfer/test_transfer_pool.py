"""LinkPool: a bounded, resizable FIFO pool of connection slots."""

from __future__ import annotations

import asyncio

import pytest

from agents.transfer.pool import LinkPool


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_pool_admits_up_to_capacity_and_queues_the_rest(run) -> None:
    async def scenario():
        pool = LinkPool(2)
        waits = [await pool.acquire(), await pool.acquire()]
        third = asyncio.create_task(pool.acquire())
        await _settle()
        queued = (third.done(), pool.in_use, pool.waiting)
        pool.release()
        waits.append(await third)
        return waits, queued, pool.stats()

    waits, queued, stats = run(scenario())

    assert waits[:2] == [0.0, 0.0]
    assert waits[2] > 0
    assert queued == (False, 2, 1)
    assert stats.peak_in_use == 2
    assert stats.acquisitions == 3


def test_pool_serves_waiters_first_come_first_served(run) -> None:
    async def scenario():
        pool = LinkPool(1)
        await pool.acquire()
        order: list[int] = []

        async def waiter(index: int) -> None:
            await pool.acquire()
            order.append(index)
            pool.release()

        tasks = [asyncio.create_task(waiter(index)) for index in range(4)]
        await _settle()
        pool.release()
        await asyncio.gather(*tasks)
        return order

    assert run(scenario()) == [0, 1, 2, 3]


def test_growing_the_pool_admits_waiters_at_once(run) -> None:
    async def scenario():
        pool = LinkPool(1)
        await pool.acquire()
        waiters = [asyncio.create_task(pool.acquire()) for _ in range(2)]
        await _settle()
        pool.resize(3)
        await _settle()
        return [task.done() for task in waiters], pool.in_use

    assert run(scenario()) == ([True, True], 3)


def test_shrinking_the_pool_admits_nobody_until_holders_drop_below_it(run) -> None:
    async def scenario():
        pool = LinkPool(3)
        for _ in range(3):
            await pool.acquire()
        waiter = asyncio.create_task(pool.acquire())
        pool.resize(1)
        seen = []
        for _ in range(3):
            await _settle()
            seen.append(waiter.done())
            pool.release()
        await _settle()
        seen.append(waiter.done())
        return seen, pool.in_use

    # Held: 3 -> 2 -> 1 -> 0; the waiter may only enter once in_use < 1.
    assert run(scenario()) == ([False, False, False, True], 1)


def test_cancelling_a_waiter_leaves_the_pool_unchanged(run) -> None:
    async def scenario():
        pool = LinkPool(1)
        await pool.acquire()
        doomed = asyncio.create_task(pool.acquire())
        await _settle()
        doomed.cancel()
        await _settle()
        pool.release()
        after = await asyncio.wait_for(pool.acquire(), 1)
        return doomed.cancelled(), after, pool.in_use, pool.waiting

    cancelled, wait, in_use, waiting = run(scenario())

    assert cancelled
    assert wait == 0.0
    assert (in_use, waiting) == (1, 0)


def test_a_slot_handed_to_a_waiter_cancelled_before_it_ran_is_returned(run) -> None:
    async def scenario():
        pool = LinkPool(1)
        await pool.acquire()
        doomed = asyncio.create_task(pool.acquire())
        await _settle()
        pool.release()  # hands the slot to `doomed`...
        doomed.cancel()  # ...which is cancelled before it resumes
        await _settle()
        return pool.in_use

    assert run(scenario()) == 0


def test_utilisation_is_the_fraction_of_slot_time_held() -> None:
    now = [0.0]
    pool = LinkPool(2, clock=lambda: now[0])

    async def hold() -> None:
        await pool.acquire()
        now[0] = 1.0
        await pool.acquire()
        now[0] = 2.0

    asyncio.run(hold())
    stats = pool.stats()

    # One slot for 1 s, then both for 1 s: 3 slot-seconds of 4 available.
    assert stats.busy_slot_s == pytest.approx(3.0)
    assert stats.full_s == pytest.approx(1.0)
    assert stats.utilisation == pytest.approx(0.75)


def test_pool_rejects_a_capacity_below_one() -> None:
    with pytest.raises(ValueError, match="capacity"):
        LinkPool(0)


def test_urgent_waiters_are_served_before_background_ones(run) -> None:
    async def scenario():
        pool = LinkPool(1)
        await pool.acquire()
        order: list[str] = []

        async def waiter(name: str, background: bool) -> None:
            await pool.acquire(background=background)
            order.append(name)
            pool.release()

        tasks = []
        for name, background in (("bg0", True), ("bg1", True), ("u0", False), ("u1", False)):
            tasks.append(asyncio.create_task(waiter(name, background)))
            await _settle()  # queue them in this order
        queued = (pool.waiting, pool.waiting_background)
        pool.release()
        await asyncio.gather(*tasks)
        return order, queued, pool.stats()

    order, queued, stats = run(scenario())
    # Urgent first (in arrival order), then background (in arrival order).
    assert order == ["u0", "u1", "bg0", "bg1"]
    assert queued == (4, 2)
    assert stats.acquisitions == 5
    assert stats.background_acquisitions == 2


def test_a_background_acquire_does_not_pass_a_queued_urgent_one(run) -> None:
    async def scenario():
        pool = LinkPool(2)
        await pool.acquire()
        await pool.acquire()
        urgent = asyncio.create_task(pool.acquire())
        await _settle()
        pool.release()  # the freed slot goes to the queued urgent waiter
        await urgent
        background = asyncio.create_task(pool.acquire(background=True))
        await _settle()
        blocked = not background.done()
        pool.release()
        await background
        return blocked

    assert run(scenario()) is True


def test_a_free_slot_goes_to_a_background_acquire_at_once(run) -> None:
    async def scenario():
        pool = LinkPool(1)
        return await pool.acquire(background=True), pool.in_use

    assert run(scenario()) == (0.0, 1)


def test_cancelling_a_background_waiter_leaves_the_pool_unchanged(run) -> None:
    async def scenario():
        pool = LinkPool(1)
        await pool.acquire()
        waiter = asyncio.create_task(pool.acquire(background=True))
        await _settle()
        waiter.cancel()
        await _settle()
        after_cancel = (pool.in_use, pool.waiting, pool.waiting_background)
        pool.release()
        return after_cancel, pool.in_use

    assert run(scenario()) == ((1, 0, 0), 0)
