"""The torch.distributed scheme: weights travel in buckets over process groups, across hosts."""

from __future__ import annotations

import ipaddress
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import torch

from .._exceptions import ExperimentalWarning
from .._planes.base import DataPlane, ReceiverContext, ReceiverPlane, SenderContext, SenderPlane
from .._planes.dist.groups import Topology
from .._planes.dist.plane import Backend, DistSenderPlane, host_of
from .._planes.dist.receiver import DistReceiverPlane
from .scheme import SchemeOptions, WeightSyncScheme

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DEFAULT_BUCKET_BYTES", "DistributedPlane", "DistributedWeightSyncScheme"]

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class DistributedPlane(DataPlane):
    """torch.distributed process groups of the sender's own (gloo or NCCL).

    Args:
        backend: ``"gloo"`` (CPU tensors, any host) or ``"nccl"`` (CUDA tensors, GPU hosts;
            experimental: written for GPU hosts, not yet proven on one).
        bucket_bytes: size of one bucket; see the distributed page of the docs.
        data_host: the address the sender's store and process groups listen on; by default
            the host of the scheme's ``bind``. Needed when ``bind`` is a wildcard.
        max_slots: the most version copies the sender keeps (two are made up front; more
            only while a stalled transfer still reads an old one).
        topology: ``"star"`` (the sender sends every bucket to every receiver) or
            ``"chain"`` (the sender sends to the first receiver, and each receiver forwards
            every bucket to the next as soon as it has it).
    """

    backend: Backend = "gloo"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    data_host: str | None = None
    max_slots: int = 4
    topology: Topology = "star"

    integrity_by_default = True  # bytes cross a network: digests are on unless turned off

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        size = self.bucket_bytes
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"bucket_bytes must be a positive integer, got {size!r}")
        if self.max_slots < 2:
            raise ValueError(f"max_slots must be at least 2, got {self.max_slots}")
        if self.topology not in ("star", "chain"):
            raise ValueError(f"topology must be 'star' or 'chain', got {self.topology!r}")
        if self.backend == "nccl":
            warnings.warn(
                "backend='nccl' is experimental: written for GPU hosts, it has not yet been "
                "proven on one; gloo is the tested backend",
                ExperimentalWarning,
                stacklevel=3,
            )

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

    def can_swap(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        if self.backend != "nccl":
            return DataPlane.can_swap(self, tensors)  # (no zero-argument super: slots=True)
        return len({t.device for t in tensors.values()}) == 1 and all(
            t.device.type == "cuda" for t in tensors.values()
        )

    def _host(self, bind: str) -> str:
        if self.data_host is None and urlsplit(bind).scheme != "tcp":
            raise ValueError(
                f"bind={bind!r} is not a tcp:// address, so it names no host for the "
                "process groups; pass data_host= with the address receivers should reach them on"
            )
        host = self.data_host or host_of(bind)
        try:
            wildcard = ipaddress.ip_address(host).is_unspecified
        except ValueError:
            wildcard = False
        if wildcard or host == "*":
            raise ValueError(
                f"bind={bind!r} listens on every interface; pass data_host= with the "
                "address receivers should reach the sender's process groups on"
            )
        return host

    def sender(self, context: SenderContext) -> SenderPlane:
        return DistSenderPlane(
            backend=self.backend,
            bucket_bytes=self.bucket_bytes,
            host=self._host(context.bind),
            device=self._device(context.tensors.values()),
            max_slots=self.max_slots,
            announce_host=bool(self.data_host),
            chain_wait=context.timeouts.transfer,
            topology=self.topology,
        )

    def receiver(self, context: ReceiverContext) -> ReceiverPlane:
        return DistReceiverPlane(
            address=context.address,
            worker_idx=context.worker_idx,
            backend=self.backend,
            device=self._device(context.tensors.values()),
        )


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
        backend: ``"gloo"`` (CPU tensors, any host) or ``"nccl"`` (CUDA tensors, GPU hosts;
            experimental: it has not run on a GPU host yet).
        bucket_bytes: size of one bucket; see the distributed page of the docs.
        data_host: the address the sender's store and process groups listen on; by default
            the host of ``bind``. Needed when ``bind`` is a wildcard such as ``0.0.0.0``.
        max_slots: the most version copies the sender keeps (two are made up front; more
            only while a stalled transfer still reads an old one).
        topology: ``"star"`` (default: the sender sends every bucket to every receiver) or
            ``"chain"`` (each link carries the model about once: the sender sends to the
            first receiver, which forwards each bucket to the next as soon as it has it).
        plane: another data plane instead of the one built from the arguments above.

    See :class:`WeightSyncScheme` for the other arguments. Receivers built from an address take
    the same arguments; ``backend`` must match the sender's.
    """

    _CONFIG = (
        *WeightSyncScheme._CONFIG,
        "backend",
        "bucket_bytes",
        "data_host",
        "max_slots",
        "topology",
    )

    def __init__(
        self,
        address: str | None = None,
        *,
        backend: Backend = "gloo",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        data_host: str | None = None,
        max_slots: int = 4,
        topology: Topology = "star",
        plane: DataPlane | None = None,
        **options: Unpack[SchemeOptions],
    ) -> None:
        options.setdefault("bind", "tcp://127.0.0.1:0")
        self.backend: Backend = backend
        self.bucket_bytes = bucket_bytes
        self.data_host = data_host
        self.max_slots = max_slots
        self.topology: Topology = topology
        super().__init__(
            address,
            plane=plane
            or DistributedPlane(
                backend=backend,
                bucket_bytes=bucket_bytes,
                data_host=data_host,
                max_slots=max_slots,
                topology=topology,
            ),
            **options,
        )
