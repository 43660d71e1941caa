"""The receivers' half of the scheme's API: connecting, versions, hooks and the guard."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import torch
from tensordict import TensorDictBase
from torch import nn

from .._channel import ChannelFactory
from .._exceptions import WeightSyncError
from .._planes.base import ReceiverContext
from .._protocol import PROTOCOL_VERSION, Hello
from .._receiving.engine import ApplyMode, Hook, ReceiverCore
from .._receiving.guard import ReadGuard
from .._receiving.lease import Lease
from .._weights.binding import module_targets
from .._weights.flatten import WeightsLike, flatten_weights
from .._weights.layout import Layout, refuse_meta
from .._weights.models import check_models, models_id, receiver_targets, sender_weights
from .base import SchemeState, forked_text, resolve_model
from .relay import Relay

if TYPE_CHECKING:
    from .scheme import WeightSyncScheme

__all__ = ["ReceiverSide", "tell_sender"]

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


class ReceiverSide(SchemeState):
    def init_on_receiver(
        self,
        model: nn.Module | TensorDictBase | dict[str, torch.Tensor] | None = None,
        *,
        worker_idx: int,
        weights: TensorDictBase | dict[str, torch.Tensor] | None = None,
        models: Mapping[str, WeightsLike] | None = None,
        model_id: str | None = None,
        context: Any = None,
    ) -> None:
        """Prepare this object as receiver ``worker_idx`` for ``model``.

        ``model`` is a module, a ``TensorDict`` or a state_dict whose tensors will be made to
        hold each new version (swap mode re-points them, copy mode copies into them);
        ``weights=`` takes a ``TensorDict`` or state_dict instead, as on the sender;
        ``models=`` several models by model id, as the sender gave them.
        """
        if self._role == "sender" and self._sender_pid != os.getpid():
            self._refuse_forked(worker_idx)
        self._check_fresh()
        self._models = None  # nothing of an earlier call that failed stays
        several = models is not None
        if models is not None:
            if model is not None or weights is not None:
                raise ValueError("give models= alone, or model= (or weights=) for one model")
            checked = check_models(models)
            self._models = checked
            self.model_id = models_id(checked)
            holder, together = sender_weights(checked)
            model = holder if holder is not None else together  # type: ignore[assignment]
        elif model_id is not None:
            self.model_id = model_id
        if model is not None and weights is not None:
            raise ValueError("give model= or weights=, not both")
        if model is None:
            model = weights
        if model is None and context is not None:
            model = resolve_model(context, self.model_id)
        if model is None:
            raise ValueError(
                "init_on_receiver needs model=, weights= or a context holding the model"
            )
        if not isinstance(worker_idx, int) or isinstance(worker_idx, bool) or worker_idx < 0:
            raise ValueError(f"worker_idx must be a non-negative integer, got {worker_idx!r}")
        if self._address is None:
            raise ValueError("a receiver needs the sender's address: pass address= or unpickle it")
        if self._models is not None:
            self._targets = receiver_targets(self._models)
        else:
            self._targets = (
                module_targets(model)
                if isinstance(model, nn.Module)
                else flatten_weights(model, detach=False)  # the user's own tensor objects
            )
        refuse_meta(self._targets, "they hold no memory to receive into")
        self._model_layout = Layout.from_weights(self._targets, sectioned=several)
        self._layout = Layout.from_weights(
            self._targets, sectioned=several, wire_dtype=self.wire_dtype
        )
        if self.apply_mode == "swap" and self._layout != self._model_layout:
            cast = next(
                s
                for s, w in zip(self._model_layout.specs, self._layout.specs, strict=True)
                if s.dtype != w.dtype
            )
            raise ValueError(
                f"apply_mode='swap' needs the model to hold the wire dtype {self.wire_dtype}, "
                f"and {cast.key} is {cast.dtype}; use apply_mode='copy' (or 'auto', which "
                "picks it) to copy each version with a cast"
            )
        if self.apply_mode == "swap" and not self.plane.can_swap(self._targets):
            devices = sorted({str(t.device) for t in self._targets.values()})
            raise ValueError(
                f"apply_mode='swap' would re-point a model on {', '.join(devices)} at memory "
                f"of another device ({type(self.plane).__name__}); use apply_mode='copy' "
                "(or 'auto', which picks it)"
            )
        self._model, self._context = model, context
        self.worker_idx = worker_idx
        self._role = "receiver"

    def _refuse_forked(self, worker_idx: object) -> None:
        """This process is a fork of the sender's: tell the trainer (it can say why this
        worker never connects), then raise with the fix."""
        text = forked_text(self._sender_pid)
        if isinstance(worker_idx, int) and worker_idx >= 0 and self._served is not None:
            hello = Hello(
                protocol=PROTOCOL_VERSION,
                model_id=self.model_id[:256],
                worker_idx=min(worker_idx, 2**31),
                fingerprint=self._layout.fingerprint,
                pid=os.getpid(),
                host=socket.gethostname()[:256],
                problem=text,
            )
            tell_sender(self.channels, self._served, hello, wait=TELL_WAIT_S)
        raise RuntimeError(text)

    def _need_receiver(self) -> ReceiverCore:
        if self._receiver is None:
            raise RuntimeError("this needs a connected receiver (init_on_receiver + connect)")
        return self._receiver

    async def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Wait until the model runs ``version`` or newer; returns the version it runs."""
        timeout = self.timeouts.ack if timeout is None else timeout
        return await self._need_receiver().wait_for_version(version, timeout)

    async def receive(self, timeout: float | None = None) -> int | None:
        """Pull mode: apply the next update arriving within ``timeout``; its version, or None."""
        if self.background:
            raise RuntimeError("receive() is for pull mode: build the scheme with background=False")
        timeout = self.timeouts.ack if timeout is None else timeout
        return await self._need_receiver().receive(timeout)

    def relay_to(self, local: WeightSyncScheme) -> None:
        """Forward every version this receiver applies to ``local``'s workers (its leaves).

        ``local`` is a scheme initialised as sender on the same model (typically
        :class:`SharedMemWeightSyncScheme` for the workers of this host). Each version this
        receiver switches to is staged from the model into ``local`` (one copy) and sent to
        its leaves under the same version number; this receiver acknowledges it only once
        every leaf holds it, and otherwise nacks, naming the leaves that do not. ``local``
        serves nothing until this receiver holds a version (its leaves' ``connect()`` waits
        until then). Call it after both ``init_on_*`` calls, before entering either scheme;
        enter them in either order. See the relays guide.
        """
        if self._role != "receiver":
            raise RuntimeError("relay_to() is called on the receiver that feeds the relay")
        if getattr(local, "_role", None) != "sender":
            raise ValueError("relay_to() needs a scheme initialised with init_on_sender()")
        if local is self:
            raise ValueError("a scheme cannot relay to itself")
        ours = self._models if self._models is not None else self._model
        theirs = local._models if local._models is not None else local._model
        same = ours is theirs or (
            isinstance(ours, dict)
            and isinstance(theirs, dict)
            and ours.keys() == theirs.keys()
            and all(ours[k] is theirs[k] for k in ours)
        )
        if ours is None or not same:
            raise ValueError(
                "relay_to() needs `local` initialised as sender on the very model (or models) "
                "this receiver was initialised on: the relay stages what it receives from it"
            )
        if self._tg is not None or local._tg is not None:
            raise RuntimeError("call relay_to() before entering either scheme")
        if local._relay is not None or self._relays_to is not None:
            raise RuntimeError("each scheme takes part in one relay")
        relay = Relay(self, local)  # type: ignore[arg-type]
        self._relays_to = relay
        local._relay = relay
        self._hooks.append(relay.forward)

    def register_hook(self, hook: Hook) -> None:
        """Call ``hook(version)`` (sync or async) right after each switch, before the ack."""
        if self._role == "sender":
            raise RuntimeError("hooks run on receivers")
        self._hooks.append(hook)

    def read_guard(self) -> ReadGuard:
        """The guard a forward holds (``with`` in threads, ``async with`` on the loop) so that
        no switch happens under it."""
        if self._role == "sender":
            raise RuntimeError("the read guard belongs to receivers")
        return self._guard

    def lease(self) -> Lease:
        """A lease on the version the model runs when it is entered (``async with`` on the
        receiver's loop, ``with`` in threads): ``held.version``, and ``held.weights`` with
        that version's exact bytes until the block ends, while the model goes on switching
        to newer versions. See the serving guide for what it costs on each transport."""
        if self._role == "sender":
            raise RuntimeError("leases are taken on receivers")
        return Lease(self._need_receiver().leases)

    def apply_weights(self, weights: WeightsLike, inplace: bool = True) -> None:
        """Apply weights to the receiver's model directly with the strategy (no versioning)."""
        if self._role != "receiver":
            raise RuntimeError("apply_weights() is for receivers")
        self._strategy.apply_weights(self._model, weights, inplace=inplace)

    async def _connect_receiver(self, tg: anyio.abc.TaskGroup, timeout: float) -> None:
        if self._receiver is not None:
            raise RuntimeError("this receiver is already connected")
        assert self.worker_idx is not None and self._address is not None
        mode: ApplyMode
        if self.apply_mode == "auto":
            devices = {t.device.type for t in self._targets.values()}
            can_swap = (
                devices <= {"cpu"}
                and self.plane.can_swap(self._targets)
                and self._layout == self._model_layout  # a wire dtype of its own: copy
            )
            mode = "swap" if can_swap else "copy"
        else:
            mode = self.apply_mode
        context = ReceiverContext(
            address=self._address, worker_idx=self.worker_idx, tensors=self._targets
        )
        receiver = ReceiverCore(
            channels=self.channels,
            plane=self.plane.receiver(context),
            layout=self._layout,
            model_layout=self._model_layout,
            targets=self._targets,
            worker_idx=self.worker_idx,
            model_id=self.model_id,
            address=self._address,
            apply_mode=mode,
            timeouts=self.timeouts,
            heartbeats=self.heartbeats,
            guard=self._guard,
            hooks=self._hooks,
        )
        receiver.shield_updates = not self.background
        await receiver.connect(timeout)
        self._receiver = receiver
        self._connected = True
        if self.background:
            await self._start_background(tg, receiver.run)
