"""The loop-local broadcast wake-up used for acks, switches and connection changes."""

from __future__ import annotations

import asyncio

import pytest

from aiowsync._util.signal import Flag, Signal


async def test_notify_wakes_every_task_waiting_at_that_moment() -> None:
    signal = Signal()
    woken: list[int] = []

    async def waiter(i: int) -> None:
        await signal.wait()
        woken.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await asyncio.sleep(0)
    signal.notify()
    await asyncio.wait_for(asyncio.gather(*tasks), 1)
    assert sorted(woken) == [0, 1, 2]


async def test_a_notify_before_wait_is_not_remembered() -> None:
    signal = Signal()
    signal.notify()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(signal.wait(), 0.05)


async def test_a_cancelled_waiter_leaves_nothing_behind_and_others_still_wake() -> None:
    signal = Signal()
    gone = asyncio.create_task(signal.wait())
    stays = asyncio.create_task(signal.wait())
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert len(signal._waiters) == 1
    signal.notify()
    await asyncio.wait_for(stays, 1)
    assert not signal._waiters


async def test_flag_wait_returns_when_set_or_at_its_time_limit() -> None:
    flag = Flag()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await flag.wait(0.05) is False
    assert loop.time() - started >= 0.04
    loop.call_later(0.01, flag.set)
    assert await flag.wait(5.0) is True
    assert await flag.wait(0) is True  # already set: no wait at all
    flag.clear()
    assert not flag.is_set()
    waiter = asyncio.ensure_future(flag.wait(5.0))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not flag._signal.waiting  # a cancelled wait leaves nothing behind
