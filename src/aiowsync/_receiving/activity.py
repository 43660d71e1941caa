"""What a receiver is busy with, as its beats tell the sender: a blocked event loop, a version
being applied, a pull-mode receiver that is not in ``receive()``.

The beat thread asks :meth:`Activity.text` before each beat. To learn whether the event loop
still turns, it leaves a callback on the loop and looks, at the next beat, whether it ran:
one callback per beat interval, nothing on the loop's own path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

__all__ = ["Activity"]

STALLED_S = 0.5
"""A callback left on the loop that has not run after this long: the loop is blocked."""


class Activity:
    """What one receiver is doing (see the module)."""

    def __init__(self, *, pull: bool = False) -> None:
        self.pull = pull
        """Pull mode: versions are applied only inside ``receive()``."""
        self.applying: int | None = None
        """The version being applied (its hooks included), set on the loop."""
        self.receiving = False
        """Pull mode: inside ``receive()``."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._asked: float | None = None
        """When the beat thread left a callback on the loop that has not run yet."""
        self._idle_since = time.monotonic()

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the receiver runs on (``connect()`` calls this)."""
        self._loop = loop

    def enter_receive(self) -> None:
        self.receiving = True

    def leave_receive(self) -> None:
        self.receiving = False
        self._idle_since = time.monotonic()

    def text(self) -> str:
        """What to tell the sender; '' when idle. Called by the beat thread."""
        now = time.monotonic()
        applying = self.applying
        asked = self._asked
        if asked is not None and now - asked >= STALLED_S:
            what = f"its event loop has not run for {now - asked:.1f} s"
            return what if applying is None else f"{what}, applying version {applying}"
        if asked is None:
            self._look(now)
        if applying is not None:
            return f"applying version {applying}"
        if self.pull and not self.receiving:
            return f"pull mode: not in receive() for {now - self._idle_since:.1f} s"
        return ""

    def _look(self, now: float) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        self._asked = now
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(self._turned)

    def _turned(self) -> None:
        self._asked = None
