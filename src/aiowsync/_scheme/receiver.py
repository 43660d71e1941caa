"""The receiver's session: the model it receives into, its layouts, its engine, its relay.

A :class:`ReceiverSession` is made by ``init_on_receiver`` once the arguments are checked,
and lives as long as the scheme; ``connect()`` inside each ``async with`` starts its engine
(:class:`ReceiverCore`) and leaving stops it. The scheme's public methods of the receivers'
role call it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
import torch
from torch import nn

from .._channel import ChannelFactory
from .._exceptions import NotConnectedError, WeightSyncError, WeightSyncTimeout
from .._planes.base import ReceiverContext
from .._protocol import PROTOCOL_VERSION, Hello
from .._receiving.engine import ApplyMode, Hook, ReceiverCore
from .._receiving.guard import ReadGuard
from .._sending.handshake import refuse_oversized
from .._weights.binding import module_targets
from .._weights.flatten import WeightsLike, flatten_weights
from .._weights.layout import Layout, refuse_meta
from .._weights.models import receiver_targets
from .base import SessionOptions, Tasks, forked_text
from .follow import Follower, Rejoin, Target
from .relay import Relay

if TYPE_CHECKING:
    from .sender import SenderSession

__all__ = ["ReceiverSession", "refuse_forked", "tell_sender"]

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


def refuse_forked(
    channels: ChannelFactory, model_id: str, sending: SenderSession, worker_idx: object
) -> NoReturn:
    """This process is a fork of the sender's (``sending``): tell the trainer, so that it
    can say why this worker never connects, then raise with the fix."""
    text = forked_text(sending.pid)
    if isinstance(worker_idx, int) and worker_idx >= 0 and sending.served is not None:
        hello = Hello(
            protocol=PROTOCOL_VERSION,
            model_id=model_id[:256],
            worker_idx=min(worker_idx, 2**31),
            fingerprint=sending.layout.fingerprint,
            pid=os.getpid(),
            host=socket.gethostname()[:256],
            problem=text,
        )
        tell_sender(channels, sending.served, hello, wait=TELL_WAIT_S)
    raise RuntimeError(text)


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
        reconnect: bool | Rejoin = False,
    ) -> None:
        if reconnect is not False and reconnect is not True and not callable(reconnect):
            raise TypeError(
                f"reconnect must be True, False or a function giving the address, got {reconnect!r}"
            )
        if reconnect is not False and not options.background:
            raise ValueError(
                "reconnect= needs background=True: in pull mode the model switches only "
                "inside receive(), so rejoin yourself (leave `async with`, enter it again, "
                "connect())"
            )
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
        refuse_oversized(layout)
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
        self._target = Target(address, options.channels, options.plane)
        self.follows = reconnect is not False
        """Built with ``reconnect=``: follows its sender across restarts."""
        self._where = None if isinstance(reconnect, bool) else reconnect
        self.guard = guard
        self.hooks = hooks
        """The scheme's hooks: registered before or after ``init_on_receiver``."""
        self.relays_to: Relay | None = None
        """Set when this receiver feeds a relay (``scheme.relay_to(local)``)."""
        if several and getattr(plane, "switch", None) == "remap" and self._apply_mode() == "swap":
            raise ValueError(
                "switch='remap' maps one model's slot file over a window, and a version of "
                "several models (models=) spans several files, so its switches would re-bind "
                "each tensor to read-only memory; for models the worker writes into, use "
                "apply_mode='copy' (else switch='rebind' or 'auto')"
            )
        self._core: ReceiverCore | None = None
        self._connecting: ReceiverCore | None = None
        self._follower: Follower | None = None
        self.connected = False
        self._tasks: Tasks | None = None

    @property
    def entered(self) -> bool:
        return self._tasks is not None

    @property
    def switching(self) -> bool:
        """Whether the receiver may switch the model now: inside ``async with``, connected
        or connecting."""
        return self.entered and self.applying is not None

    @property
    def core(self) -> ReceiverCore | None:
        """The engine that drives the model (of the sender followed now, with ``reconnect``)."""
        return self._follower.core if self._follower is not None else self._core

    @property
    def applying(self) -> ReceiverCore | None:
        """:attr:`core`, or while ``connect()`` runs, the engine it connects (whose hooks
        run before it is the core)."""
        return self.core if self.core is not None else self._connecting

    @property
    def address(self) -> str:
        """The sender's address (with ``reconnect``: of the sender followed now, or last)."""
        return self._follower.address if self._follower is not None else self._target.address

    @property
    def ready(self) -> bool:
        """Connected and running a version; with ``reconnect``, also while it waits for a
        new sender (it serves the version it kept)."""
        core = self.core
        if core is None or not self.connected or core.version < 0:
            return False
        return self.follows or core.connected

    def need_core(self) -> ReceiverCore:
        if self.core is None:
            raise RuntimeError("this needs a connected receiver (init_on_receiver + connect)")
        return self.core

    async def start(self, tasks: Tasks) -> None:
        """Enter ``async with``: nothing runs until ``connect()``."""
        self._core = self._follower = None
        self._tasks = tasks

    async def stop(self) -> None:
        """End the session (its background task is stopped already)."""
        self._tasks = None
        self.connected = False
        if self._follower is not None:
            self._target = self._follower.target  # the next `async with` starts there
        if self.core is not None:
            await self.core.close()
        if self._connecting is not None:  # a connect() still waiting: it ends, and says why
            await self._connecting.close()

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
        core = self._connecting = self._make_core(self._target)
        try:
            await core.connect(timeout)
        except Exception:
            if self._tasks is not tasks:
                raise _ended_while_connecting() from None
            raise
        finally:
            self._connecting = None
        if self._tasks is not tasks:
            # The session ended while the handshake went on: this engine must not outlive it
            # (its heartbeats would keep it counted as a ready worker by the sender).
            await core.close()
            raise _ended_while_connecting()
        self._core = core
        self.connected = True
        if not options.background:
            return
        if self.follows:
            self._follower = Follower(
                core,
                self._target,
                make=self._make_core,
                where=self._where,
                timeouts=options.timeouts,
                heartbeats=options.heartbeats,
            )
            await tasks.start(self._follower.run)
        else:
            await tasks.start(core.run)

    def _make_core(self, target: Target, after: ReceiverCore | None = None) -> ReceiverCore:
        """The engine of this receiver for the sender at ``target`` (``after``: the engine of
        the sender it followed before)."""
        options = self.options
        context = ReceiverContext(
            address=target.address, worker_idx=self.worker_idx, tensors=self.targets
        )
        core = ReceiverCore(
            channels=target.channels,
            plane=target.plane.receiver(context),
            layout=self.layout,
            model_layout=self.model_layout,
            targets=self.targets,
            worker_idx=self.worker_idx,
            model_id=options.model_id,
            address=target.address,
            apply_mode=self._apply_mode(),
            timeouts=options.timeouts,
            heartbeats=options.heartbeats,
            guard=self.guard,
            hooks=self.hooks,
            after=after,
        )
        core.shield_updates = not options.background
        return core

    async def wait_for_version(self, version: int, timeout: float) -> int:
        """Wait until the model runs ``version`` or newer; the version it runs then.

        With ``reconnect``, newer means a higher version of the sender followed when the
        wait began, or any version of a later sender (whose numbers start again from 0);
        the wait goes on while the receiver waits for a new sender, until ``timeout``.
        """
        core = self.need_core()
        if not self.follows:
            return await core.wait_for_version(version, timeout)
        generation = core.generation
        try:
            with anyio.fail_after(timeout):
                while True:
                    core = self.need_core()
                    if core.generation > generation or core.version >= version:
                        return core.version
                    if not self.entered:
                        raise NotConnectedError(
                            f"worker {self.worker_idx}: this receiver is closed"
                        )
                    with anyio.move_on_after(self.options.heartbeats.interval):
                        await core.changed()
        except TimeoutError:
            raise WeightSyncTimeout(
                f"worker {self.worker_idx} still runs version {core.version}, not {version}, "
                f"after {timeout:g} s"
                + ("" if core.connected else " (waiting for a sender to rejoin)")
            ) from None


def _ended_while_connecting() -> NotConnectedError:
    return NotConnectedError(
        "the receiver's `async with` ended while connect() waited: nothing is connected"
    )
