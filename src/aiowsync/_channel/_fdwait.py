"""Waiting on a ZeroMQ socket from the event loop without a pending ``recv`` future.

A zmq socket's file descriptor only signals that the socket's state *may* have changed. A
wait here therefore looks at the socket's state (``zmq.EVENTS``) and reads without blocking
only when a message is there; nothing is read while waiting, so a wait cancelled by a
deadline loses no message (a cancelled ``recv_multipart`` future can).
"""

from __future__ import annotations

import asyncio
import math
import time

import zmq

from .._exceptions import TransportError, WeightSyncTimeout
from .._util.sched import shorten_all, zmq_io_threads
from .._util.signal import Signal
from ._base import timeout_error

__all__ = ["POLLIN", "POLLOUT", "ZmqEnd", "deadline_after"]

# Plain ints: zmq's enum flags cost more than the system calls on this hot path.
POLLIN = int(zmq.POLLIN)
POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)


def deadline_after(timeout: float | None) -> float:
    """The ``time.monotonic()`` at which ``timeout`` seconds from now end (``None``: never)."""
    return time.monotonic() + (math.inf if timeout is None else timeout)


class ZmqEnd:
    """Wait-then-read helpers over one plain zmq socket driven by the running event loop.

    The socket's file descriptor is registered with the loop once. A receive first reads the
    socket's state, which also drains its pending commands so that the descriptor is quiet
    until something new happens. Every send and receive wakes the other waiters to re-check,
    since it may have consumed the signal they needed.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> None:
        self._ctx = ctx
        self._sock: zmq.Socket[bytes] = ctx.socket(kind)
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = Signal()
        # One deadline timer for all waiters, armed for the earliest deadline not yet passed,
        # because a timer per wait cost more than the wait itself on this path.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def _wake(self) -> None:
        self._changed.notify()

    _io_before: set[int] | None = None
    """The ZeroMQ I/O threads this process had before this end's context started its own."""

    def _attached(self, loop: asyncio.AbstractEventLoop) -> None:
        """Called once the socket's descriptor is watched by ``loop`` (on the loop)."""
        if self._io_before is not None:
            # The context's I/O threads, which pass every message along (they name
            # themselves once running, hence not at once after the first socket).
            shorten_all(zmq_io_threads() - self._io_before)
            self._io_before = None

    def _notify_waiters(self) -> None:
        """Wake every waiter, whatever it waits for (a deadline passed, the socket closed)."""
        self._changed.notify()

    def _someone_waits(self) -> bool:
        return self._changed.waiting

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._notify_waiters()

    def _ready(self, event: int) -> bool:
        """Whether the socket can do ``event`` now (reading its state also resets the
        descriptor's signal, like a read that finds nothing)."""
        if self._sock.closed:
            raise TransportError("channel is closed")
        return bool(self._sock.getsockopt(_EVENTS) & event)  # type: ignore[operator]

    async def _wait(self, event: int, deadline: float) -> None:
        while not self._ready(event):
            await self._signalled(deadline)

    async def _signalled(self, deadline: float, signal: Signal | None = None) -> None:
        """Wait until the descriptor fires, another operation ran, or ``deadline`` passed
        (``signal``: what the wait listens to, by default what :meth:`_wake` notifies).

        May also return early (another waiter's deadline): callers check and wait again.
        """
        loop = asyncio.get_running_loop()
        if self._loop is None:
            loop.add_reader(self._fd, self._wake)
            self._loop = loop
            self._attached(loop)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        if deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = loop.call_later(remaining, self._on_timer), deadline
        await (self._changed if signal is None else signal).wait()

    def _try_send(self, *frames: bytes) -> bool:
        """Queue one message of ``frames`` if the socket takes it now; False if it has no room.

        Plain calls, since ``send_multipart`` builds flag enums for every frame. A ROUTER
        refuses a message at its first frame or not at all, so False never leaves half of one.
        """
        if self._sock.closed:
            raise TransportError("channel is closed")
        try:
            for frame in frames[:-1]:
                self._sock.send(frame, _NOBLOCK | _SNDMORE)
            self._sock.send(frames[-1], _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise TransportError(f"send failed: {exc}") from None
        finally:
            self._after_io()
        return True

    async def _send_frames(self, frames: list[bytes], timeout: float | None) -> None:
        deadline = deadline_after(timeout)
        while not self._try_send(*frames):
            if self._ready(POLLOUT):
                # The socket has room but this peer's queue is full (a ROUTER queues per peer):
                # that peer has stopped reading, and no event will say when it resumes.
                raise WeightSyncTimeout("the peer is not reading its messages")
            try:
                await self._wait(POLLOUT, deadline)
            except TimeoutError:
                raise timeout_error("room to send", timeout) from None

    async def _recv_frames(self, timeout: float | None) -> list[bytes]:
        deadline = deadline_after(timeout)
        while True:
            # Look before reading: a read that finds nothing costs an exception, and most
            # wake-ups of the descriptor (say, after our own send) bring nothing to read.
            if self._ready(POLLIN):
                frames = self._recv_frames_nowait()
                if frames is not None:
                    return frames
            try:
                await self._signalled(deadline)
            except TimeoutError:
                raise timeout_error("message", timeout) from None

    user_ids = False
    """Read each message's ``User-Id`` (set by a ZAP handler) into :attr:`user_id`."""
    user_id: str | None = None
    """The ``User-Id`` of the last message read, when :attr:`user_ids` is set."""

    def _recv_frames_nowait(self) -> list[bytes] | None:
        if self._sock.closed:
            raise TransportError("channel is closed")
        try:
            frames: list[bytes] | None
            if self.user_ids:
                parts = self._sock.recv_multipart(_NOBLOCK, copy=False)
                user = parts[-1].get("User-Id") if parts else None
                self.user_id = user if isinstance(user, str) else None
                frames = [p.bytes for p in parts]
            else:
                frames = self._sock.recv_multipart(_NOBLOCK)
        except zmq.Again:
            # Nothing to read: zmq still processed the socket's pending commands, which also
            # reset the descriptor that _signalled() waits on.
            frames = None
        except zmq.ZMQError as exc:
            raise TransportError(f"receive failed: {exc}") from None
        finally:
            self._after_io()
        return frames

    def _after_io(self) -> None:
        # An operation may consume the fd's edge that another waiter needed: let them re-check.
        if self._loop is not None and self._someone_waits():
            self._loop.call_soon(self._wake)

    def _close_socket(self, linger_ms: int = 0) -> None:
        if self._sock.closed:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._sock.close(linger=linger_ms)
        # Waiters wake, look at the socket again, and raise TransportError: it is closed.
        self._notify_waiters()
