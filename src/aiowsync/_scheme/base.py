"""What both sides of a scheme share: its configuration and the state of its session.

:class:`WeightSyncScheme` is one class for the sender and the receivers; its sender's methods
live in :mod:`aiowsync._scheme.sender`, its receivers' in :mod:`aiowsync._scheme.receiver`,
both on the state declared here.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import anyio
import anyio.abc
import torch

from .._channel import ChannelFactory, SenderChannel
from .._config import Heartbeats, Timeouts
from .._planes.base import DataPlane, WeightSource
from .._receiving.engine import Hook, ReceiverCore
from .._receiving.guard import ReadGuard
from .._sending.engine import SenderCore
from .._sending.source import ModelSource
from .._weights.flatten import WeightsLike
from .._weights.layout import Layout
from .._weights.strategy import WeightStrategy
from .relay import Relay

__all__ = ["Role", "SchemeState", "forked_text", "resolve_model"]

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


class SchemeState:
    """The attributes both sides use (set by :class:`WeightSyncScheme`)."""

    plane: DataPlane
    _address: str | None
    _strategy: WeightStrategy
    model_id: str
    bind: str
    timeouts: Timeouts
    heartbeats: Heartbeats
    channels: ChannelFactory
    apply_mode: Literal["auto", "swap", "copy"]
    background: bool
    _role: Role | None
    _model: Any
    _models: dict[str, WeightsLike] | None
    _weights: WeightsLike | None
    wire_dtype: torch.dtype | None
    integrity: bool | None
    _relay: Relay | None
    _relays_to: Relay | None
    _deferred: tuple[SenderCore, WeightSource, SenderChannel] | None
    _model_layout: Layout
    """The layout of the model's own dtypes (what sources are checked against); ``_layout``
    is the one on the wire, the same unless ``wire_dtype`` casts."""
    _context: Any
    _layout: Layout
    _targets: dict[str, torch.Tensor]
    num_workers: int
    worker_idx: int | None
    _rehome: bool
    _source: ModelSource | None
    _sender: SenderCore | None
    _receiver: ReceiverCore | None
    _tg: anyio.abc.TaskGroup | None
    _bg_scope: anyio.CancelScope | None
    _bg_running: list[anyio.Event]
    _hooks: list[Hook]
    _guard: ReadGuard
    _connected: bool
    _served: str | None
    _bound: tuple[SenderChannel, Any] | None

    _sender_pid: int

    def _check_fresh(self) -> None:
        if self._role == "sender" and self._sender_pid != os.getpid():
            raise RuntimeError(forked_text(self._sender_pid))
        if self._role is not None:
            raise RuntimeError(f"this scheme is already initialised as a {self._role}")

    async def _start_background(
        self, tg: anyio.abc.TaskGroup, loop: Callable[..., Awaitable[None]]
    ) -> None:
        finished = anyio.Event()
        self._bg_running.append(finished)
        scope = self._bg_scope
        assert scope is not None

        async def run(*, task_status: anyio.abc.TaskStatus[None]) -> None:
            try:
                with scope:
                    await loop(task_status=task_status)
            finally:
                finished.set()

        await tg.start(run)
