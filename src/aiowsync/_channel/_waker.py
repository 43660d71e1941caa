"""A thread that handles a receiver's messages while its event loop waits in its selector.

Why: a worker's event loop thread is also where the user's policy runs, so by the time an
update arrives it has used much CPU, and Linux makes it wait its turn when it wakes: on a
busy machine, milliseconds behind the other workers' forwards (``benchmarks/bench_wakeups.py``
measures it). A thread that does nothing else is scheduled at once, the more so with a short
time slice (Linux 6.12 and later let any thread ask for one; see :mod:`aiowsync._util.sched`).

How: a :class:`LoopGate` wraps the loop's selector so that the loop thread holds a lock at all
times except inside ``select()``. The :class:`Waker` thread waits on the channel's descriptor
and, when it fires, takes the lock: the loop is then waiting for events between two passes,
every task suspended at an ``await``, exactly where the loop itself would run the channel's
callback. The waker runs that callback (a switch and its ack, see
:meth:`~aiowsync._receiving.updates.UpdateLoop._take_inline`) and gives the lock back; a loop
that wakes meanwhile waits for it on its way out of ``select()``. Everything a switch must not
overlap (a forward on the loop, a coroutine between two awaits) therefore never overlaps it.
The loop no longer watches the descriptor: the waker wakes it only for what the callback left
it to do, and not at all for an update switched to and acknowledged.

Only the default asyncio loops have a selector to wrap; on others (uvloop), in asyncio's
debug mode (which rejects loop calls from other threads) and with ``AIOWSYNC_WAKER=0`` in the
environment, the loop handles its messages itself, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .._util.sched import shorten

__all__ = ["LoopGate", "Waker", "wakers_enabled"]

log = logging.getLogger("aiowsync.channel")

_HOLD_S = 0.002
"""How long the waker tries to take the gate before it leaves a message to the loop (which
is then running callbacks, and would win most races for the lock between two passes)."""
_LOOK_S = 0.05
"""How often a waker waiting for the loop looks whether it must stop."""

_BROKEN = select.POLLERR | select.POLLHUP | select.POLLNVAL
_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopGate] = weakref.WeakKeyDictionary()


def wakers_enabled(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether receivers on ``loop`` get a waker (see the module's text)."""
    return (
        os.environ.get("AIOWSYNC_WAKER") != "0"
        and not loop.get_debug()
        and hasattr(getattr(loop, "_selector", None), "select")
        and hasattr(loop, "_ready")
        and hasattr(loop, "_scheduled")
    )


class LoopGate:
    """A lock the loop thread holds except while it waits in its selector.

    Made on the loop's thread, while the loop runs (it takes the lock there); shared by every
    waker of that loop (:meth:`of`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._selector: Any = loop._selector  # type: ignore[attr-defined]
        self._inner: Callable[..., Any] = self._selector.select
        self._selector.select = self._select

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> LoopGate:
        """The gate of ``loop``, made now if it has none (call on the loop's thread)."""
        gate = _gates.get(loop)
        if gate is None:
            gate = _gates[loop] = cls(loop)
        return gate

    def _select(self, timeout: float | None = None) -> Any:
        self._lock.release()
        try:
            return self._inner(timeout)
        finally:
            self._lock.acquire()

    def hold(self, timeout: float) -> bool:
        """Take the lock (from another thread): True once the loop waits in its selector."""
        return self._lock.acquire(timeout=timeout)

    def release(self) -> None:
        self._lock.release()


class Waker:
    """A thread that runs ``handle()`` whenever descriptor ``fd`` fires and the loop is idle.

    ``handle`` is what the loop would run for ``fd`` (its reader callback, which the loop
    then no longer needs). It runs on the waker holding the loop's gate, with the loop set
    as the thread's running loop, so that the loop calls it makes go to that loop; the loop
    is woken afterwards only if ``handle`` left it something to do (a callback, a timer). A
    loop that keeps running callbacks for :data:`_HOLD_S` runs ``handle`` itself, in its
    next pass. Should the thread fail, ``on_failure`` is called on the loop (to watch ``fd``
    there again).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        handle: Callable[[], None],
        name: str,
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:
        self._loop = loop
        self._fd = fd
        self._handle = handle
        self._on_failure = on_failure
        self._gate = LoopGate.of(loop)
        self._stopping = False
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (it touches nothing of the channel's from here on). Idempotent.

        Call it before the descriptor is closed; on the loop's thread the call does not wait
        for the thread to end (it may be waiting for the gate the loop holds)."""
        if self._stopping:
            return
        self._stopping = True
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        os.close(self._stop_w)

    def _run(self) -> None:
        shorten()
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        failed = True
        try:
            while not self._stopping:
                events = dict(poller.poll())
                if self._stopping:
                    break
                if events.get(self._fd, 0) & _BROKEN:
                    log.warning("the receiver's waker lost its descriptor")
                    break
                if not self._held_turn():
                    break
            else:
                failed = False
        except Exception:
            if not self._stopping:  # else its channel closed during the turn: nothing wrong
                log.exception("the receiver's waker failed")
        finally:
            os.close(self._stop_r)
        if failed and not self._stopping:
            # The loop handles the messages alone from here on.
            with contextlib.suppress(RuntimeError):  # the loop is closed
                self._loop.call_soon_threadsafe(self._on_failure)

    def _held_turn(self) -> bool:
        """Run ``handle()`` once the loop waits in its selector, or have the loop run it if it
        keeps running callbacks; False to end the thread."""
        gate, loop = self._gate, self._loop
        if not gate.hold(_HOLD_S):
            return self._loop_turn()
        try:
            if self._stopping or loop.is_closed():
                return False
            timers = len(loop._scheduled)  # type: ignore[attr-defined]
            asyncio.events._set_running_loop(loop)
            try:
                self._handle()
            finally:
                asyncio.events._set_running_loop(None)
            # The loop computed how long to wait before this: callbacks and timers that
            # handle() added need it to look again.
            wake = bool(loop._ready) or len(loop._scheduled) != timers  # type: ignore[attr-defined]
        finally:
            gate.release()
        if wake:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(_nothing)
        return True

    def _loop_turn(self) -> bool:
        """Have the loop run ``handle()`` in its next pass, as its own reader callback would,
        and wait until it has (the descriptor fires until then)."""
        done = threading.Event()

        def turn() -> None:
            try:
                self._handle()
            finally:
                done.set()

        try:
            self._loop.call_soon_threadsafe(turn)
        except RuntimeError:  # the loop is closed
            return False
        while not done.wait(_LOOK_S):
            if self._stopping or self._loop.is_closed():
                return False
        return True


def _nothing() -> None:
    """Wakes the loop: what ``handle()`` scheduled runs in the same pass."""
