"""Blocking work in a daemon thread of its own, awaited from the event loop.

anyio's worker threads are not daemons: a wait they hold (a collective that runs until its
deadline) holds up the interpreter's exit, even once the caller abandoned it. Work that may
outlive its caller runs here instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["ThreadNotStarted", "in_daemon_thread"]

T = TypeVar("T")


class ThreadNotStarted(RuntimeError):
    """No thread could be started (the process is at its limit): ``fn`` never ran."""


async def in_daemon_thread(fn: Callable[..., T], *args: Any, name: str) -> T:
    """``fn(*args)`` in a new daemon thread called ``name``: its result, or its error.

    Cancelling the caller abandons the wait, not the work, which ends by itself (its result
    is dropped). Raises :class:`ThreadNotStarted` when no thread can be started.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(error: BaseException | None, value: Any) -> None:
        if future.done():  # abandoned
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        value: Any = None
        try:
            value = fn(*args)
        except BaseException as exc:  # handed to the waiting task
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, error, value)
        del error, value

    try:
        threading.Thread(target=run, name=name, daemon=True).start()
    except RuntimeError as exc:
        raise ThreadNotStarted(str(exc)) from None
    return await future
