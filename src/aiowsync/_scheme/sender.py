"""The sender's half of the scheme's API: binding the control socket, ``send()``."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.abc
import torch
from tensordict import TensorDictBase
from torch import nn

from .._channel import SenderChannel, resolve_local
from .._exceptions import TransportError
from .._planes.base import SenderContext, WeightSource
from .._sending.engine import PendingSend, SenderCore, SendResult
from .._sending.handshake import hello_limit
from .._sending.source import ModelSource, PartialSource, WeightsSource
from .._weights.flatten import WeightsLike, flatten_weights
from .._weights.layout import Layout, refuse_meta
from .._weights.models import check_models, models_id, sender_weights, split_send
from .base import SchemeState, resolve_model

__all__ = ["SenderSide"]

log = logging.getLogger("aiowsync")


class SenderSide(SchemeState):
    @property
    def address(self) -> str:
        """The sender's bound control address (on a receiver: the address it connects to).

        On a sender it can be read as soon as ``init_on_sender()`` returned: the control socket
        is then bound at once (a free port is chosen if ``bind`` names port 0, a fresh socket
        for ``ipc://*`` and ``ipc://@*``), and ``async with`` serves on it. Later
        ``async with`` sessions of the same object serve on it again when it can be had (else
        on a fresh one, with a warning).
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
            resolve_local(self.bind),
            heartbeat_timeout=self.heartbeats.timeout,
            max_message=hello_limit(self._layout),
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
                return self.channels.bind(
                    self._served, heartbeat_timeout=timeout, max_message=hello_limit(self._layout)
                )
            except TransportError as exc:
                log.warning(
                    "cannot serve on %s again (%s); binding %s instead: workers need the new "
                    "address",
                    self._served,
                    exc,
                    self.bind,
                )
        return self.channels.bind(
            resolve_local(self.bind),
            heartbeat_timeout=timeout,
            max_message=hello_limit(self._layout),
        )

    def _take_bound(self) -> SenderChannel | None:
        bound, self._bound = self._bound, None
        if bound is None:
            return None
        channel, finalizer = bound
        finalizer.detach()
        return channel

    def init_on_sender(
        self,
        model: nn.Module | TensorDictBase | dict[str, torch.Tensor] | None = None,
        *,
        weights: WeightsLike | None = None,
        models: Mapping[str, WeightsLike] | None = None,
        num_workers: int | None = None,
        model_id: str | None = None,
        context: Any = None,
        rehome: bool = False,
    ) -> None:
        """Prepare this object as the sender.

        Args:
            model: the model whose weights ``send()`` takes by default.
            weights: a ``TensorDict`` or state_dict instead of a model.
            models: several models synced as one, by model id (each an ``nn.Module``, a
                ``TensorDict`` or a state_dict): each version covers them all, and
                ``send(weights={model_id: ...})`` sends some of them.
            num_workers: how many receivers (indices ``0 .. num_workers-1``).
            model_id: overrides the constructor's ``model_id``.
            context: an object that can resolve ``model_id`` to a model (seed-style); its
                ``num_workers`` is used when ``num_workers`` is not given.
            rehome: re-home the model's tensors as views of one private flat buffer so that a
                snapshot is a single memcpy (tensor identity is kept, so optimizers keep
                working); falls back to per-tensor fused copies if the model cannot be re-homed.
        """
        self._check_fresh()
        self._models = None  # nothing of an earlier call that failed stays
        if models is not None:
            if model is not None or weights is not None:
                raise ValueError("give models= alone, or model= (or weights=) for one model")
            self._models = check_models(models)
            self.model_id = models_id(self._models)
            model, weights = sender_weights(self._models)
            if model is not None:
                weights = None
        elif model_id is not None:
            self.model_id = model_id
        if model is None and weights is None and context is not None:
            model = resolve_model(context, self.model_id)
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
        several = self._models is not None
        self._model_layout = Layout.from_weights(flat, sectioned=several)
        self._layout = Layout.from_weights(flat, sectioned=several, wire_dtype=self.wire_dtype)
        self._model, self._weights, self._context = model, weights, context
        self.num_workers = num_workers
        self._rehome = rehome
        self._role = "sender"
        self._sender_pid = os.getpid()

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
                integrity=(
                    self.plane.integrity_by_default if self.integrity is None else self.integrity
                ),
            )
            if isinstance(self._model, nn.Module):
                self._source = ModelSource(
                    self._model, self._model_layout, rehome_it=self._rehome, cast=self._casts
                )
            initial = self._source or self._source_of(None)
        except BaseException:
            channel.close()
            raise
        if self._relay is not None:
            # Fed by a relay: the first version is the upstream's, staged once it holds one
            # (now, if it does already).
            self._deferred = (sender, initial, channel)
            self._served = channel.address
            await self._relay.start_local()
            return
        await sender.start(initial, channel)  # closes the channel if it fails
        self._sender = sender
        self._served = sender.address  # what later sessions try to serve on again
        await self._start_background(tg, sender.serve)

    @property
    def _casts(self) -> bool:
        """The wire dtype changes some tensors' dtype on the way."""
        return self._layout.fingerprint != self._model_layout.fingerprint

    def _source_of(self, weights: WeightsLike | str | None) -> WeightSource:
        if weights is None:
            if self._source is not None:
                return self._source
            weights = self._model if self._model is not None else self._weights
        elif self._models is not None:
            named, every = split_send(weights, self._models)
            if not every:
                return PartialSource(named, self._model_layout, cast=self._casts)
            weights = named
        elif self._context is not None and isinstance(weights, str):
            weights = resolve_model(self._context, weights)
        return WeightsSource(weights, self._model_layout, cast=self._casts)  # type: ignore[arg-type]

    async def send(
        self,
        weights: WeightsLike | str | None = None,
        worker_ids: int | Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> SendResult:
        """Stage the weights as a new version and wait until every targeted worker runs it.

        Args:
            weights: what to send; by default the model (or weights) given at init. For a
                scheme of several models, ``{model_id: weights, ...}`` (or a TensorDict keyed
                by model id): the models not named keep the bytes of the latest version, and
                the version still rises for all.
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
            ValueError: ``weights`` name a model this scheme does not hold.
            WeightSyncError: every shared-memory slot holds a version still in use, or the
                sender shut down while the version was being staged.
            TransportError: a new slot could not be created (``/dev/shm`` full).
            ValueError: ``worker_ids`` out of range, repeated or empty.
            RuntimeError: called outside ``async with``, or on a receiver.

        Concurrent calls are served one at a time in call order.
        """
        sender, source, targets, limits = self._send_args("send", weights, worker_ids, timeout)
        return await sender.send(source, targets, **limits)

    async def publish(
        self,
        weights: WeightsLike | str | None = None,
        worker_ids: int | Sequence[int] | None = None,
        timeout: float | None = None,
    ) -> PendingSend:
        """Two-phase send: return as soon as the version is staged; await the acks later.

        ``pending = await scheme.publish()`` takes the same arguments as :meth:`send` and
        returns once the weights are copied out (from then on the trainer may change them)
        and the version is announced; ``result = await pending`` then gives the
        :class:`SendResult`, or raises what ``send()`` would have. Versions keep their order:
        a later ``publish()`` or ``send()`` stages only once this one's bytes are delivered,
        as with ``send()``. Errors found before staging (lost workers, a layout mismatch) are
        raised by ``publish()`` itself. Await every pending send before leaving
        ``async with``: leaving ends the ones still waiting, with an error.
        """
        sender, source, targets, limits = self._send_args("publish", weights, worker_ids, timeout)
        assert self._tg is not None
        return await sender.publish(source, targets, tasks=self._tg, **limits)

    def _send_args(
        self,
        what: str,
        weights: WeightsLike | str | None,
        worker_ids: int | Sequence[int] | None,
        timeout: float | None,
    ) -> tuple[SenderCore, WeightSource, list[int], dict[str, Any]]:
        if self._relay is not None:
            raise RuntimeError(
                f"{what}() is not for a relay's local scheme: it sends what its upstream "
                "receives, under the upstream's version numbers"
            )
        sender = self._sender
        if sender is None or self._tg is None:
            if self._role == "sender":
                raise RuntimeError(
                    f"{what}() runs inside `async with scheme:` (enter it, then "
                    "`await scheme.connect()`, then send)"
                )
            raise RuntimeError(f"{what}() needs an initialised sender inside `async with scheme`")
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
        limits = {"stage_limit": stage_limit, "ack_limit": ack_limit, "deadline": deadline}
        return sender, self._source_of(weights), targets, limits

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
