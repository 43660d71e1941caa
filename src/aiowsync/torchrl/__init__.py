"""aiowsync schemes that TorchRL's collectors take as their own weight-sync schemes.

A collector given ``weight_sync_schemes={"policy": aiowsync.torchrl.SharedMemWeightSyncScheme()}``
keeps TorchRL's collection loop and calls, and moves the weights with aiowsync: versioned, with
a switch that no forward of a worker's policy can straddle, and with aiowsync's errors
(``WeightSyncTimeout``, ``WorkerLostError``, ``RemoteApplyError``, ``LayoutMismatchError``)
raised from ``collector.update_policy_weights_()`` instead of a hang.

How TorchRL (0.14) drives a scheme, and what these classes do at each step:

- The trainer's collector calls ``init_on_sender(model_id=..., context=collector)`` (or the
  user calls it first, with ``model=``/``weights=`` and ``devices=`` or ``num_workers=``, or
  with ``params_map=``). The scheme finds the weights: the collector's policy, else one built
  from its policy factory. Distinct factories (or ``per_worker_weights=True``, or a
  ``params_map`` of distinct weights) give each worker weights of its own, and a scheme each.
  It starts serving (on a private event loop, see :func:`aiowsync.blocking`). A collector
  without worker processes has no workers: its policy is the trainer's model itself, and
  explicit weights are copied into it.
- The collector pickles the scheme into each worker process; the pickle carries the address.
- A worker calls ``init_on_receiver(model_id=..., context=collector, worker_idx=i)`` and then
  ``connect(worker_idx=i)``, which returns once the policy holds the trainer's weights (TorchRL
  hands workers a policy whose tensors are on the meta device; they get memory of their own
  first). A background task copies each new version into the policy; a guard around the
  policy's forward keeps a switch out of any forward, and a collector that tracks policy
  versions counts one per version.
- The trainer's ``connect()`` returns once every worker holds version 0; each
  ``update_policy_weights_()`` is a ``send()`` that returns once every worker runs the new
  version, so every frame collected afterwards ran it.
- ``scheme.shutdown()`` leaves the scheme: the trainer's removes its shared-memory files.
  TorchRL's ``collector.shutdown()`` does not call it; call it yourself after the collector's
  (it also runs at interpreter exit, on both sides).

May import: aiowsync, aiowsync._exceptions, aiowsync._config, aiowsync._scheme,
aiowsync._sending, aiowsync._weights.
"""

from __future__ import annotations

from typing import Any

try:
    import torchrl.weight_update  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "aiowsync.torchrl needs TorchRL: pip install 'aiowsync[torchrl]' "
        "(with torch==2.13.0 pinned in the same pip call)"
    ) from exc

from .._scheme.distributed import DistributedWeightSyncScheme as _DistScheme
from .._scheme.scheme import WeightSyncScheme as _Scheme
from .._scheme.shared_mem import SharedMemWeightSyncScheme as _ShmScheme
from ._adapter import CONNECT_TIMEOUT_S, Adapter

__all__ = ["CONNECT_TIMEOUT_S", "DistributedWeightSyncScheme", "SharedMemWeightSyncScheme"]


class SharedMemWeightSyncScheme(Adapter):
    """TorchRL's scheme interface over :class:`aiowsync.SharedMemWeightSyncScheme` (one host).

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"``, as for TorchRL's schemes.
        per_worker_weights: each worker keeps weights of its own (a scheme each), updated by
            ``update_policy_weights_({worker_idx: weights, ...})``; set for you when the
            collector has distinct policy factories.
        sync: ``True``: ``send()`` returns once every worker runs the version. ``False``: once
            the version is staged (the weights may change then); a failure is raised by the
            next ``send()``.
        connect_timeout: deadline of ``connect()`` on either side, in seconds.
        send_timeout: deadline of each send (by default aiowsync's ``Timeouts``).
        **options: any keyword of :class:`aiowsync.SharedMemWeightSyncScheme`
            (``timeouts``, ``heartbeats``, ``apply_mode``, ...). ``apply_mode`` is
            ``"copy"`` unless given: a TorchRL worker may write into its policy.
    """

    def _make(self, **options: Any) -> _Scheme:
        return _ShmScheme(**options)


class DistributedWeightSyncScheme(Adapter):
    """TorchRL's scheme interface over :class:`aiowsync.DistributedWeightSyncScheme`.

    Args:
        strategy: ``"tensordict"`` or ``"state_dict"``, as for TorchRL's schemes.
        per_worker_weights: each worker keeps weights of its own (a scheme each), updated by
            ``update_policy_weights_({worker_idx: weights, ...})``; set for you when the
            collector has distinct policy factories.
        sync: ``True``: ``send()`` returns once every worker runs the version. ``False``: once
            the version is staged (the weights may change then); a failure is raised by the
            next ``send()``.
        connect_timeout: deadline of ``connect()`` on either side, in seconds.
        send_timeout: deadline of each send (by default aiowsync's ``Timeouts``).
        **options: any keyword of :class:`aiowsync.DistributedWeightSyncScheme`
            (``backend``, ``bind``, ``data_host``, ``bucket_bytes``, ...). ``backend`` is
            ``"gloo"`` unless given.
    """

    def _make(self, **options: Any) -> _Scheme:
        options.setdefault("backend", "gloo")
        return _DistScheme(**options)
