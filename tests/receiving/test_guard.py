"""The read guard: a switch never runs under a reader, and readers that follow each other back
to back in a thread cannot starve it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aiowsync._receiving.guard import YIELD_AFTER_S, ReadGuard


def _forward() -> int:
    """A millisecond or so of Python work, the GIL held throughout."""
    return sum(i * i for i in range(5000))


def _reader(guard: ReadGuard, stop: threading.Event, held: list[int], nested: bool) -> None:
    """Forwards back to back: the guard is let go and taken again at once."""
    while not stop.is_set():
        with guard:
            if nested:
                with guard:  # a forward inside a forward of the same thread
                    held.append(_forward())
            else:
                held.append(_forward())


@pytest.mark.parametrize("nested", [False, True])
async def test_back_to_back_readers_in_threads_let_each_switch_through(nested: bool) -> None:
    guard, stop, held = ReadGuard(), threading.Event(), []
    readers = [
        threading.Thread(target=_reader, args=(guard, stop, held, nested), daemon=True)
        for _ in range(2)
    ]
    for t in readers:
        t.start()
    try:
        waits = []
        for _ in range(20):
            started = time.monotonic()
            seen = await guard.switch(lambda: guard.readers, timeout=20)
            waits.append(time.monotonic() - started)
            assert seen == 0  # no reader held it while the switch ran
            await asyncio.sleep(0.005)
    finally:
        stop.set()
        for t in readers:
            t.join(10)
    assert held, "the readers never ran"
    # Before readers yielded, a switch here could wait out its deadline (20 s): one of the
    # readers held the guard whenever the loop looked.
    # Measured on 2 cores: 20 switches waited 22 s in all (up to 6.3 s each) before, and
    # 0.5 s (up to 25 ms) with readers yielding after 20 ms.
    print(f"20 switches waited {sum(waits):.2f} s, the longest {max(waits) * 1e3:.1f} ms")
    assert sum(waits) < 8


async def test_a_coroutine_holding_the_guard_on_the_loop_is_never_made_to_wait() -> None:
    guard = ReadGuard()
    async with guard:
        switch = asyncio.ensure_future(guard.switch(lambda: guard.readers, timeout=5))
        await asyncio.sleep(YIELD_AFTER_S * 3)  # the switch has waited past the grace
        async with guard:  # the loop's own coroutines never wait for it (no deadlock)
            assert guard.readers == 2
        assert not switch.done()
    assert await switch == 0


async def test_a_thread_that_a_coroutine_holding_the_guard_awaits_is_not_made_to_wait() -> None:
    """The coroutine holds the guard across an ``await asyncio.to_thread(forward)`` whose
    forward takes the guard too: the thread must not yield to the switch, which waits for
    the coroutine, or neither would ever move."""
    guard = ReadGuard()

    def forward() -> float:
        started = time.monotonic()
        with guard:
            return time.monotonic() - started

    async with guard:
        switch = asyncio.ensure_future(guard.switch(lambda: guard.readers, timeout=10))
        await asyncio.sleep(YIELD_AFTER_S * 3)  # the switch has waited past the grace
        waited = await asyncio.wait_for(asyncio.to_thread(forward), timeout=5)
        assert waited < 1.0 and not switch.done()
    assert await switch == 0
