"""A broadcast wake-up for tasks of one event loop, cheap enough for every ack and switch.

``anyio.Event()`` looks up the running async library on each construction (a few microseconds,
far more on a busy process), and the wait-until-changed pattern made one per notification. A
:class:`Signal` only allocates a future for each task that actually waits.
"""

from __future__ import annotations

import asyncio

__all__ = ["Signal"]


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

    async def wait(self) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:
            if not fut.done():
                fut.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)
