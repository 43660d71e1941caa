"""What both sessions of a scheme share: the options they run with, and their background tasks.

:class:`WeightSyncScheme` is one public class for the sender and the receivers. Its
``init_on_sender`` makes a :class:`~aiowsync._scheme.sender.SenderSession`, its
``init_on_receiver`` a :class:`~aiowsync._scheme.receiver.ReceiverSession`; each owns the
state of its role and is handed the :class:`SessionOptions` it runs with and, for each
``async with``, the :class:`Tasks` its background loops run in.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import anyio.abc

from .._channel import ChannelFactory
from .._config import Heartbeats, Timeouts
from .._planes.base import DataPlane

__all__ = ["Role", "SessionOptions", "Tasks", "forked_text", "resolve_model"]

Role = Literal["sender", "receiver"]


def forked_text(sender_pid: int) -> str:
    """What a process forked from a sender is told when it tries to be a receiver."""
    return (
        f"this process ({os.getpid()}) was forked from the trainer (process {sender_pid}) and "
        "holds the trainer's own sender, not a receiver's copy of the scheme: start worker "
        "processes with the 'spawn' start method (multiprocessing.get_context('spawn')), "
        "or build the worker's scheme from the sender's address"
    )


def resolve_model(context: Any, model_id: str) -> Any:
    """The model ``context`` holds under ``model_id`` (seed-style ``get_model`` or a dotted
    attribute path)."""
    getter = getattr(context, "get_model", None)
    if callable(getter):
        return getter(model_id)
    obj = context
    for part in model_id.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


@dataclass(frozen=True)
class SessionOptions:
    """The scheme's configuration as a session runs it (taken when ``init_on_*`` succeeds)."""

    plane: DataPlane
    channels: ChannelFactory
    model_id: str
    bind: str
    timeouts: Timeouts
    heartbeats: Heartbeats
    apply_mode: Literal["auto", "swap", "copy"]
    background: bool
    integrity: bool | None


class Tasks:
    """The background loops of one ``async with`` session: run in its task group under one
    cancel scope, so that leaving stops them first, before the channel they read closes."""

    def __init__(self, tg: anyio.abc.TaskGroup) -> None:
        self.tg = tg
        self._scope = anyio.CancelScope()
        self._running: list[anyio.Event] = []

    async def start(self, loop: Callable[..., Awaitable[None]]) -> None:
        """Start ``loop`` (a function taking ``task_status``); returns once it reported
        started, or raises what it raised before."""
        finished = anyio.Event()
        self._running.append(finished)
        scope = self._scope

        async def run(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            try:
                with scope:
                    await loop(task_status=task_status)
            finally:
                finished.set()

        await self.tg.start(run)

    async def stop(self, wait: float) -> None:
        """Cancel every loop and wait (at most ``wait`` s, whoever cancels) for them to end."""
        self._scope.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(wait):
            for finished in self._running:
                await finished.wait()
