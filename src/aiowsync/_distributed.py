"""The torch.distributed scheme: weights travel in buckets over process groups, across hosts."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any, Literal
from urllib.parse import urlsplit

import torch

from ._channel import ChannelFactory
from ._config import Heartbeats, Timeouts
from ._dist_plane import Backend, DistReceiverPlane, DistSenderPlane, host_of
from ._planes import ReceiverPlane, SenderPlane
from ._scheme import WeightSyncScheme
from ._strategy import StrategyName
from ._weights import flatten_weights

__all__ = ["DistributedWeightSyncScheme"]

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024


class DistributedWeightSyncScheme(WeightSyncScheme):
    """Versioned, tear-free weight broadcast over torch.distributed (gloo or NCCL).

    The same API as :class:`SharedMemWeightSyncScheme`; only the way the bytes travel differs.
    The sender creates its own TCP store and process groups (it is rank 0 of each), never the
    default group, so a user's own ``init_process_group`` keeps working beside it. Each version
    is packed into buckets of ``bucket_bytes`` and sent bucket by bucket, packing the next
    bucket while the previous one is on the wire; a receiver receives into a spare copy and
    switches its model only when the whole version arrived. A send to some of the workers uses
    a group of just those workers. A failed or timed-out collective tears its group down and
    the version is retried on a fresh group with the workers that are still alive.

    Args:
        backend: ``"gloo"`` (CPU tensors, any host) or ``"nccl"`` (CUDA tensors, GPU hosts).
        bucket_bytes: size of one bucket; see docs/distributed.md for how to choose it.
        data_host: the address the sender's store and process groups listen on; by default
            the host of ``bind``. Needed when ``bind`` is a wildcard such as ``0.0.0.0``.
        max_slots: the most version copies the sender keeps (two are made up front; more
            only while a stalled transfer still reads an old one).

    See :class:`WeightSyncScheme` for the other arguments. Receivers built from an address take
    the same arguments; ``backend`` must match the sender's.
    """

    _same_host = False

    def __init__(
        self,
        address: str | None = None,
        *,
        backend: Backend = "gloo",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        data_host: str | None = None,
        max_slots: int = 4,
        strategy: StrategyName = "tensordict",
        model_id: str = "policy",
        bind: str = "tcp://127.0.0.1:0",
        timeouts: Timeouts | None = None,
        heartbeats: Heartbeats | None = None,
        channels: ChannelFactory | None = None,
        apply_mode: Literal["auto", "swap", "copy"] = "auto",
        background: bool = True,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive integer, got {bucket_bytes!r}")
        if max_slots < 2:
            raise ValueError(f"max_slots must be at least 2, got {max_slots}")
        self.backend: Backend = backend
        self.bucket_bytes = bucket_bytes
        self.data_host = data_host
        self.max_slots = max_slots
        super().__init__(
            address,
            strategy=strategy,
            model_id=model_id,
            bind=bind,
            timeouts=timeouts,
            heartbeats=heartbeats,
            channels=channels,
            apply_mode=apply_mode,
            background=background,
        )

    def _extra_config(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "bucket_bytes": self.bucket_bytes,
            "data_host": self.data_host,
            "max_slots": self.max_slots,
        }

    def _device(self, tensors: Iterable[torch.Tensor]) -> torch.device:
        """Where the slots live: CPU for gloo; the model's GPU (or the current one) for NCCL."""
        if self.backend != "nccl":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise RuntimeError("backend='nccl' needs CUDA, and torch sees no GPU here")
        for t in tensors:
            if t.device.type == "cuda":
                return t.device
        return torch.device("cuda", torch.cuda.current_device())

    def _sender_plane(self) -> SenderPlane:
        if self.data_host is None and urlsplit(self.bind).scheme != "tcp":
            raise ValueError(
                f"bind={self.bind!r} is not a tcp:// address, so it names no host for the "
                "process groups; pass data_host= with the address receivers should reach them on"
            )
        host = self.data_host or host_of(self.bind)
        try:
            wildcard = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            wildcard = False
        if wildcard or host == "*":
            raise ValueError(
                f"bind={self.bind!r} listens on every interface; pass data_host= with the "
                "address receivers should reach the sender's process groups on"
            )
        source = self._model if self._model is not None else self._weights
        assert source is not None
        return DistSenderPlane(
            backend=self.backend,
            bucket_bytes=self.bucket_bytes,
            host=host,
            device=self._device(flatten_weights(source).values()),
            max_slots=self.max_slots,
            announce_host=bool(self.data_host),
        )

    def _receiver_plane(self) -> ReceiverPlane:
        assert self.worker_idx is not None
        return DistReceiverPlane(
            address=self.address,
            worker_idx=self.worker_idx,
            backend=self.backend,
            device=self._device(self._targets.values()),
        )
