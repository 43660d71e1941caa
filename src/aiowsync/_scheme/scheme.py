"""The public scheme: one object per model, used on the sender and on each receiver.

Its configuration is :class:`~aiowsync._scheme.config.SchemeConfig`, its session and life
cycle :class:`~aiowsync._scheme.running.SchemeRuntime`; this class adds the verbs of both
roles, each handed to the session of its role.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from .._receiving.engine import Hook
from .._receiving.guard import ReadGuard
from .._receiving.lease import Lease
from .._sending.engine import PendingSend, SendResult
from .._weights.flatten import WeightsLike
from .._weights.models import check_models, sender_weights
from .base import resolve_model
from .config import SchemeOptions
from .follow import Rejoin
from .receiver import ReceiverSession, refuse_forked
from .relay import Relay, Upstream, check_pair, digest_of, root_of
from .running import SchemeRuntime
from .sender import SenderSession

__all__ = ["SchemeOptions", "WeightSyncScheme"]


def _checked_models(
    models: Mapping[str, WeightsLike] | None, model: object, weights: object
) -> dict[str, WeightsLike] | None:
    """``models=`` checked (None when not given); refused beside ``model=`` or ``weights=``."""
    if models is None:
        return None
    if model is not None or weights is not None:
        raise ValueError("give models= alone, or model= (or weights=) for one model")
    return check_models(models)


class WeightSyncScheme(SchemeRuntime):
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
        channels: the control-channel factory (the in-memory twin in tests). By default a
            :class:`ZmqChannelFactory` that authenticates every tcp bind with CURVE keys of
            its own, carried to workers in the pickled scheme;
            ``ZmqChannelFactory(allow_insecure_bind=True)`` opts out.
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

    # -- the sender's role --------------------------------------------------------------------

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
        if self._hooks:
            raise RuntimeError(
                "hooks run on receivers, and this scheme has hooks registered: a sender would "
                "never call them"
            )
        checked = _checked_models(models, model, weights)
        if checked is not None:
            model, weights = sender_weights(checked)
            if model is not None:
                weights = None
        named = self._model_id_for(model_id, checked)
        if model is None and weights is None and context is not None:
            model = resolve_model(context, named)
        if model is None and weights is None:
            raise ValueError("init_on_sender needs model=, weights= or a context holding the model")
        if model is not None and weights is not None:
            raise ValueError("give model= or weights=, not both")
        if num_workers is None and context is not None:
            num_workers = getattr(context, "num_workers", None)
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive integer, got {num_workers!r}")
        self._session = SenderSession(
            self._session_options(named),
            model=model,
            weights=weights,
            models=checked,
            context=context,
            num_workers=num_workers,
            rehome=rehome,
            wire_dtype=self.wire_dtype,
        )
        self.model_id = named

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
        sent = self._need_sending("send").send(weights, worker_ids, timeout, self.timeouts)
        if not self._send_observers:
            return await sent
        try:
            result = await sent
        except Exception as exc:
            self._tell_observers(exc)
            raise
        self._tell_observers(result)
        return result

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
        sending = self._need_sending("publish")
        published = sending.publish(weights, worker_ids, timeout, self.timeouts)
        if not self._send_observers:
            return await published
        try:
            pending = await published
        except Exception as exc:
            self._tell_observers(exc)
            raise
        self._tell_when_known(pending)
        return pending

    def extract_weights(self, source: WeightsLike | None = None) -> Any:
        """The weights of ``source`` (default: the sender's model) in the strategy's format."""
        src = source
        if src is None and self._session is not None:
            # Not `or`: a TensorDict refuses to be read as a boolean.
            src = self._session.model
            if src is None and isinstance(self._session, SenderSession):
                src = self._session.weights
        if src is None:
            raise RuntimeError("no model to extract weights from")
        return self._strategy.extract_weights(src)

    # -- the receivers' role ------------------------------------------------------------------

    def init_on_receiver(
        self,
        model: nn.Module | TensorDictBase | dict[str, torch.Tensor] | None = None,
        *,
        worker_idx: int,
        weights: TensorDictBase | dict[str, torch.Tensor] | None = None,
        models: Mapping[str, WeightsLike] | None = None,
        model_id: str | None = None,
        context: Any = None,
        reconnect: bool | Rejoin = False,
    ) -> None:
        """Prepare this object as receiver ``worker_idx`` for ``model``.

        ``model`` is a module, a ``TensorDict`` or a state_dict whose tensors will be made to
        hold each new version (swap mode re-points them, copy mode copies into them);
        ``weights=`` takes a ``TensorDict`` or state_dict instead, as on the sender;
        ``models=`` several models by model id, as the sender gave them.

        ``reconnect``: follow the sender across restarts (background mode only). When it is
        gone, the receiver warns once, serves its version meanwhile (``ready`` stays True,
        ``connected`` is False) and joins the next sender that answers, as a fresh receiver
        would (``generation`` counts one more). ``True`` tries the same address; a function
        (sync or async, called before each try) returns where: an address, the new sender's
        scheme (its address, channels and plane: new CURVE keys) or None for "not yet".
        See the failures guide.

        A receiver of a ``tcp://`` sender needs the sender's CURVE keys: the pickled scheme
        carries them; one built from the address alone is given them with ``channels=``
        (see docs/security.md), or this raises ``ValueError`` naming them.
        """
        if self._sending is not None and self._sending.forked:
            refuse_forked(self.channels, self.model_id, self._sending, worker_idx)
        self._check_fresh()
        checked = _checked_models(models, model, weights)
        if checked is not None:
            holder, together = sender_weights(checked)
            model = holder if holder is not None else together  # type: ignore[assignment]
        named = self._model_id_for(model_id, checked)
        if model is not None and weights is not None:
            raise ValueError("give model= or weights=, not both")
        if model is None:
            model = weights
        if model is None and context is not None:
            model = resolve_model(context, named)
        if model is None:
            raise ValueError(
                "init_on_receiver needs model=, weights= or a context holding the model"
            )
        if not isinstance(worker_idx, int) or isinstance(worker_idx, bool) or worker_idx < 0:
            raise ValueError(f"worker_idx must be a non-negative integer, got {worker_idx!r}")
        if self._address is None:
            if self._unpickled:
                raise ValueError(
                    "this copy of the scheme was pickled before its sender had an address: "
                    "hand it to workers after init_on_sender(), or pass address="
                )
            raise ValueError("a receiver needs the sender's address: pass address= or unpickle it")
        self.channels.check_receiver(self._address)
        self._session = ReceiverSession(
            self._session_options(named),
            model=model,
            models=checked,
            context=context,
            worker_idx=worker_idx,
            address=self._address,
            wire_dtype=self.wire_dtype,
            guard=self._guard,
            hooks=self._hooks,
            reconnect=reconnect,
        )
        self.model_id = named

    async def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Wait until the model runs ``version`` or newer; returns the version it runs.

        With ``reconnect=``, a version of a later sender counts as newer whatever its number
        (a restarted trainer numbers from 0 again), and the wait goes on while the receiver
        waits for a new sender; without, it raises :class:`SenderGoneError` once the sender
        is gone."""
        timeout = self.timeouts.ack if timeout is None else timeout
        return await self._need_receiving("wait_for_version").wait_for_version(version, timeout)

    @property
    def generation(self) -> int:
        """Receiver: which sender the model's version comes from: 0 for the first this
        receiver joined in its ``async with``, one more for each new sender it followed
        (``reconnect=``). A restarted trainer numbers its versions from 0 again, so
        ``(generation, version)`` names what the model runs."""
        receiving = self._receiving
        core = None if receiving is None else receiving.core
        return 0 if core is None else core.generation

    async def receive(self, timeout: float | None = None) -> int | None:
        """Pull mode: apply the next update arriving within ``timeout``; its version, or None."""
        if self.background:
            raise RuntimeError("receive() is for pull mode: build the scheme with background=False")
        timeout = self.timeouts.ack if timeout is None else timeout
        return await self._need_receiving("receive").need_core().receive(timeout)

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
        upstream = self._receiving
        if upstream is None:
            raise RuntimeError("relay_to() is called on the receiver that feeds the relay")
        leaves = local._sending if isinstance(local, WeightSyncScheme) else None
        if leaves is None:
            raise ValueError("relay_to() needs a scheme initialised with init_on_sender()")
        if local is self:
            raise ValueError("a scheme cannot relay to itself")
        check_pair(
            upstream.models if upstream.models is not None else upstream.model,
            leaves.models if leaves.models is not None else leaves.model,
            entered=self._exit is not None or local._exit is not None,
            taken=leaves.relay is not None or upstream.relays_to is not None,
            follows=bool(upstream.follows),
        )
        feed = Upstream(
            worker_idx=upstream.worker_idx,
            ack_timeout=self.timeouts.ack,
            guard=self._guard,
            version=lambda: self.version,
            entered=lambda: self._exit is not None,
            digest=lambda version: digest_of(upstream.applying, version),
            fingerprint=lambda: upstream.layout.fingerprint,
            root=lambda: root_of(upstream.applying),
        )
        relay = Relay(feed, leaves)
        upstream.relays_to = relay
        leaves.relay = relay
        self._hooks.append(relay.forward)

    def register_hook(self, hook: Hook) -> None:
        """Call ``hook(version)`` (sync or async) right after each switch, before the ack."""
        if self._sending is not None:
            raise RuntimeError("hooks run on receivers")
        self._hooks.append(hook)

    def read_guard(self) -> ReadGuard:
        """The guard a forward holds (``with`` in threads, ``async with`` on the loop) so that
        no switch happens under it."""
        if self._sending is not None:
            raise RuntimeError("the read guard belongs to receivers")
        return self._guard

    def lease(self) -> Lease:
        """A lease on the version the model runs when it is entered (``async with`` on the
        receiver's loop, ``with`` in threads): ``held.version``, and ``held.weights`` with
        that version's exact bytes until the block ends, while the model goes on switching
        to newer versions. See the serving guide for what it costs on each transport."""
        if self._sending is not None:
            raise RuntimeError("leases are taken on receivers")
        receiving = self._receiving
        if receiving is None:
            raise RuntimeError("this needs a connected receiver (init_on_receiver + connect)")
        receiving.need_core()
        return Lease(lambda: receiving.need_core().leases)

    def apply_weights(self, weights: WeightsLike, inplace: bool = True) -> None:
        """Write ``weights`` into the receiver's model with the strategy (no version): before
        ``connect()``, or once the session ended. A connected receiver's model takes its
        weights from its sender only (send them instead), and always in place: the receiver
        switches the tensors the model held at ``init_on_receiver``."""
        receiving = self._receiving
        if receiving is None:
            raise RuntimeError("apply_weights() is for receivers")
        if not inplace:
            raise ValueError(
                "apply_weights(inplace=False) on a receiver would give the model tensors "
                "that its receiver never updates; use inplace=True"
            )
        if receiving.switching:
            raise RuntimeError(
                "apply_weights() on a connected receiver: its model runs the sender's "
                "versions (a write here would be a version nobody sent, and in swap mode "
                "lands in memory mapped read only); send the weights from the sender, or "
                "apply them before connect() or after the session ends"
            )
        self._strategy.apply_weights(receiving.model, weights, inplace=True)
