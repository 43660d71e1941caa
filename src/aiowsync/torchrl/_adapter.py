"""The TorchRL face of aiowsync schemes: the calls TorchRL's collectors make, on both sides.

One adapter holds one aiowsync scheme, or one per worker when the workers' weights are their
own (see :mod:`._plan`). Each runs on a private event loop (:func:`aiowsync.blocking`), so the
collector's plain calls block until aiowsync's coroutines are done.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from tensordict import TensorDictBase
from torch import nn
from torchrl.weight_update import WeightSyncScheme as _TorchRLScheme

from .._exceptions import WeightSyncError
from .._scheme.base import resolve_model
from .._scheme.blocking import BlockingScheme, blocking
from .._scheme.scheme import WeightSyncScheme as _Scheme
from .._sending.outcome import SendResult
from ._plan import Plan, plan_sender
from ._trainer import apply_locally, connect, jobs, named_as, raise_failed
from ._worker import guard_forwards, is_meta, pass_on, retie, ties_of, without_aliases

__all__ = ["CONNECT_TIMEOUT_S", "Adapter"]

log = logging.getLogger("aiowsync.torchrl")

CONNECT_TIMEOUT_S = 120.0
"""Default deadline of ``connect()`` on either side: worker processes import torch and build
their environments first."""

_RUNTIME = (
    "_plan",
    "_faces",
    "_face",
    "_guard_handles",
    "_closing",
    "_last_seen",
    "_unsettled",
    "_bound",
    "_shut",
)
"""What an adapter holds only in the process that made it (never pickled)."""


class Adapter(_TorchRLScheme):  # type: ignore[misc]  # torchrl ships no type information
    """TorchRL's scheme interface over aiowsync schemes (see the package's text)."""

    def __init__(
        self,
        strategy: str = "tensordict",
        *,
        per_worker_weights: bool = False,
        sync: bool = True,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        send_timeout: float | None = None,
        **options: Any,
    ) -> None:
        super().__init__(strategy=strategy)
        self.per_worker_weights = per_worker_weights
        self.sync = sync
        self.connect_timeout = connect_timeout
        self.send_timeout = send_timeout
        # A TorchRL worker may write into its policy (load_state_dict, exploration buffers):
        # it keeps tensors of its own, and each version is copied into them.
        options.setdefault("apply_mode", "copy")
        self._options = dict(options, strategy=strategy)
        self._inners: list[_Scheme] = []
        self._route: list[tuple[int, int]] = []
        self._set_runtime()

    def _set_runtime(self) -> None:
        self._plan: Plan | None = None
        self._faces: list[BlockingScheme] = []
        self._face: BlockingScheme | None = None
        self._guard_handles: list[Any] = []
        self._closing = threading.Lock()
        self._last_seen: int | None = None
        self._unsettled: list[tuple[concurrent.futures.Future[SendResult], list[int]]] = []
        """Sends made with ``sync=False``, each with the collector's indices of its scheme's
        workers."""
        self._bound: weakref.ReferenceType[nn.Module] | None = None
        """Receiver: the module the worker's receiver copies each version into."""
        self._shut = False
        """shutdown() was called: nothing is sent any more."""

    def _make(self, **options: Any) -> _Scheme:
        raise NotImplementedError

    def create_transport(self, **kwargs: Any) -> Any:
        """Not used: an aiowsync scheme carries its own control channel and data plane."""
        raise NotImplementedError("aiowsync schemes carry their own transport")

    # -- sender -------------------------------------------------------------------------------

    def _init_on_sender_impl(
        self,
        model_id: str | None = None,
        context: Any = None,
        *,
        model: nn.Module | None = None,
        weights: TensorDictBase | None = None,
        params_map: Mapping[int, TensorDictBase] | None = None,
        devices: list[Any] | None = None,
        device_map_fn: Any = None,
        num_workers: int | None = None,
        ctx: Any = None,
    ) -> None:
        # device_map_fn places each worker's copy on its device: aiowsync's workers keep
        # their policy where it is and take each version into it, so it has nothing to do.
        del device_map_fn, ctx
        model_id = model_id or "policy"
        self.model_id = model_id
        if context is not None:
            self.context = context
        plan = plan_sender(
            model_id=model_id,
            context=context,
            model=model,
            weights=weights,
            params_map=params_map,
            devices=devices,
            num_workers=num_workers,
            per_worker=self.per_worker_weights,
        )
        self._plan = plan
        self._shut = False
        self._ties = ties_of(
            plan.local if plan.local is not None or not plan.sources else plan.sources[0]
        )
        if plan.local is not None:
            return
        self.per_worker_weights = plan.per_worker
        inners = []
        for k, source in enumerate(plan.sources):
            inner = self._make(**self._options)
            inner.init_on_sender(source, num_workers=len(plan.workers_of(k)))
            inners.append(inner)
        self._inners, self._route = inners, list(plan.route)
        # Serving before the collector starts its workers (they join as they come up).
        try:
            for inner in inners:
                self._faces.append(blocking(inner).__enter__())
        except BaseException:
            self.shutdown()  # the senders entered so far go (their files with them)
            raise
        _shut_at_exit(self)

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any = None
    ) -> None:
        deadline = time.monotonic() + self.connect_timeout
        context = getattr(self, "context", None)
        for face, names in zip(self._faces, self._names(), strict=True):
            connect(face, deadline, context=context, limit=self.connect_timeout, workers=names)
        if weights is not None and self._faces:  # first weights other than the model's
            self.send(weights)

    def send(
        self, weights: Any = None, worker_ids: Any = None
    ) -> SendResult | list[SendResult] | None:
        """Send ``weights`` as a new version and return once every targeted worker runs it.

        ``weights``: None (the trainer's model), a model id, a module, a ``TensorDict`` or
        state_dict, or ``{worker_idx: weights}`` for workers whose weights are their own.
        Raises aiowsync's errors, naming the workers. Returns the send's result, or one per
        worker's scheme when each worker has its own.
        """
        plan = self._plan
        if plan is None:
            raise RuntimeError("send() needs init_on_sender() first")
        if self._shut:
            raise RuntimeError(
                "this scheme is shut down: a collector's weights are updated before "
                "scheme.shutdown() (collector.shutdown() leaves it to the collector)"
            )
        if isinstance(weights, str):
            weights = self._resolve(weights)
        ties = getattr(self, "_ties", [])
        if plan.local is not None:
            apply_locally(
                plan.local, without_aliases(weights, ties), getattr(self, "context", None)
            )
            return None
        parts = [
            (k, without_aliases(w, ties), ids)
            for k, w, ids in jobs(weights, worker_ids, self._route)
        ]
        names = self._names()
        self._raise_unsettled()
        if not self.sync:
            # Returns once the version is staged (the weights may change then); its outcome
            # is raised by the next send() or shutdown() if it failed.
            for k, w, ids in parts:
                with named_as(names[k]):
                    sent = self._faces[k].publish(w, ids, self.send_timeout)
                self._unsettled.append((sent, names[k]))
            return None
        if len(parts) == 1 and not plan.per_worker:
            k, w, ids = parts[0]
            with named_as(names[k]):
                return self._faces[k].send(w, ids, self.send_timeout)
        # Workers with senders of their own are sent to side by side; each send has its
        # deadline (send_timeout, or the scheme's Timeouts).
        futures = [self._faces[k].send_soon(w, ids, self.send_timeout) for k, w, ids in parts]
        concurrent.futures.wait(futures)
        # Every failure is told (the first raised, with the others noted), each naming the
        # collector's workers: the others' outcomes say who runs which version.
        outcomes = [(f, names[k]) for (k, _, _), f in zip(parts, futures, strict=True)]
        raise_failed(outcomes, others="the send to another worker's scheme failed too")
        return [f.result() for f in futures]

    def _names(self) -> list[list[int]]:
        """By sender, the collector's index of each of its workers (in its own order)."""
        pairs: list[list[tuple[int, int]]] = [[] for _ in self._faces]
        for w, (k, local) in enumerate(self._route):
            pairs[k].append((local, w))
        return [[w for _, w in sorted(p)] for p in pairs]

    def _raise_unsettled(self) -> None:
        """Raise the error of an earlier ``sync=False`` send that has failed since."""
        done = [(f, names) for f, names in self._unsettled if f.done()]
        self._unsettled = [(f, names) for f, names in self._unsettled if not f.done()]
        raise_failed(done)

    def _resolve(self, model_id: str) -> Any:
        context = getattr(self, "context", None)
        if context is None:
            raise ValueError(f"weights named {model_id!r} need the collector as context")
        return resolve_model(context, model_id)

    # -- receiver -----------------------------------------------------------------------------

    def _init_on_receiver_impl(
        self,
        model_id: str,
        context: Any = None,
        *,
        model: Any = None,
        worker_idx: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.model_id = model_id
        self.context = context
        if model is None and context is not None:
            model = resolve_model(context, model_id)
        if not isinstance(model, nn.Module):
            raise ValueError(f"a receiver of {model_id!r} needs its model (an nn.Module)")
        if worker_idx is None:
            worker_idx = getattr(context, "worker_idx", None)
        if worker_idx is None:
            raise ValueError("a receiver needs its worker_idx")
        self.worker_idx = worker_idx
        if not self._inners:
            raise RuntimeError(
                "this scheme reached the worker before init_on_sender(): set it up on the "
                "trainer (the collector does, or call init_on_sender) before the workers start"
            )
        if not 0 <= worker_idx < len(self._route):
            raise ValueError(f"worker_idx {worker_idx}: the trainer set up {len(self._route)}")
        # TorchRL ships the policy to its workers with its tied weights apart (and without
        # memory: it gets some, which the first version fills before connect() returns).
        if is_meta(model):
            model.to_empty(device="cpu")  # which unties what was tied: tied again below
        retie(model, getattr(self, "_ties", []))
        k, local = self._route[worker_idx]
        inner = self._inners[k]
        inner.init_on_receiver(model=model, worker_idx=local)
        inner.register_hook(self._count_version)
        self._guard_handles = guard_forwards(model, inner.read_guard())
        self._bound = weakref.ref(model)
        _TorchRLScheme.model.fset(self, model)  # what TorchRL compares with its collector's

    @property
    def model(self) -> Any:
        return _TorchRLScheme.model.fget(self)

    @model.setter
    def model(self, model: Any) -> None:
        """TorchRL points a worker's scheme at the policy its collector runs, once it has
        connected: a copy of the policy the receiver copies versions into, when the
        collector moved it to its ``policy_device``. Each version then goes on into it."""
        bound: nn.Module | None = self._bound() if self._bound is not None else None
        if bound is not None and isinstance(model, nn.Module) and model is not bound:
            runs = _TorchRLScheme.model.fget(self)
            if runs is bound:
                self._pass_on(bound, model)
            elif model is not runs:
                raise RuntimeError(
                    f"worker {self.worker_idx}: the scheme passes each version on to one copy "
                    "of the policy; it is pointed at another one"
                )
        _TorchRLScheme.model.fset(self, model)

    def _pass_on(self, bound: nn.Module, runs: nn.Module) -> None:
        """Each version goes on from ``bound`` into ``runs``, before it is acknowledged;
        forwards of ``runs`` hold the guard from now on. The collector is not running yet,
        and the trainer sends its next version once the worker says it is ready."""
        inner = self._inners[self._route[self.worker_idx][0]]
        guard = inner.read_guard()
        hook = pass_on(bound, runs, guard, inner.timeouts.ack)
        for handle in self._guard_handles:
            handle.remove()
        self._guard_handles = guard_forwards(runs, guard)
        inner.register_hook(hook)

    def _count_version(self, version: int) -> None:
        """After each switch: move the collector's policy version on by as many versions
        (TorchRL's ``track_policy_version``); the first version sets where counting starts."""
        last, self._last_seen = self._last_seen, version
        bump = getattr(getattr(self, "context", None), "increment_version", None)
        if last is None or not callable(bump) or version <= last:
            return
        if getattr(self.context, "policy_version_tracker", None) is None:
            return
        for _ in range(version - last):
            bump()

    def _setup_connection_and_weights_on_receiver_impl(
        self, *, worker_idx: int | None = None
    ) -> None:
        worker = self.worker_idx if worker_idx is None else worker_idx
        if not self._inners or worker is None:
            raise RuntimeError("init_on_receiver() first")
        face = blocking(self._inners[self._route[worker][0]]).__enter__()
        self._face = face
        _shut_at_exit(self)  # a worker process ends without calling shutdown()
        face.connect(self.connect_timeout)

    def receive(self, timeout: float | None = None) -> int | None:
        """Wait up to ``timeout`` seconds (none by default) for a version newer than the one
        the model runs now; the version it runs then, or None. A background task applies
        versions as they come, so this only reports them. Once the sender is gone it raises
        :class:`~aiowsync.SenderGoneError`."""
        if self._face is None:
            raise RuntimeError("receive() needs a connected receiver")
        current = self._face.version
        try:
            return self._face.wait_for_version(current + 1, timeout or 0.0)
        except TimeoutError:
            return None

    @property
    def version(self) -> int:
        """Sender: the latest version sent (to any worker). Receiver: the version its model
        runs. -1 before either is connected."""
        faces = [self._face] if self._face is not None else self._faces
        return max((f.version for f in faces), default=-1)

    # -- both ---------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the scheme: the sender's shared-memory files are removed, a receiver's model
        keeps its last version. Idempotent."""
        with self._closing:
            self._shut = True
            unsettled, self._unsettled = self._unsettled, []
            faces = [f for f in [self._face, *self._faces] if f is not None]
            self._face, self._faces = None, []
            for handle in self._guard_handles:
                handle.remove()
            self._guard_handles = []
        try:
            # Sends made with sync=False end (each within its deadline) before the scheme goes.
            concurrent.futures.wait([f for f, _ in unsettled])
            for face in faces:
                face.close()
        finally:
            super().shutdown()
        raise_failed(unsettled)  # one that failed since the last update

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()
        for runtime in _RUNTIME:
            state.pop(runtime, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._set_runtime()


def _shut_at_exit(scheme: Adapter) -> None:
    """Shut ``scheme`` down at interpreter exit, while its loop threads still run (a weak
    reference: the scheme may go earlier)."""
    ref = weakref.ref(scheme)

    def shut() -> None:
        alive = ref()
        if alive is not None:
            try:
                alive.shutdown()
            except WeightSyncError as exc:  # a sync=False send failed, and nobody asked
                log.warning("at exit: %s", exc)

    atexit.register(shut)
