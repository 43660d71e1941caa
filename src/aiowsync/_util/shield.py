"""Work that must finish once begun, whoever cancels the task that started it.

anyio's shielded cancel scopes hold back anyio's own cancellation, but not ``Task.cancel()``,
which is how ``asyncio.wait_for``, ``asyncio.timeout`` and asyncio task groups cancel. A copy
thread that a shield was meant to wait for would then still be writing a slot after the send
that started it had given the slot back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import anyio

__all__ = ["to_the_end"]

T = TypeVar("T")


async def to_the_end(work: Coroutine[Any, Any, T] | asyncio.Future[T]) -> T:
    """Run ``work`` to its end, then return its result or raise its error.

    ``work`` runs as a task of its own (or is a future, say of a thread's work), which no
    cancellation of the caller reaches. The caller waits for it under an anyio shield; if the
    caller was cancelled meanwhile (by anyio or by ``Task.cancel()``), that cancellation is
    raised once ``work`` has ended.
    """
    task = asyncio.ensure_future(work)
    cancelled: BaseException | None = None
    with anyio.CancelScope(shield=True):
        while not task.done():
            try:
                await asyncio.wait((task,))
            except asyncio.CancelledError as exc:
                cancelled = exc
    if cancelled is not None:
        if not task.cancelled():
            task.exception()  # retrieved: the caller's cancellation is what it hears
        raise cancelled
    return task.result()
