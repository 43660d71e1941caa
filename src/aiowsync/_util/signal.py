"""A broadcast wake-up for tasks of one event loop, cheap enough for every ack and switch.

``anyio.Event()`` looks up the running async library on each construction (a few microseconds,
far more on a busy process), and the wait-until-changed pattern made one per notification. A
:class:`Signal` only allocates a future for each task that actually waits.
"""

from __future__ import annotations

import asyncio

__all__ = ["Flag", "Signal"]


class Signal:
    """``notify()`` wakes every task then waiting in ``wait()``; a notify with no waiter is free.

    Use it as a condition: check the state, and if it is not yet right, ``await wait()`` and
    check again. A notification sent before ``wait()`` is called is not remembered.
    """

    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def waiting(self) -> bool:
        """True while some task waits."""
        return bool(self._waiters)

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def wait(self, timeout: float | None = None) -> None:
        """Wait for the next ``notify()``, or at most ``timeout`` seconds (one timer)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        timer = None if timeout is None else loop.call_later(timeout, _expire, fut)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()
            if not fut.done():
                fut.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)


class Flag:
    """A flag tasks of one loop can wait on, with a time limit that costs one timer.

    Like ``asyncio.Event``, but ``wait(timeout)`` needs no cancel scope around it: the
    sender waits on one of these for every send's acknowledgements.
    """

    __slots__ = ("_set", "_signal")

    def __init__(self) -> None:
        self._set = False
        self._signal = Signal()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        self._signal.notify()

    def clear(self) -> None:
        self._set = False

    async def wait(self, timeout: float | None = None) -> bool:
        """Wait until the flag is set or ``timeout`` seconds passed; whether it is set."""
        if not self._set:
            await self._signal.wait(timeout)
        return self._set


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
