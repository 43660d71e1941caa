"""The torch.distributed scheme: weights travel in buckets over process groups, across hosts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from .._planes.base import DataPlane
from .._planes.dist.config import DistributedPlane
from .._planes.dist.groups import Topology
from .._planes.dist.plane import Backend
from .config import refuse_both
from .scheme import SchemeOptions, WeightSyncScheme

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DistributedWeightSyncScheme"]


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
        bucket_bytes: size of one bucket; by default chosen from the model's size, the
            topology and ``num_workers`` when the sender starts (32 MiB for a star; for a
            chain, the model's size / (8 x ``num_workers``) between 1 and 32 MiB, so that it
            pipelines). See the distributed page of the docs.
        data_host: the address the sender's store and process groups listen on; by default
            the host of ``bind``. Needed when ``bind`` is a wildcard such as ``0.0.0.0``.
        max_slots: the most version copies the sender keeps (two are made up front; more
            only while a stalled transfer still reads an old one).
        topology: ``"star"`` (default: the sender sends every bucket to every receiver) or
            ``"chain"`` (each link carries the model about once: the sender sends to the
            first receiver, which forwards each bucket to the next as soon as it has it).
        plane: another data plane instead of the one built from the arguments above (then
            none of them may be given).

    The control socket (``tcp://127.0.0.1:0`` unless ``bind`` says otherwise) admits only
    workers that hold the scheme's CURVE keys: made at the first bind and carried by the
    pickled scheme (never the server secret). See :class:`WeightSyncScheme` for the other
    arguments. Receivers built from an address take the same arguments, ``backend`` matching
    the sender's, and the sender's keys:
    ``channels=ZmqChannelFactory(curve=sender.channels.curve.for_receiver())`` (see the
    security page of the docs; ``allow_insecure_bind=True`` on both sides opts out).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        backend: Backend | None = None,
        bucket_bytes: int | None = None,
        data_host: str | None = None,
        max_slots: int | None = None,
        topology: Topology | None = None,
        plane: DataPlane | None = None,
        **options: Unpack[SchemeOptions],
    ) -> None:
        options.setdefault("bind", "tcp://127.0.0.1:0")
        given = {
            "backend": backend,
            "bucket_bytes": bucket_bytes,
            "data_host": data_host,
            "max_slots": max_slots,
            "topology": topology,
        }
        if plane is None:
            plane = DistributedPlane(
                backend="gloo" if backend is None else backend,
                bucket_bytes=bucket_bytes,
                data_host=data_host,
                max_slots=4 if max_slots is None else max_slots,
                topology="star" if topology is None else topology,
            )
        else:
            refuse_both(given, "the torch.distributed plane")
        super().__init__(address, plane=plane, **options)

    def _option(self, name: str) -> Any:
        plane = self.plane
        return getattr(plane, name) if isinstance(plane, DistributedPlane) else None

    @property
    def backend(self) -> Backend | None:
        """The plane's backend (None when the scheme was given another plane)."""
        return cast("Backend | None", self._option("backend"))

    @property
    def bucket_bytes(self) -> int | None:
        """The plane's bucket size in bytes as configured (None when chosen by the sender
        when it starts, or when the scheme was given another plane)."""
        return cast("int | None", self._option("bucket_bytes"))

    @property
    def data_host(self) -> str | None:
        """The address the sender's store and groups listen on, if one was given."""
        return cast("str | None", self._option("data_host"))

    @property
    def max_slots(self) -> int | None:
        """The most version copies the sender keeps (None when given another plane)."""
        return cast("int | None", self._option("max_slots"))

    @property
    def topology(self) -> Topology | None:
        """``"star"`` or ``"chain"`` (None when the scheme was given another plane)."""
        return cast("Topology | None", self._option("topology"))
