"""The sender's session: its model and layout, the control socket bound early, its engine.

A :class:`SenderSession` is made by ``init_on_sender`` once the arguments are checked, and
lives as long as the scheme; each ``async with`` starts its engine (:class:`SenderCore`) and
stops it again. The scheme's public methods of the sender's role call it.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import anyio
import torch
from torch import nn

from .._channel import SenderChannel, resolve_local
from .._config import Timeouts
from .._exceptions import TransportError
from .._planes.base import SenderContext, WeightSource
from .._sending.engine import PendingSend, SenderCore, SendResult
from .._sending.handshake import hello_limit, refuse_oversized
from .._sending.source import ModelSource, PartialSource, WeightsSource
from .._sending.workers import WorkerTable
from .._weights.flatten import WeightsLike, flatten_weights
from .._weights.layout import Layout, refuse_meta
from .._weights.models import split_send
from .base import SessionOptions, Tasks, resolve_model
from .relay import Relay

__all__ = ["Finisher", "SenderSession"]

log = logging.getLogger("aiowsync")


class Finisher(Protocol):
    """A second step that a send (and ``connect()``) takes before it returns, once every
    targeted worker holds the version: e.g. vLLM servers told to load it
    (:meth:`aiowsync.vllm.VLLMServers.attach`)."""

    def check(self, worker_ids: Sequence[int]) -> None:
        """Raise before anything is staged if a send to ``worker_ids`` cannot be finished."""

    async def finish(self, version: int, worker_ids: Sequence[int], deadline: float | None) -> None:
        """Take ``version``, which ``worker_ids`` acknowledged, by ``deadline`` (on
        ``time.monotonic()``'s clock; None: no deadline but the finisher's own); raise to fail
        the send."""


class SenderSession:
    """The sender's role of a scheme (see the module)."""

    def __init__(
        self,
        options: SessionOptions,
        *,
        model: Any,
        weights: WeightsLike | None,
        models: dict[str, WeightsLike] | None,
        context: Any,
        num_workers: int,
        rehome: bool,
        wire_dtype: torch.dtype | None,
    ) -> None:
        flat = flatten_weights(model if model is not None else weights)  # type: ignore[arg-type]
        refuse_meta(flat, "they hold no values to send")
        several = models is not None
        self.options = options
        self.model_layout = Layout.from_weights(flat, sectioned=several)
        """The layout of the model's own dtypes (what sources are checked against);
        ``layout`` is the one on the wire, the same unless a wire dtype casts."""
        self.layout = Layout.from_weights(flat, sectioned=several, wire_dtype=wire_dtype)
        refuse_oversized(self.layout)
        self.model, self.weights, self.models, self.context = model, weights, models, context
        self.num_workers = num_workers
        self.pid = os.getpid()
        self.relay: Relay | None = None
        """Set when this sender is fed by a relay (``upstream.relay_to(scheme)``)."""
        self.source: ModelSource | None = None
        """Where ``send()`` takes the weights from when given none (while serving)."""
        self.core: SenderCore | None = None
        self._rehome = rehome
        self._tasks: Tasks | None = None
        self._served: str | None = None
        """The address this sender serves on (bound early, or by its last session)."""
        self._bound: tuple[SenderChannel, weakref.finalize[Any, Any]] | None = None
        """A control socket bound before ``async with`` (reading ``address``), and its
        closer."""
        self._deferred: tuple[SenderCore, WeightSource, SenderChannel] | None = None
        """A relayed sender entered before its upstream held a version: its engine, first
        version and channel, started by the relay."""
        self.finishers: list[Finisher] = []
        """Second steps of every send, in order (see :class:`Finisher`)."""
        self._one_send = anyio.Lock()

    @property
    def forked(self) -> bool:
        """This process is a fork of the one that made the session."""
        return self.pid != os.getpid()

    @property
    def entered(self) -> bool:
        return self._tasks is not None

    @property
    def timeouts(self) -> Timeouts:
        return self.options.timeouts

    @property
    def served(self) -> str | None:
        """The address handed out so far, if any (nothing is bound to read it)."""
        return self._served

    @property
    def workers(self) -> WorkerTable:
        return WorkerTable(
            lambda: self.core.peers if self.core is not None else None, self.num_workers
        )

    @property
    def address(self) -> str:
        """The bound control address: bound now if nothing is bound yet."""
        if self.core is not None and self.core.channel is not None:
            return self.core.address
        if self._served is None:
            self._bind_early()
        assert self._served is not None
        return self._served

    def _bind(self, address: str) -> SenderChannel:
        return self.options.channels.bind(
            address,
            heartbeat_timeout=self.options.heartbeats.timeout,
            max_message=hello_limit(self.layout),
        )

    def _bind_early(self) -> None:
        channel = self._bind(resolve_local(self.options.bind))
        self._served = channel.address
        # Closed by the session it is handed to, or when this object goes unused.
        self._bound = channel, weakref.finalize(self, channel.close)

    def _bind_again(self) -> SenderChannel:
        """The control socket of a new session: on the address already handed out when it can
        be had again, else on ``bind`` afresh (a forked child may still hold the old port)."""
        if self._served is not None:
            try:
                return self._bind(self._served)
            except TransportError as exc:
                log.warning(
                    "cannot serve on %s again (%s); binding %s instead: workers need the new "
                    "address",
                    self._served,
                    exc,
                    self.options.bind,
                )
        return self._bind(resolve_local(self.options.bind))

    def _take_bound(self) -> SenderChannel | None:
        bound, self._bound = self._bound, None
        if bound is None:
            return None
        channel, finalizer = bound
        finalizer.detach()
        return channel

    # -- one ``async with`` -------------------------------------------------------------------

    async def start(self, tasks: Tasks) -> None:
        """Serve: bind (or take the socket bound early), stage the first version, start the
        engine's background task. A relayed sender waits for its relay to start it."""
        options = self.options
        self.core = None
        channel = self._take_bound() or self._bind_again()
        try:
            flat = flatten_weights(self.model if self.model is not None else self.weights)  # type: ignore[arg-type]
            core = SenderCore(
                plane=options.plane.sender(
                    SenderContext(
                        bind=options.bind,
                        tensors=flat,
                        timeouts=options.timeouts,
                        num_workers=self.num_workers,
                    )
                ),
                layout=self.layout,
                num_workers=self.num_workers,
                model_id=options.model_id,
                timeouts=options.timeouts,
                heartbeats=options.heartbeats,
                integrity=(
                    options.plane.integrity_by_default
                    if options.integrity is None
                    else options.integrity
                ),
            )
            if isinstance(self.model, nn.Module):
                self.source = ModelSource(
                    self.model, self.model_layout, rehome_it=self._rehome, cast=self._casts
                )
            initial = self.default_source()
        except BaseException:
            channel.close()
            raise
        self._tasks = tasks
        if self.relay is not None:
            # Fed by a relay: the first version is the upstream's, staged once it holds one
            # (now, if it does already).
            self._deferred = (core, initial, channel)
            self._served = channel.address
            await self.relay.start_local()
            return
        await core.start(initial, channel)  # closes the channel if it fails
        self.core = core
        self._served = core.address  # what later sessions try to serve on again
        await tasks.start(core.serve)

    async def start_at(
        self, version: int, *, before: Callable[[SenderCore], None] | None = None
    ) -> SenderCore | None:
        """A relayed sender's engine, started with ``version`` as its first version (after
        ``before(core)``); None while it is not entered."""
        if self.core is not None:
            return self.core
        deferred, tasks = self._deferred, self._tasks
        if deferred is None or tasks is None:
            return None
        core, initial, channel = deferred
        self._deferred = None  # start() closes the channel if it fails
        if before is not None:
            before(core)
        await core.start(initial, channel, first_version=version)
        self.core = core
        await tasks.start(core.serve)
        return core

    async def stop(self) -> None:
        """End the session (its background tasks are stopped already)."""
        self._tasks = None
        try:
            if self.core is not None:
                await self.core.close()
            deferred, self._deferred = self._deferred, None
            if deferred is not None:
                deferred[2].close()  # a relayed sender that never started
        finally:
            if self.source is not None:
                self.source.close()
                self.source = None

    async def connect(self, timeout: float) -> None:
        if self.relay is not None:
            timeout -= await self.relay.wait_started(timeout)
        deadline = time.monotonic() + timeout
        assert self.core is not None
        await self.core.wait_ready(timeout)
        everyone = list(range(self.num_workers))
        for finisher in list(self.finishers):
            await finisher.finish(self.core.version, everyone, deadline)

    # -- sends --------------------------------------------------------------------------------

    @property
    def _casts(self) -> bool:
        """The wire dtype changes some tensors' dtype on the way."""
        return self.layout.fingerprint != self.model_layout.fingerprint

    def default_source(self) -> WeightSource:
        return self.source or self._source_of(None)

    def _source_of(self, weights: WeightsLike | str | None) -> WeightSource:
        if weights is None:
            if self.source is not None:
                return self.source
            weights = self.model if self.model is not None else self.weights
        elif self.models is not None:
            named, every = split_send(weights, self.models)
            if not every:
                return PartialSource(named, self.model_layout, cast=self._casts)
            weights = named
        elif self.context is not None and isinstance(weights, str):
            weights = resolve_model(self.context, weights)
        return WeightsSource(weights, self.model_layout, cast=self._casts)  # type: ignore[arg-type]

    async def send(
        self,
        weights: WeightsLike | str | None,
        worker_ids: int | Sequence[int] | None,
        timeout: float | None,
        timeouts: Timeouts,
    ) -> SendResult:
        """``timeouts``: the scheme's, as they are now (they may change between sends)."""
        core, source, targets, limits = self._send_args(
            "send", weights, worker_ids, timeout, timeouts
        )
        finishers = list(self.finishers)
        if not finishers:
            return await core.send(source, targets, **limits)
        started = time.perf_counter()
        for finisher in finishers:
            finisher.check(targets)
        # With a second step, sends made at once run one after another, whole: a version's
        # second step asks for the version the workers hold, not one sent after it.
        async with self._one_send:
            result = await core.send(source, targets, **limits)
            for finisher in finishers:
                await finisher.finish(result.version, result.worker_ids, limits["deadline"])
        return dataclasses.replace(result, seconds=time.perf_counter() - started)

    async def publish(
        self,
        weights: WeightsLike | str | None,
        worker_ids: int | Sequence[int] | None,
        timeout: float | None,
        timeouts: Timeouts,
    ) -> PendingSend:
        if self.finishers:
            raise RuntimeError(
                "publish() returns before the workers hold the version, so it cannot take the "
                "second step of a send (vLLM servers attached): use send()"
            )
        core, source, targets, limits = self._send_args(
            "publish", weights, worker_ids, timeout, timeouts
        )
        assert self._tasks is not None
        return await core.publish(source, targets, tasks=self._tasks.tg, **limits)

    def _send_args(
        self,
        what: str,
        weights: WeightsLike | str | None,
        worker_ids: int | Sequence[int] | None,
        timeout: float | None,
        timeouts: Timeouts,
    ) -> tuple[SenderCore, WeightSource, list[int], dict[str, Any]]:
        if self.relay is not None:
            raise RuntimeError(
                f"{what}() is not for a relay's local scheme: it sends what its upstream "
                "receives, under the upstream's version numbers"
            )
        core = self.core
        if core is None or self._tasks is None:
            raise RuntimeError(
                f"{what}() runs inside `async with scheme:` (enter it, then "
                "`await scheme.connect()`, then send)"
            )
        targets = self._targets_of(worker_ids)
        if weights is not None and weights is self.model and self.source is not None:
            # The model given at init, passed again: the same as send(), whose watch knows its
            # tensors without walking the model.
            weights = None
        if timeout is None:
            stage_limit, ack_limit, deadline = timeouts.transfer, timeouts.ack, None
        else:
            stage_limit = ack_limit = timeout
            deadline = time.monotonic() + timeout
        limits = {"stage_limit": stage_limit, "ack_limit": ack_limit, "deadline": deadline}
        return core, self._source_of(weights), targets, limits

    def _targets_of(self, worker_ids: int | Sequence[int] | None) -> list[int]:
        if worker_ids is None:
            return list(range(self.num_workers))
        given: list[object] = (
            [worker_ids] if _is_index(worker_ids) else list(cast(Sequence[int], worker_ids))
        )
        if not given:
            raise ValueError("worker_ids is empty: name at least one worker, or pass None for all")
        ids = []
        for w in given:
            # Any integer, a numpy one included (operator.index); not a bool or a float.
            index = operator.index(w) if _is_index(w) else -1  # type: ignore[arg-type]
            if not 0 <= index < self.num_workers:
                raise ValueError(f"worker id {w!r} is not in range(0, {self.num_workers})")
            ids.append(index)
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker_ids has duplicates: {ids}")
        return sorted(ids)


def _is_index(value: object) -> bool:
    """Whether ``value`` is an integer (``operator.index`` takes it) and not a bool."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        return False
    return str(getattr(value, "dtype", "")) not in ("bool", "torch.bool")
