"""The public scheme: one object per model, used on the sender and on each receiver."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Literal, TypedDict

import anyio
import anyio.abc
import torch
from tensordict import TensorDictBase
from torch import nn

from ._channel import ChannelFactory, SenderChannel, ZmqChannelFactory, resolve_local
from ._config import Heartbeats, Timeouts
from ._exceptions import TransportError
from ._guard import ReadGuard
from ._layout import Layout, module_targets, refuse_meta
from ._plane import DataPlane, ReceiverContext, SenderContext, WeightSource
from ._receiver import ApplyMode, Hook, ReceiverCore
from ._sender import SenderCore, SendResult
from ._source import ModelSource, WeightsSource
from ._strategy import StrategyName, WeightStrategy
from ._weights import WeightsLike, flatten_weights

__all__ = ["SchemeOptions", "WeightSyncScheme"]

log = logging.getLogger("aiowsync")

STOP_WAIT_S = 10.0
"""How long leaving ``async with`` waits for the background tasks to end (each of their own
waits has a shorter deadline)."""


class SchemeOptions(TypedDict, total=False):
    """The keyword arguments every scheme takes (see :class:`WeightSyncScheme`)."""

    strategy: StrategyName
    model_id: str
    bind: str
    timeouts: Timeouts | None
    heartbeats: Heartbeats | None
    channels: ChannelFactory | None
    apply_mode: Literal["auto", "swap", "copy"]
    background: bool

_Role = Literal["sender", "receiver"]


def _resolve_model(context: Any, model_id: str) -> Any:
    getter = getattr(context, "get_model", None)
    if callable(getter):
        return getter(model_id)
    obj = context
    for part in model_id.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


class WeightSyncScheme:
    """Synchronises ONE model from a sender to ``num_workers`` receivers.

    Configure it once, then call :meth:`init_on_sender` in the trainer or
    :meth:`init_on_receiver` in a worker. The object pickles to its configuration and address
    only, so the trainer can hand it to a spawned worker.

    :class:`SharedMemWeightSyncScheme` and :class:`DistributedWeightSyncScheme` are this class
    with their data plane chosen; build it directly to pick a plane yourself, e.g. the
    in-process twins for tests:
    ``WeightSyncScheme(plane=MemoryPlane(), channels=MemoryChannelFactory())``.

    Args:
        address: the sender's control address; needed on a receiver that was not handed a
            pickled scheme.
        plane: the data plane that carries the bytes (see :class:`DataPlane`).
        strategy: ``"tensordict"`` (default) or ``"state_dict"``: the format
            :meth:`extract_weights` returns.
        model_id: names the model; sender and receivers must agree.
        bind: where the sender binds its control socket (loopback by default).
        timeouts: named deadlines, see :class:`Timeouts`.
        heartbeats: liveness settings, see :class:`Heartbeats`.
        channels: the control-channel factory (ZeroMQ by default; the in-memory twin in tests).
        apply_mode: receivers only: ``"swap"`` re-points the model at the shared copy (no bytes
            copied), ``"copy"`` keeps private tensors and copies each version into them;
            ``"auto"`` picks swap for CPU models and copy otherwise.
        background: receivers only: apply updates from a background task (default) or leave
            it to :meth:`receive` (pull mode).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        plane: DataPlane,
        strategy: StrategyName = "tensordict",
        model_id: str = "policy",
        bind: str = "tcp://127.0.0.1:0",
        timeouts: Timeouts | None = None,
        heartbeats: Heartbeats | None = None,
        channels: ChannelFactory | None = None,
        apply_mode: Literal["auto", "swap", "copy"] = "auto",
        background: bool = True,
    ) -> None:
        if apply_mode not in ("auto", "swap", "copy"):
            raise ValueError(f"apply_mode must be 'auto', 'swap' or 'copy', got {apply_mode!r}")
        if not isinstance(plane, DataPlane):
            raise TypeError(f"plane must be a DataPlane, got {type(plane).__name__}")
        self.plane = plane
        self._address = address
        self._strategy = WeightStrategy(strategy)
        self.model_id = model_id
        self.bind = bind
        self.timeouts = timeouts or Timeouts()
        self.heartbeats = heartbeats or Heartbeats()
        self.channels = channels or ZmqChannelFactory()
        self.apply_mode: Literal["auto", "swap", "copy"] = apply_mode
        self.background = background
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._role: _Role | None = None
        self._model: Any = None
        self._weights: WeightsLike | None = None
        self._context: Any = None
        self.num_workers = 0
        self.worker_idx: int | None = None
        self._rehome = False
        self._source: ModelSource | None = None
        """Where ``send()`` takes the weights from when given none (while serving)."""
        self._sender: SenderCore | None = None
        self._receiver: ReceiverCore | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._bg_scope: anyio.CancelScope | None = None
        self._bg_running: list[anyio.Event] = []
        self._hooks: list[Hook] = []
        self._guard = ReadGuard()
        self._connected = False
        self._served: str | None = None
        """The address this sender serves on (bound early, or by its last session)."""
        self._bound: tuple[SenderChannel, weakref.finalize[Any, Any]] | None = None
        """A control socket bound before ``async with`` (reading ``address``), and its
        closer."""

    # -- pickling: configuration and address only ---------------------------------------------

    _CONFIG: tuple[str, ...] = (
        "plane",
        "_address",
        "_strategy",
        "model_id",
        "bind",
        "timeouts",
        "heartbeats",
        "channels",
        "apply_mode",
        "background",
    )

    def __getstate__(self) -> dict[str, Any]:
        state = {name: getattr(self, name) for name in self._CONFIG}
        state["_strategy"] = self._strategy.extract_as
        if self._role == "sender":
            state["_address"] = self.address  # binds now if nothing is bound yet
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        strategy = state.pop("_strategy")
        self.__dict__.update(state)
        self._strategy = WeightStrategy(strategy)
        self._reset_runtime()

    # -- properties ---------------------------------------------------------------------------

    @property
    def strategy(self) -> WeightStrategy:
        """The weight format helper behind ``extract_weights`` and ``apply_weights``."""
        return self._strategy

    @property
    def address(self) -> str:
        """The sender's bound control address (on a receiver: the address it connects to).

        On a sender it can be read as soon as ``init_on_sender()`` returned: the control socket
        is then bound at once (a free port is chosen if ``bind`` names port 0, a fresh socket
        name for ``ipc://@*``), and ``async with`` serves on it. Later ``async with`` sessions
        of the same object serve on it again when it can be had (else on a fresh one, with a
        warning).
        """
        if self._sender is not None and self._sender.channel is not None:
            return self._sender.address
        if self._role == "sender":
            if self._served is None:
                self._bind_early()
            assert self._served is not None
            return self._served
        if self._address is None:
            raise RuntimeError(
                "no address: call init_on_sender() first, or give a receiver address="
            )
        return self._address

    def _bind_early(self) -> None:
        channel = self.channels.bind(
            resolve_local(self.bind), heartbeat_timeout=self.heartbeats.timeout
        )
        self._served = channel.address
        # Closed by the sender it is handed to, or when this object goes unused.
        self._bound = channel, weakref.finalize(self, channel.close)

    def _bind_again(self) -> SenderChannel:
        """The control socket of a new session: on the address already handed out when it can
        be had again, else on ``bind`` afresh (a forked child may still hold the old port)."""
        timeout = self.heartbeats.timeout
        if self._served is not None:
            try:
                return self.channels.bind(self._served, heartbeat_timeout=timeout)
            except TransportError as exc:
                log.warning(
                    "cannot serve on %s again (%s); binding %s instead: workers need the new "
                    "address",
                    self._served,
                    exc,
                    self.bind,
                )
        return self.channels.bind(resolve_local(self.bind), heartbeat_timeout=timeout)

    def _take_bound(self) -> SenderChannel | None:
        bound, self._bound = self._bound, None
        if bound is None:
            return None
        channel, finalizer = bound
        finalizer.detach()
        return channel

    @property
    def initialized_on_sender(self) -> bool:
        """Whether ``init_on_sender()`` was called."""
        return self._role == "sender"

    @property
    def initialized_on_receiver(self) -> bool:
        """Whether ``init_on_receiver()`` was called."""
        return self._role == "receiver"

    @property
    def model(self) -> Any:
        """The model or weights given to ``init_on_*`` (``None`` before)."""
        return self._model

    @property
    def context(self) -> Any:
        """The ``context=`` given to ``init_on_*``, if any."""
        return self._context

    @property
    def version(self) -> int:
        """Sender: the latest version sent. Receiver: the version its model runs (-1 before)."""
        if self._sender is not None:
            return self._sender.version
        if self._receiver is not None:
            return self._receiver.version
        return -1

    @property
    def ready(self) -> bool:
        """Receiver: connected and running at least the version it was welcomed with."""
        r = self._receiver
        return r is not None and self._connected and r.version >= 0 and r.connected

    @property
    def connected(self) -> bool:
        """Receiver: the sender is reachable. Sender: the sender is serving."""
        if self._receiver is not None:
            return self._connected and self._receiver.connected
        return self._sender is not None and self._tg is not None

    @property
    def dropped_messages(self) -> int:
        """Control messages dropped as malformed, unknown or out of state."""
        if self._sender is not None:
            channel = self._sender.channel
            return self._sender.dropped + (channel.dropped if channel is not None else 0)
        return self._receiver.dropped if self._receiver is not None else 0

    # -- initialisation -----------------------------------------------------------------------

    def init_on_sender(
        self,
        model: nn.Module | TensorDictBase | dict[str, torch.Tensor] | None = None,
        *,
        weights: WeightsLike | None = None,
        num_workers: int | None = None,
        model_id: str | None = None,
        context: Any = None,
        rehome: bool = False,
    ) -> None:
        """Prepare this object as the sender.

        Args:
            model: the model whose weights ``send()`` takes by default.
            weights: a ``TensorDict`` or state_dict instead of a model.
            num_workers: how many receivers (indices ``0 .. num_workers-1``).
            model_id: overrides the constructor's ``model_id``.
            context: an object that can resolve ``model_id`` to a model (seed-style); its
                ``num_workers`` is used when ``num_workers`` is not given.
            rehome: re-home the model's tensors as views of one private flat buffer so that a
                snapshot is a single memcpy (tensor identity is kept, so optimizers keep
                working); falls back to per-tensor fused copies if the model cannot be re-homed.
        """
        self._check_fresh()
        if model_id is not None:
            self.model_id = model_id
        if model is None and weights is None and context is not None:
            model = _resolve_model(context, self.model_id)
        if model is None and weights is None:
            raise ValueError("init_on_sender needs model=, weights= or a context holding the model")
        if model is not None and weights is not None:
            raise ValueError("give model= or weights=, not both")
        if num_workers is None and context is not None:
            num_workers = getattr(context, "num_workers", None)
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        flat = flatten_weights(model if model is not None else weights)  # type: ignore[arg-type]
        refuse_meta(flat, "they hold no values to send")
        self._layout = Layout.from_weights(flat)
        self._model, self._weights, self._context = model, weights, context
        self.num_workers = num_workers
        self._rehome = rehome
        self._role = "sender"

    def init_on_receiver(
        self,
        model: nn.Module | TensorDictBase | dict[str, torch.Tensor] | None = None,
        *,
        worker_idx: int,
        model_id: str | None = None,
        context: Any = None,
    ) -> None:
        """Prepare this object as receiver ``worker_idx`` for ``model``.

        ``model`` is a module, a ``TensorDict`` or a state_dict whose tensors will be made to
        hold each new version (swap mode re-points them, copy mode copies into them).
        """
        self._check_fresh()
        if model_id is not None:
            self.model_id = model_id
        if model is None and context is not None:
            model = _resolve_model(context, self.model_id)
        if model is None:
            raise ValueError("init_on_receiver needs model= (or a context holding the model)")
        if not isinstance(worker_idx, int) or isinstance(worker_idx, bool) or worker_idx < 0:
            raise ValueError(f"worker_idx must be a non-negative integer, got {worker_idx!r}")
        if self._address is None:
            raise ValueError("a receiver needs the sender's address: pass address= or unpickle it")
        self._targets = (
            module_targets(model)
            if isinstance(model, nn.Module)
            else flatten_weights(model, detach=False)  # the user's own tensor objects
        )
        refuse_meta(self._targets, "they hold no memory to receive into")
        self._layout = Layout.from_weights(self._targets)
        self._model, self._context = model, context
        self.worker_idx = worker_idx
        self._role = "receiver"

    def _check_fresh(self) -> None:
        if self._role is not None:
            raise RuntimeError(f"this scheme is already initialised as a {self._role}")

    # -- async life cycle ---------------------------------------------------------------------

    async def __aenter__(self) -> WeightSyncScheme:
        if self._role is None:
            raise RuntimeError("call init_on_sender() or init_on_receiver() before `async with`")
        if self._tg is not None:
            raise RuntimeError("this scheme is already running")
        self._bg_scope = anyio.CancelScope()
        self._bg_running = []
        self._sender = self._receiver = None  # a new session of this scheme
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        try:
            if self._role == "sender":
                await self._start_sender(tg)
        except BaseException as exc:
            await self._stop(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._stop(exc_type, exc, tb)

    async def _stop(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg, self._tg = self._tg, None
        try:
            # Background loops stop first, so that closing the channel surprises no reader.
            if self._bg_scope is not None:
                self._bg_scope.cancel()
            with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_WAIT_S):
                for finished in self._bg_running:
                    await finished.wait()
            if self._sender is not None:
                await self._sender.close()
            if self._receiver is not None:
                await self._receiver.close()
        finally:
            self._connected = False
            if self._source is not None:
                self._source.close()
                self._source = None
            suppress = None
            if tg is not None:
                tg.cancel_scope.cancel()
                # The body's own exception is not handed to the task group, which would wrap
                # it in an ExceptionGroup; it propagates unchanged once the group has closed.
                if not isinstance(exc, anyio.get_cancelled_exc_class()):
                    exc_type, exc, tb = None, None, None
                suppress = await tg.__aexit__(exc_type, exc, tb)
        return suppress

    async def _start_sender(self, tg: anyio.abc.TaskGroup) -> None:
        channel = self._take_bound() or self._bind_again()
        try:
            weights = self._model if self._model is not None else self._weights
            flat = flatten_weights(weights)  # type: ignore[arg-type]
            sender = SenderCore(
                plane=self.plane.sender(
                    SenderContext(bind=self.bind, tensors=flat, timeouts=self.timeouts)
                ),
                layout=self._layout,
                num_workers=self.num_workers,
                model_id=self.model_id,
                timeouts=self.timeouts,
                heartbeats=self.heartbeats,
            )
            if isinstance(self._model, nn.Module):
                self._source = ModelSource(self._model, self._layout, rehome_it=self._rehome)
            initial = self._source or self._source_of(None)
        except BaseException:
            channel.close()
            raise
        await sender.start(initial, channel)  # closes the channel if it fails
        self._sender = sender
        self._served = sender.address  # what later sessions try to serve on again
        await self._start_background(tg, sender.serve)

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

    # -- sender API ---------------------------------------------------------------------------

    def _source_of(self, weights: WeightsLike | str | None) -> WeightSource:
        if weights is None:
            if self._source is not None:
                return self._source
            weights = self._model if self._model is not None else self._weights
        elif self._context is not None and isinstance(weights, str):
            weights = _resolve_model(self._context, weights)
        return WeightsSource(weights, self._layout)  # type: ignore[arg-type]

    async def connect(self, timeout: float | None = None) -> None:
        """Sender: wait until every worker holds version 0 (or the latest version).

        Receiver: handshake, apply the current version and start the background task.
        """
        timeout = self.timeouts.handshake if timeout is None else timeout
        if self._tg is None:
            raise RuntimeError("use `async with scheme:` before connect()")
        if self._sender is not None:
            await self._sender.wait_ready(timeout)
            self._connected = True
            return
        if self._receiver is not None:
            raise RuntimeError("this receiver is already connected")
        assert self.worker_idx is not None and self._address is not None
        mode: ApplyMode
        if self.apply_mode == "auto":
            devices = {t.device.type for t in self._targets.values()}
            mode = "swap" if devices <= {"cpu"} else "copy"
        else:
            mode = self.apply_mode
        context = ReceiverContext(
            address=self._address, worker_idx=self.worker_idx, tensors=self._targets
        )
        receiver = ReceiverCore(
            channels=self.channels,
            plane=self.plane.receiver(context),
            layout=self._layout,
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
            await self._start_background(self._tg, receiver.run)

    async def send(
        self,
        weights: WeightsLike | str | None = None,
        worker_ids: int | Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> SendResult:
        """Stage the weights as a new version and wait until every targeted worker runs it.

        Args:
            weights: what to send; by default the model (or weights) given at init.
            worker_ids: one index or several; by default every worker.
            timeout: deadline for the whole call; by default ``timeouts.transfer`` for staging
                and ``timeouts.ack`` for the acknowledgements.

        Raises:
            WorkerLostError: at once, if a targeted worker is known to be lost.
            LostDuringSendError: a targeted worker was lost while the send waited for it
                (also a ``WorkerLostError`` and a ``WeightSyncTimeout``).
            WeightSyncTimeout: a targeted worker did not acknowledge by the deadline.
            RemoteApplyError: a worker failed to apply the version (its error text included).
            LayoutMismatchError: ``weights`` do not match the layout (nothing was written).
            WeightSyncError: every shared-memory slot holds a version still in use, or the
                sender shut down while the version was being staged.
            TransportError: a new slot could not be created (``/dev/shm`` full).
            ValueError: ``worker_ids`` out of range, repeated or empty.
            RuntimeError: called outside ``async with``, or on a receiver.

        Concurrent calls are served one at a time in call order.
        """
        sender = self._sender
        if sender is None or self._tg is None:
            raise RuntimeError("send() needs an initialised sender inside `async with scheme`")
        targets = self._targets_of(worker_ids)
        if weights is not None and weights is self._model and self._source is not None:
            # The model given at init, passed again: the same as send(), whose watch knows its
            # tensors without walking the model.
            weights = None
        if timeout is None:
            stage_limit, ack_limit, deadline = self.timeouts.transfer, self.timeouts.ack, None
        else:
            stage_limit = ack_limit = timeout
            deadline = time.monotonic() + timeout
        return await sender.send(
            self._source_of(weights),
            targets,
            stage_limit=stage_limit,
            ack_limit=ack_limit,
            deadline=deadline,
        )

    def _targets_of(self, worker_ids: int | Sequence[int] | None) -> list[int]:
        if worker_ids is None:
            return list(range(self.num_workers))
        ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        if not ids:
            raise ValueError("worker_ids is empty: name at least one worker, or pass None for all")
        for w in ids:
            if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w < self.num_workers:
                raise ValueError(f"worker id {w!r} is not in range(0, {self.num_workers})")
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker_ids has duplicates: {ids}")
        return sorted(ids)

    def extract_weights(self, source: WeightsLike | None = None) -> Any:
        """The weights of ``source`` (default: the sender's model) in the strategy's format."""
        src = source
        if src is None:
            # Not `or`: a TensorDict refuses to be read as a boolean.
            src = self._model if self._model is not None else self._weights
        if src is None:
            raise RuntimeError("no model to extract weights from")
        return self._strategy.extract_weights(src)

    # -- receiver API -------------------------------------------------------------------------

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

    def apply_weights(self, weights: WeightsLike, inplace: bool = True) -> None:
        """Apply weights to the receiver's model directly with the strategy (no versioning)."""
        if self._role != "receiver":
            raise RuntimeError("apply_weights() is for receivers")
        self._strategy.apply_weights(self._model, weights, inplace=inplace)
