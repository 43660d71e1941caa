"""The public scheme: one object per model, used on the sender and on each receiver."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping
from types import MappingProxyType, TracebackType
from typing import Any, Literal, TypedDict

import anyio
import anyio.abc
import torch

from .._channel import ChannelFactory, SenderChannel, ZmqChannelFactory
from .._config import Heartbeats, Timeouts
from .._planes.base import DataPlane, WeightSource
from .._receiving.engine import Hook, ReceiverCore
from .._receiving.guard import ReadGuard
from .._sending.engine import SenderCore
from .._sending.source import ModelSource
from .._sending.workers import WorkerTable
from .._weights.flatten import WeightsLike
from .._weights.strategy import StrategyName, WeightStrategy
from .base import Role
from .receiver import ReceiverSide
from .relay import Relay
from .sender import SenderSide

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
    wire_dtype: torch.dtype | None
    integrity: bool | None


class WeightSyncScheme(SenderSide, ReceiverSide):
    """Synchronises a model (or several, as one) from a sender to ``num_workers`` receivers.

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
        wire_dtype: a floating dtype (e.g. ``torch.bfloat16``) that floating tensors travel
            in: the sender casts them when it stages a version, integer and bool tensors
            travel as they are. The same on both sides (it pickles with the scheme). A
            receiver whose model holds that dtype swaps as usual; one holding another copies
            each version with a cast.
        integrity: senders only: carry a digest (XXH3) of each version's bytes in its
            update, which every receiver checks before it switches; a receiver whose bytes
            differ nacks, naming the bucket, and keeps its version. ``None`` (default) takes
            the data plane's choice: on for torch.distributed, off on one host (shared
            memory, in-process), where it would cost about as much as the send.
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
        wire_dtype: torch.dtype | None = None,
        integrity: bool | None = None,
    ) -> None:
        if wire_dtype is not None and (
            not isinstance(wire_dtype, torch.dtype) or not wire_dtype.is_floating_point
        ):
            raise ValueError(
                f"wire_dtype must be a floating torch dtype (torch.bfloat16, torch.float16, "
                f"...), got {wire_dtype!r}"
            )
        if integrity is not None and not isinstance(integrity, bool):
            raise TypeError(f"integrity must be True, False or None, got {integrity!r}")
        if apply_mode not in ("auto", "swap", "copy"):
            raise ValueError(f"apply_mode must be 'auto', 'swap' or 'copy', got {apply_mode!r}")
        if not isinstance(plane, DataPlane):
            raise TypeError(f"plane must be a DataPlane, got {type(plane).__name__}")
        channels = channels or ZmqChannelFactory()
        channels.check_address(bind, bind=True)
        if address is not None:
            channels.check_address(address, bind=False)
        self.plane = plane
        self._address = address
        self._strategy = WeightStrategy(strategy)
        self.model_id = model_id
        self.bind = bind
        self.timeouts = timeouts or Timeouts()
        self.heartbeats = heartbeats or Heartbeats()
        self.channels = channels
        self.apply_mode: Literal["auto", "swap", "copy"] = apply_mode
        self.background = background
        self.wire_dtype = wire_dtype
        self.integrity = integrity
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._role: Role | None = None
        self._model: Any = None
        self._models: dict[str, WeightsLike] | None = None
        """``models=`` of a scheme of several models (None for one)."""
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
        self._relay: Relay | None = None
        """A sender fed by a relay (``upstream.relay_to(self)``)."""
        self._relays_to: Relay | None = None
        """A receiver that feeds a relay (``self.relay_to(local)``)."""
        self._deferred: tuple[SenderCore, WeightSource, SenderChannel] | None = None
        """A relayed sender entered before its upstream held a version: its engine, first
        version and channel, started by the relay."""
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
        "wire_dtype",
        "integrity",
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
    def initialized_on_sender(self) -> bool:
        """Whether ``init_on_sender()`` was called."""
        return self._role == "sender"

    @property
    def initialized_on_receiver(self) -> bool:
        """Whether ``init_on_receiver()`` was called."""
        return self._role == "receiver"

    @property
    def model(self) -> Any:
        """The model or weights given to ``init_on_*`` (``None`` before; with ``models=``, a
        module holding them all when all are modules)."""
        return self._model

    @property
    def models(self) -> Mapping[str, Any]:
        """Model id to the model (or weights) given to ``init_on_*``: ``models=`` as given,
        or ``{model_id: model}`` for one model (empty before ``init_on_*``)."""
        if self._models is not None:
            return MappingProxyType(self._models)
        if self._role is None:
            return MappingProxyType({})
        single = self._model if self._model is not None else self._weights
        return MappingProxyType({self.model_id: single})

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
    def workers(self) -> WorkerTable:
        """Sender: a live, read-only mapping of worker index to :class:`WorkerStatus` (state,
        versions held and in flight, when last heard, pid, host, and why it is lost or was
        refused). Before ``async with`` and after it, every worker reads as never connected.
        """
        if self._role != "sender":
            raise RuntimeError("workers is the sender's view: read it on the trainer")
        return WorkerTable(
            lambda: self._sender.peers if self._sender is not None else None, self.num_workers
        )

    @property
    def dropped_messages(self) -> int:
        """Control messages dropped as malformed, unknown or out of state."""
        if self._sender is not None:
            channel = self._sender.channel
            return self._sender.dropped + (channel.dropped if channel is not None else 0)
        return self._receiver.dropped if self._receiver is not None else 0

    # -- initialisation -----------------------------------------------------------------------

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
            deferred, self._deferred = self._deferred, None
            if deferred is not None:
                deferred[2].close()  # a relayed sender that never started
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

    # -- sender API ---------------------------------------------------------------------------

    async def connect(self, timeout: float | None = None) -> None:
        """Sender: wait until every worker holds version 0 (or the latest version).

        Receiver: handshake, apply the current version and start the background task.
        """
        timeout = self.timeouts.handshake if timeout is None else timeout
        if self._tg is None:
            raise RuntimeError("use `async with scheme:` before connect()")
        if self._role == "sender" and self._relay is not None:
            timeout -= await self._relay.wait_started(timeout)
        if self._sender is not None:
            await self._sender.wait_ready(timeout)
            self._connected = True
            return
        await self._connect_receiver(self._tg, timeout)
