"""The read guard: forwards running in threads hold it so that no switch happens under them.

Switches are made in one synchronous step, only while no reader holds the guard, and only
where no code of the receiver's event loop runs: on the loop between two callbacks, or by the
receiver's waker thread while the loop waits for events (see :mod:`aiowsync._channel._waker`).
Coroutines on that loop are therefore never mid-switch; they only need the guard to keep one
version across an ``await``. Threads need it for every forward.

A reader waits for the few milliseconds in which a switch is being made. It does not wait for
a switch that is merely pending, with one exception that keeps switches from starving: a
thread that does not hold the guard already, and comes once a switch has waited for the
readers to leave for more than ``YIELD_AFTER_S``, waits for that switch. A thread's forwards
that follow each other back to back would otherwise always hold the guard when the loop looks.
Coroutines on the switching loop never wait for a pending switch, so they cannot deadlock
against it; a thread that already holds the guard does not wait either (nested forwards).
Nor does any thread while a coroutine on the switching loop holds the guard: the switch
waits for that coroutine anyway, and the coroutine may be awaiting that very thread (a
forward run with ``asyncio.to_thread``, or a lease's copy).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

import anyio

__all__ = ["YIELD_AFTER_S", "ReadGuard"]

T = TypeVar("T")

YIELD_AFTER_S = 0.02
"""How long a switch waits for the readers to leave before new readers from other threads
wait for it (see the module's text)."""


class ReadGuard:
    """A reader count that switches wait on; usable as ``with`` (threads) and ``async with``."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._switching = False
        self._idle_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._pending_since: float | None = None  # a switch waits for readers since then
        self._pending_thread: int | None = None  # the thread of that switch's loop
        self._held: dict[int, int] = {}  # readers per thread

    @property
    def readers(self) -> int:
        """How many readers hold the guard now."""
        return self._readers

    def acquire(self) -> None:
        """Hold the guard (blocking; from a thread). Waits while a switch is being made, or
        for a switch that has waited too long for readers to leave (see the module's text)."""
        me = threading.get_ident()
        with self._cond:
            while self._switching or self._must_yield(me):
                self._cond.wait()
            self._readers += 1
            self._held[me] = self._held.get(me, 0) + 1

    def _must_yield(self, me: int) -> bool:
        since = self._pending_since
        return (
            since is not None
            and me != self._pending_thread
            and me not in self._held
            and self._pending_thread not in self._held
            and time.monotonic() - since > YIELD_AFTER_S
        )

    def release(self) -> None:
        """Let go of the guard; the last reader out lets a waiting switch proceed."""
        with self._cond:
            if self._readers <= 0:
                raise RuntimeError("read guard released more times than acquired")
            self._readers -= 1
            me = threading.get_ident()
            if me in self._held:
                self._held[me] -= 1
                if not self._held[me]:
                    del self._held[me]
            if self._readers == 0:
                for loop, event in self._idle_waiters:
                    with contextlib.suppress(RuntimeError):  # that loop is closed
                        loop.call_soon_threadsafe(event.set)
                self._idle_waiters.clear()

    def __enter__(self) -> ReadGuard:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    async def __aenter__(self) -> ReadGuard:
        # Never blocks the loop: a switch runs on the loop, or on its waker while the loop
        # waits for events, so none is in progress while this coroutine runs.
        self.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    async def switch(self, fn: Callable[[], T], *, timeout: float) -> T:
        """Run ``fn`` on the loop at an instant when no reader holds the guard.

        Raises :class:`TimeoutError` if readers kept holding it for ``timeout`` seconds.
        """
        if not self._try_begin_switch():
            await self._wait_idle(timeout)
        try:
            return fn()
        finally:
            self._end_switch()

    def switch_nowait(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` right now if no reader holds the guard (on the loop), without waiting.

        Raises :class:`anyio.WouldBlock` if a reader holds it; ``fn`` did not run then. (The
        receiver switches this way within its channel's callback, where it cannot wait.)
        Readers that come while ``fn`` runs wait for it, so ``fn`` must be short.
        """
        if not self._try_begin_switch():
            raise anyio.WouldBlock
        try:
            return fn()
        finally:
            self._end_switch()

    def _try_begin_switch(self) -> bool:
        """Start a switch if no reader holds the guard; False otherwise. Readers that come
        meanwhile wait until :meth:`_end_switch`."""
        with self._cond:
            if self._readers:
                return False
            self._switching = True
            return True

    def _end_switch(self) -> None:
        with self._cond:
            self._switching = False
            self._cond.notify_all()

    async def _wait_idle(self, timeout: float) -> None:
        """Wait until no reader holds the guard, then mark a switch as in progress."""
        loop = asyncio.get_running_loop()
        with self._cond:
            self._pending_since = time.monotonic()
            self._pending_thread = threading.get_ident()
        try:
            await self._wait_for_no_reader(loop, timeout)
        finally:
            with self._cond:
                self._pending_since = self._pending_thread = None
                self._cond.notify_all()  # readers that yielded to it go on (or wait for it)

    async def _wait_for_no_reader(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        with anyio.fail_after(timeout):
            while True:
                with self._cond:
                    if self._readers == 0:
                        self._switching = True
                        break
                    event = asyncio.Event()
                    waiter = (loop, event)
                    self._idle_waiters.append(waiter)
                try:
                    await event.wait()
                finally:
                    # Timed out or cancelled: nothing must call into this loop later (it may
                    # be closed by then), and waiters must not pile up switch after switch.
                    with self._cond:
                        if waiter in self._idle_waiters:
                            self._idle_waiters.remove(waiter)
