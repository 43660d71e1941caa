"""The thread a sender plane copies versions in, and the size below which it copies inline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .._util.shield import to_the_end

__all__ = ["INLINE_COPY_BYTES", "Stager"]

INLINE_COPY_BYTES = 2 * 1024 * 1024
"""Versions up to this size are copied on the event loop: cheaper than the hop to a thread,
and too short to stall the loop."""


class Stager:
    """Runs one copy at a time (sends stage under the sender's lock) in a thread of its own,
    which an asyncio future can wait for without an anyio hop."""

    def __init__(self, inline_bytes: int = INLINE_COPY_BYTES) -> None:
        self.inline_bytes = inline_bytes
        self._executor: ThreadPoolExecutor | None = None

    async def run(self, nbytes: int, copy: Callable[[], None]) -> None:
        """``copy()`` inline for ``nbytes`` up to :attr:`inline_bytes`, else in the thread.

        A copy in the thread runs to its end however the caller is cancelled: its slot must
        not be handed out again while it is written.
        """
        if nbytes <= self.inline_bytes:
            copy()
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiowsync-stage")
        await to_the_end(asyncio.get_running_loop().run_in_executor(self._executor, copy))

    def close(self) -> None:
        # A copy still running holds the thread; it ends on its own.
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
