"""The loop-local broadcast wake-up used for acks, switches and connection changes."""

from __future__ import annotations

import asyncio

import pytest

from aiowsync._signal import Signal


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
