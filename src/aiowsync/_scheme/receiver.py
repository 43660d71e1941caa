"""The receiver's session: the model it receives into, its layouts, its engine, its relay.

A :class:`ReceiverSession` is made by ``init_on_receiver`` once the arguments are checked,
and lives as long as the scheme; ``connect()`` inside each ``async with`` starts its engine
(:class:`ReceiverCore`) and leaving stops it. The scheme's public methods of the receivers'
role call it.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import anyio
import torch
from torch import nn

from .._channel import ChannelFactory
from .._exceptions import WeightSyncError
from .._planes.base import ReceiverContext
from .._protocol import Hello
from .._receiving.engine import ApplyMode, Hook, ReceiverCore
from .._receiving.guard import ReadGuard
from .._weights.binding import module_targets
from .._weights.flatten import WeightsLike, flatten_weights
from .._weights.layout import Layout, refuse_meta
from .._weights.models import receiver_targets
from .base import SessionOptions, Tasks
from .relay import Relay

__all__ = ["ReceiverSession", "tell_sender"]

TELL_WAIT_S = 2.0
"""How long a process that cannot be a receiver spends telling the trainer why."""


def tell_sender(channels: ChannelFactory, address: str, hello: Hello, *, wait: float) -> None:
    """Best effort, blocking at most about ``wait`` seconds: hand ``hello`` (which names a
    problem) to the sender at ``address`` and wait for its refusal, so that the trainer can
    say why this worker never connects. Runs its own event loop in a thread: the caller may
    be inside one."""

    async def run() -> None:
        channel = channels.connect(address, heartbeat_timeout=wait)
        try:
            await channel.send(hello, timeout=wait)
            with contextlib.suppress(WeightSyncError):
                await channel.recv(timeout=wait)  # the refusal: the sender has read it
        finally:
            channel.close()

    def target() -> None:
        with contextlib.suppress(Exception):
            anyio.run(run)

    thread = threading.Thread(target=target, name="aiowsync-tell-sender", daemon=True)
    thread.start()
    thread.join(wait * 2 + 1)


class ReceiverSession:
    """The receivers' role of a scheme (see the module)."""

    def __init__(
        self,
        options: SessionOptions,
        *,
        model: Any,
        models: dict[str, WeightsLike] | None,
        context: Any,
        worker_idx: int,
        address: str,
        wire_dtype: torch.dtype | None,
        guard: ReadGuard,
        hooks: list[Hook],
    ) -> None:
        if models is not None:
            targets = receiver_targets(models)
        elif isinstance(model, nn.Module):
            targets = module_targets(model)
        else:
            targets = flatten_weights(model, detach=False)  # the user's own tensor objects
        refuse_meta(targets, "they hold no memory to receive into")
        several = models is not None
        model_layout = Layout.from_weights(targets, sectioned=several)
        layout = Layout.from_weights(targets, sectioned=several, wire_dtype=wire_dtype)
        plane = options.plane
        if options.apply_mode == "swap" and layout != model_layout:
            cast = next(
                s
                for s, w in zip(model_layout.specs, layout.specs, strict=True)
                if s.dtype != w.dtype
            )
            raise ValueError(
                f"apply_mode='swap' needs the model to hold the wire dtype {wire_dtype}, "
                f"and {cast.key} is {cast.dtype}; use apply_mode='copy' (or 'auto', which "
                "picks it) to copy each version with a cast"
            )
        if options.apply_mode == "swap" and not plane.can_swap(targets):
            devices = sorted({str(t.device) for t in targets.values()})
            raise ValueError(
                f"apply_mode='swap' would re-point a model on {', '.join(devices)} at memory "
                f"of another device ({type(plane).__name__}); use apply_mode='copy' "
                "(or 'auto', which picks it)"
            )
        self.options = options
        self.targets = targets
        self.layout, self.model_layout = layout, model_layout
        self.model, self.models, self.context = model, models, context
        self.worker_idx = worker_idx
        self.address = address
        self.guard = guard
        self.hooks = hooks
        """The scheme's hooks: registered before or after ``init_on_receiver``."""
        self.relays_to: Relay | None = None
        """Set when this receiver feeds a relay (``scheme.relay_to(local)``)."""
        self.core: ReceiverCore | None = None
        self.connected = False
        self._tasks: Tasks | None = None

    @property
    def entered(self) -> bool:
        return self._tasks is not None

    @property
    def ready(self) -> bool:
        core = self.core
        return core is not None and self.connected and core.version >= 0 and core.connected

    def need_core(self) -> ReceiverCore:
        if self.core is None:
            raise RuntimeError("this needs a connected receiver (init_on_receiver + connect)")
        return self.core

    async def start(self, tasks: Tasks) -> None:
        """Enter ``async with``: nothing runs until ``connect()``."""
        self.core = None
        self._tasks = tasks

    async def stop(self) -> None:
        """End the session (its background task is stopped already)."""
        self._tasks = None
        self.connected = False
        if self.core is not None:
            await self.core.close()

    def _apply_mode(self) -> ApplyMode:
        if self.options.apply_mode != "auto":
            return self.options.apply_mode
        devices = {t.device.type for t in self.targets.values()}
        can_swap = (
            devices <= {"cpu"}
            and self.options.plane.can_swap(self.targets)
            and self.layout == self.model_layout  # a wire dtype of its own: copy
        )
        return "swap" if can_swap else "copy"

    async def connect(self, timeout: float) -> None:
        """Handshake, apply the current version and start the background task."""
        if self.core is not None:
            raise RuntimeError("this receiver is already connected")
        tasks = self._tasks
        assert tasks is not None
        options = self.options
        context = ReceiverContext(
            address=self.address, worker_idx=self.worker_idx, tensors=self.targets
        )
        core = ReceiverCore(
            channels=options.channels,
            plane=options.plane.receiver(context),
            layout=self.layout,
            model_layout=self.model_layout,
            targets=self.targets,
            worker_idx=self.worker_idx,
            model_id=options.model_id,
            address=self.address,
            apply_mode=self._apply_mode(),
            timeouts=options.timeouts,
            heartbeats=options.heartbeats,
            guard=self.guard,
            hooks=self.hooks,
        )
        core.shield_updates = not options.background
        await core.connect(timeout)
        self.core = core
        self.connected = True
        if options.background:
            await tasks.start(core.run)
