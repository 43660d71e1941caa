"""The torch.distributed data plane as a scheme takes it: its configuration, which makes the
sender's half (:mod:`.plane`) and the receivers' half (:mod:`.receiver`)."""

from __future__ import annotations

import ipaddress
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch

from aiowsync._exceptions import ExperimentalWarning

from ..base import DataPlane, ReceiverContext, ReceiverPlane, SenderContext, SenderPlane
from .groups import Topology
from .plane import Backend, DistSenderPlane, host_of
from .receiver import DistReceiverPlane

__all__ = ["DistributedPlane"]


@dataclass(frozen=True, slots=True)
class DistributedPlane(DataPlane):
    """torch.distributed process groups of the sender's own (gloo or NCCL).

    Args:
        backend: ``"gloo"`` (CPU tensors, any host) or ``"nccl"`` (CUDA tensors, GPU hosts;
            experimental: written for GPU hosts, not yet proven on one).
        bucket_bytes: size of one bucket; None (the default) chooses it from the model's
            size, the topology and the number of workers when the sender starts (see
            :func:`~aiowsync._planes.dist.buckets.choose_bucket_bytes` and the distributed
            page of the docs).
        data_host: the address the sender's store and process groups listen on; by default
            the host of the scheme's ``bind``. Needed when ``bind`` is a wildcard.
        max_slots: the most version copies the sender keeps (two are made up front; more
            only while a stalled transfer still reads an old one).
        topology: ``"star"`` (the sender sends every bucket to every receiver) or
            ``"chain"`` (the sender sends to the first receiver, and each receiver forwards
            every bucket to the next as soon as it has it).
    """

    backend: Backend = "gloo"
    bucket_bytes: int | None = None
    data_host: str | None = None
    max_slots: int = 4
    topology: Topology = "star"

    integrity_by_default = True  # bytes cross a network: digests are on unless turned off

    def __post_init__(self) -> None:
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        size = self.bucket_bytes
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
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
            members=context.num_workers,
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
