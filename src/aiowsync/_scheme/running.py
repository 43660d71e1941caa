"""What a scheme holds at run time: the session of its role, and its ``async with``.

``init_on_sender`` and ``init_on_receiver`` (in :mod:`aiowsync._scheme.scheme`) give a scheme
a :class:`SenderSession` or a :class:`ReceiverSession`, which holds that role's state; this
layer enters and leaves it, and reads its status.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any

import anyio

from .._channel import reachable
from .._receiving.engine import Hook
from .._receiving.guard import ReadGuard
from .._sending.outcome import PendingSend, SendResult
from .._sending.workers import WorkerTable
from .._weights.flatten import WeightsLike
from .._weights.models import models_id
from .base import Tasks, forked_text
from .config import SchemeConfig
from .receiver import ReceiverSession
from .sender import SenderSession

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["SchemeRuntime", "SendObserver"]

log = logging.getLogger("aiowsync")

STOP_WAIT_S = 10.0
"""How long leaving ``async with`` waits for the background tasks to end (each of their own
waits has a shorter deadline)."""

SendObserver = Callable[[SendResult | Exception], None]
"""Told what each send of a sender came to: its result, or the exception it raised."""


class SchemeRuntime(SchemeConfig):
    """A scheme's session of one role, its ``async with`` life cycle, and what it reports.

    :class:`WeightSyncScheme` adds the verbs of both roles on top.
    """

    def _reset_runtime(self) -> None:
        self._session: SenderSession | ReceiverSession | None = None
        """The role's state, made by ``init_on_*``."""
        self._tasks: Tasks | None = None
        """The background tasks of the ``async with`` session under way."""
        self._exit: AsyncExitStack | None = None
        self._hooks: list[Hook] = []
        self._guard = ReadGuard()
        self._send_observers: list[SendObserver] = []

    def _pickled_address(self) -> str | None:
        if isinstance(self._session, SenderSession):
            # Bound now if nothing is bound yet; a copy must connect to a host, not to the
            # wildcard a sender may listen on.
            return reachable(self._session.address, getattr(self.plane, "data_host", None))
        return self._address

    # -- the two sessions ---------------------------------------------------------------------

    @property
    def _sending(self) -> SenderSession | None:
        return self._session if isinstance(self._session, SenderSession) else None

    @property
    def _receiving(self) -> ReceiverSession | None:
        return self._session if isinstance(self._session, ReceiverSession) else None

    def _need_sending(self, what: str) -> SenderSession:
        if (session := self._sending) is None:
            raise RuntimeError(f"{what}() needs an initialised sender inside `async with scheme`")
        return session

    def _need_receiving(self, what: str) -> ReceiverSession:
        if (session := self._receiving) is None:
            raise RuntimeError(f"{what}() needs a connected receiver (init_on_receiver + connect)")
        return session

    # Read by tests and tools: the engine of the session under way, if any.
    @property
    def _sender(self) -> Any:
        return self._sending.core if self._sending is not None else None

    @property
    def _receiver(self) -> Any:
        return self._receiving.core if self._receiving is not None else None

    def _check_fresh(self) -> None:
        if self._sending is not None and self._sending.forked:
            raise RuntimeError(forked_text(self._sending.pid))
        if self._session is not None:
            raise RuntimeError(f"this scheme is already initialised as a {self._role}")

    def _model_id_for(self, model_id: str | None, models: dict[str, WeightsLike] | None) -> str:
        """The model id an ``init_on_*`` call settles on (the only place it is decided)."""
        if models is not None:
            if model_id is not None:
                raise ValueError(
                    "give models= without model_id=: a scheme of several models goes by "
                    f"their ids ({models_id(models)!r})"
                )
            return models_id(models)
        if model_id is not None:
            if not isinstance(model_id, str) or not model_id:
                raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")
            return model_id
        return self.model_id

    # -- what sends come to (read by aiowsync.metrics) -----------------------------------------

    def _observe_sends(self, observer: SendObserver) -> Callable[[], None]:
        """Call ``observer`` with what each ``send()`` and ``publish()`` of this sender comes
        to: its :class:`SendResult`, or the exception it raised (a published version's once
        it is known). It runs on the sender's event loop and must neither block nor raise.
        Returns the function that stops it."""
        self._send_observers.append(observer)

        def stop() -> None:
            with contextlib.suppress(ValueError):
                self._send_observers.remove(observer)

        return stop

    def _tell_observers(self, outcome: SendResult | Exception) -> None:
        for observer in list(self._send_observers):
            try:
                observer(outcome)
            except Exception:  # an observer's fault must not turn into the send's
                log.exception("a send observer failed")

    def _tell_when_known(self, pending: PendingSend) -> None:
        """Tell the observers what ``pending`` comes to, from a task of the session."""
        if self._tasks is None:
            return

        async def wait() -> None:
            try:
                result = await pending
            except Exception as exc:
                self._tell_observers(exc)
            else:
                self._tell_observers(result)

        self._tasks.tg.start_soon(wait)

    # -- properties ---------------------------------------------------------------------------

    @property
    def _role(self) -> str | None:
        if self._session is None:
            return None
        return "sender" if isinstance(self._session, SenderSession) else "receiver"

    @property
    def strategy(self) -> Any:
        """The weight format helper behind ``extract_weights`` and ``apply_weights``."""
        return self._strategy

    @property
    def initialized_on_sender(self) -> bool:
        """Whether ``init_on_sender()`` was called."""
        return self._sending is not None

    @property
    def initialized_on_receiver(self) -> bool:
        """Whether ``init_on_receiver()`` was called."""
        return self._receiving is not None

    @property
    def model(self) -> Any:
        """The model or weights given to ``init_on_*`` (``None`` before; with ``models=``, a
        module holding them all when all are modules)."""
        return self._session.model if self._session is not None else None

    @property
    def models(self) -> Mapping[str, Any]:
        """Model id to the model (or weights) given to ``init_on_*``: ``models=`` as given,
        or ``{model_id: model}`` for one model (empty before ``init_on_*``)."""
        session = self._session
        if session is None:
            return MappingProxyType({})
        if session.models is not None:
            return MappingProxyType(session.models)
        single = session.model
        if single is None and isinstance(session, SenderSession):
            single = session.weights
        return MappingProxyType({self.model_id: single})

    @property
    def context(self) -> Any:
        """The ``context=`` given to ``init_on_*``, if any."""
        return self._session.context if self._session is not None else None

    @property
    def num_workers(self) -> int:
        """Sender: how many receivers it serves (0 before ``init_on_sender``)."""
        return self._sending.num_workers if self._sending is not None else 0

    @property
    def worker_idx(self) -> int | None:
        """Receiver: its index (None elsewhere)."""
        return self._receiving.worker_idx if self._receiving is not None else None

    @property
    def version(self) -> int:
        """Sender: the latest version sent. Receiver: the version its model runs (-1 before),
        in the numbers of the sender it came from (see ``generation``)."""
        session = self._session
        if session is not None and session.core is not None:
            return session.core.version
        return -1

    @property
    def ready(self) -> bool:
        """Receiver: connected and running at least the version it was welcomed with; with
        ``reconnect=``, also while the sender is gone and a new one is awaited (the model
        serves the version it kept)."""
        return self._receiving is not None and self._receiving.ready

    @property
    def connected(self) -> bool:
        """Receiver: the sender is reachable (False while a receiver with ``reconnect=``
        waits for a new sender). Sender: the sender is serving."""
        if (receiving := self._receiving) is not None:
            return receiving.connected and receiving.core is not None and receiving.core.connected
        sending = self._sending
        return sending is not None and sending.core is not None and sending.entered

    @property
    def workers(self) -> WorkerTable:
        """Sender: a live, read-only mapping of worker index to :class:`WorkerStatus` (state,
        versions held and in flight, when last heard, pid, host, and why it is lost or was
        refused). Before ``async with`` and after it, every worker reads as never connected.
        """
        if self._sending is None:
            raise RuntimeError("workers is the sender's view: read it on the trainer")
        return self._sending.workers

    @property
    def dropped_messages(self) -> int:
        """Control messages dropped as malformed, unknown or out of state."""
        if (sending := self._sending) is not None and sending.core is not None:
            channel = sending.core.channel
            return sending.core.dropped + (channel.dropped if channel is not None else 0)
        if (receiving := self._receiving) is not None and receiving.core is not None:
            return receiving.core.dropped
        return 0

    @property
    def address(self) -> str:
        """The sender's bound control address (on a receiver: the address it connects to).

        On a sender it can be read as soon as ``init_on_sender()`` returned: the control socket
        is then bound at once (a free port is chosen if ``bind`` names port 0, a fresh socket
        for ``ipc://*`` and ``ipc://@*``), and ``async with`` serves on it. Later
        ``async with`` sessions of the same object serve on it again when it can be had (else
        on a fresh one, with a warning).
        """
        if self._sending is not None:
            return self._sending.address
        if self._receiving is not None:
            return self._receiving.address  # with reconnect=: where it follows its sender
        if self._address is None:
            raise RuntimeError(
                "no address: call init_on_sender() first, or give a receiver address="
            )
        return self._address

    # -- async life cycle ---------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._session is None:
            raise RuntimeError("call init_on_sender() or init_on_receiver() before `async with`")
        if self._exit is not None:
            raise RuntimeError("this scheme is already running")
        stack = AsyncExitStack()
        await stack.enter_async_context(self._running())
        self._exit = stack
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        stack, self._exit = self._exit, None
        assert stack is not None
        return await stack.__aexit__(exc_type, exc, tb)

    @asynccontextmanager
    async def _running(self) -> AsyncIterator[None]:
        session = self._session
        assert session is not None
        failure: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tasks = Tasks(tg)
            self._tasks = tasks
            try:
                try:
                    await session.start(tasks)
                    yield
                except BaseException as exc:
                    if isinstance(exc, anyio.get_cancelled_exc_class()):
                        raise
                    # Raised again once the group has closed: handed to the task group, it
                    # would come out wrapped in an ExceptionGroup.
                    failure = exc
            finally:
                self._tasks = None
                try:
                    # Background loops stop first, so that closing the channel surprises no
                    # reader.
                    await tasks.stop(STOP_WAIT_S)
                    await session.stop()
                finally:
                    tg.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def connect(self, timeout: float | None = None) -> None:
        """Sender: wait until every worker holds version 0 (or the latest version).

        Receiver: handshake, apply the current version and start the background task.
        """
        timeout = self.timeouts.handshake if timeout is None else timeout
        if self._tasks is None or self._session is None:
            raise RuntimeError("use `async with scheme:` before connect()")
        await self._session.connect(timeout)
