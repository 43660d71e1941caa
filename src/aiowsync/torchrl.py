"""aiowsync schemes that TorchRL's collectors take as their own weight-sync schemes.

A collector given ``weight_sync_schemes={"policy": aiowsync.torchrl.SharedMemWeightSyncScheme()}``
keeps TorchRL's collection loop and calls, and moves the weights with aiowsync: versioned, with
a switch that no forward of a worker's policy can straddle, and with aiowsync's errors
(``WeightSyncTimeout``, ``WorkerLostError``, ``RemoteApplyError``, ``LayoutMismatchError``)
raised from ``collector.update_policy_weights_()`` instead of a hang.

How TorchRL (0.14) drives a scheme, and what these classes do at each step:

- The trainer's collector calls ``init_on_sender(model_id=..., context=collector)``: the
  scheme takes the model from the collector and its worker count from ``collector.num_workers``,
  and starts serving (an aiowsync scheme entered on a private event loop, see
  :func:`aiowsync.blocking`). A collector without worker processes has no workers: its policy
  is the trainer's model itself, and explicit weights are copied into it.
- The collector pickles the scheme into each worker process; the pickle carries the address.
- A worker calls ``init_on_receiver(model=policy, model_id=..., worker_idx=i)`` and then
  ``connect(worker_idx=i)``, which returns once the policy holds the trainer's weights (TorchRL
  hands workers a policy whose tensors are on the meta device; they get memory of their own
  first). A background task applies each new version; a guard around the policy's forward
  keeps a switch out of any forward.
- The trainer's ``connect()`` returns once every worker holds version 0; each
  ``update_policy_weights_()`` is a ``send()`` that returns once every worker runs the new
  version, so every frame collected afterwards ran it.
- ``scheme.shutdown()`` leaves the scheme: the trainer's removes its shared-memory files.
  TorchRL's ``collector.shutdown()`` does not call it; call it yourself after the collector's
  (it also runs at interpreter exit, on both sides).

May import: aiowsync, aiowsync._exceptions, aiowsync._config, aiowsync._scheme,
aiowsync._sending.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from torch import nn

try:
    from torchrl.weight_update import WeightSyncScheme as _TorchRLScheme
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "aiowsync.torchrl needs TorchRL: pip install 'aiowsync[torchrl]' "
        "(with torch==2.13.0 pinned in the same pip call)"
    ) from exc

from ._scheme.base import resolve_model
from ._scheme.blocking import BlockingScheme, blocking
from ._scheme.distributed import DistributedWeightSyncScheme as _DistScheme
from ._scheme.scheme import WeightSyncScheme as _Scheme
from ._scheme.shared_mem import SharedMemWeightSyncScheme as _ShmScheme
from ._sending.engine import SendResult

__all__ = ["DistributedWeightSyncScheme", "SharedMemWeightSyncScheme"]

CONNECT_TIMEOUT_S = 120.0
"""Default deadline of ``connect()`` on either side: worker processes import torch and build
their environments first."""


class _Adapter(_TorchRLScheme):  # type: ignore[misc]  # torchrl ships no type information
    """The TorchRL face of one aiowsync scheme (see the module's text)."""

    def __init__(
        self,
        strategy: str = "tensordict",
        *,
        connect_timeout: float = CONNECT_TIMEOUT_S,
        send_timeout: float | None = None,
        **options: Any,
    ) -> None:
        super().__init__(strategy=strategy)
        self.connect_timeout = connect_timeout
        self.send_timeout = send_timeout
        self._options = dict(options, strategy=strategy)
        self._inner: _Scheme | None = None
        self._face: BlockingScheme | None = None
        self._local: nn.Module | None = None
        self._guard_handles: list[Any] = []
        self._closing = threading.Lock()

    def _make(self, **options: Any) -> _Scheme:
        raise NotImplementedError

    # -- TorchRL's abstract hooks -------------------------------------------------------------

    def create_transport(self, **kwargs: Any) -> Any:
        """Not used: an aiowsync scheme carries its own control channel and data plane."""
        raise NotImplementedError("aiowsync schemes carry their own transport")

    # -- sender -------------------------------------------------------------------------------

    def _init_on_sender_impl(
        self, model_id: str, context: Any = None, *, model: Any = None, **kwargs: Any
    ) -> None:
        self.model_id = model_id
        self.context = context
        if model is None and context is not None:
            model = resolve_model(context, model_id)
            if model is None:
                model = getattr(context, "_fallback_policy", None)
        if model is None:
            raise ValueError(
                f"no model for {model_id!r}: give the collector a policy (a policy_factory "
                "alone leaves the trainer with no weights to send)"
            )
        workers = kwargs.get("num_workers", getattr(context, "num_workers", None))
        if not workers:
            # A collector without worker processes runs the trainer's own policy.
            self._local = model
            return
        inner = self._make(**self._options)
        inner.init_on_sender(model=model, num_workers=int(workers))
        self._inner = inner
        self._face = blocking(inner).__enter__()  # serving before the workers are started
        _shut_at_exit(self)

    def _setup_connection_and_weights_on_sender_impl(
        self, *, worker_idx: int | None = None, weights: Any = None
    ) -> None:
        if self._face is None:
            return
        self._face.connect(self.connect_timeout)
        if weights is not None:  # first weights other than the model's: a version of their own
            self._face.send(weights, timeout=self.send_timeout)

    def send(self, weights: Any = None, worker_ids: Any = None) -> SendResult | None:
        """Send ``weights`` (by default the trainer's model) as a new version; returns once
        every targeted worker runs it. Raises aiowsync's errors, naming the workers."""
        if self._face is None:
            if self._local is None:
                raise RuntimeError("send() needs init_on_sender() first")
            if weights is not None and weights is not self._local:
                self._strategy.apply_weights(self._local, weights, inplace=True)
            return None
        if isinstance(weights, str):
            weights = resolve_model(self.context, weights)
        return self._face.send(weights, _worker_ids(worker_ids), self.send_timeout)

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
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            # TorchRL ships the policy to its workers without memory: give it some, which the
            # first version fills before connect() returns.
            model.to_empty(device="cpu")
        inner = self._inner
        if inner is None:
            raise RuntimeError("this scheme was not made by pickling a sender's")
        inner.init_on_receiver(model=model, worker_idx=worker_idx)
        self._guard_forward(model, inner)

    def _guard_forward(self, model: nn.Module, inner: _Scheme) -> None:
        """Hold the read guard for each forward of ``model``: a switch waits for it to end."""
        guard = inner.read_guard()
        held = threading.local()  # a forward whose pre-hooks failed never took the guard

        def enter(module: nn.Module, args: Any) -> None:
            guard.acquire()
            held.depth = getattr(held, "depth", 0) + 1

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if getattr(held, "depth", 0) > 0:
                held.depth -= 1
                guard.release()

        self._guard_handles = [
            model.register_forward_pre_hook(enter),
            model.register_forward_hook(leave, always_call=True),
        ]

    def _setup_connection_and_weights_on_receiver_impl(
        self, *, worker_idx: int | None = None
    ) -> None:
        if self._inner is None:
            raise RuntimeError("init_on_receiver() first")
        face = blocking(self._inner).__enter__()
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
        """Sender: the latest version sent. Receiver: the version its model runs."""
        return self._face.version if self._face is not None else -1

    # -- both ---------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the scheme: the sender's shared-memory files are removed, a receiver's model
        keeps its last version. Idempotent."""
        with self._closing:
            face, self._face = getattr(self, "_face", None), None
            for handle in getattr(self, "_guard_handles", []):
                handle.remove()
            self._guard_handles = []
        try:
            if face is not None:
                face.close()
        finally:
            super().shutdown()

    def __getstate__(self) -> dict[str, Any]:
        state: dict[str, Any] = super().__getstate__()
        for runtime in ("_face", "_local", "_guard_handles", "_closing"):
            state.pop(runtime, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._face, self._local, self._guard_handles = None, None, []
        self._closing = threading.Lock()


def _shut_at_exit(scheme: _Adapter) -> None:
    """Shut ``scheme`` down at interpreter exit, while its loop thread still runs (a weak
    reference: the scheme may go earlier)."""
    ref = weakref.ref(scheme)

    def shut() -> None:
        alive = ref()
        if alive is not None:
            alive.shutdown()

    atexit.register(shut)


def _worker_ids(worker_ids: Any) -> int | Sequence[int] | None:
    if worker_ids is None or isinstance(worker_ids, int):
        return worker_ids
    if isinstance(worker_ids, (list, tuple)) and all(isinstance(w, int) for w in worker_ids):
        return list(worker_ids)
    raise ValueError(f"worker_ids={worker_ids!r}: aiowsync's TorchRL schemes name workers by index")


class SharedMemWeightSyncScheme(_Adapter):
    """TorchRL's scheme interface over :class:`aiowsync.SharedMemWeightSyncScheme` (one host).

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"``, as for TorchRL's schemes.
        connect_timeout: deadline of ``connect()`` on either side, in seconds.
        send_timeout: deadline of each send (by default aiowsync's ``Timeouts``).
        **options: any keyword of :class:`aiowsync.SharedMemWeightSyncScheme`
            (``timeouts``, ``heartbeats``, ``apply_mode``, ...).
    """

    def _make(self, **options: Any) -> _Scheme:
        return _ShmScheme(**options)


class DistributedWeightSyncScheme(_Adapter):
    """TorchRL's scheme interface over :class:`aiowsync.DistributedWeightSyncScheme`.

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"``, as for TorchRL's schemes.
        connect_timeout: deadline of ``connect()`` on either side, in seconds.
        send_timeout: deadline of each send (by default aiowsync's ``Timeouts``).
        **options: any keyword of :class:`aiowsync.DistributedWeightSyncScheme`
            (``backend``, ``bind``, ``data_host``, ``bucket_bytes``, ...).
    """

    def _make(self, **options: Any) -> _Scheme:
        options.setdefault("backend", "gloo")
        return _DistScheme(**options)
