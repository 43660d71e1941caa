"""The shared-memory scheme: weights travel through slots in /dev/shm on one host."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from .._channel import LOCAL_BIND
from .._planes.base import DataPlane
from .._planes.shm.plane import SharedMemPlane, SwitchMode
from .config import refuse_both
from .scheme import SchemeOptions, WeightSyncScheme

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["SharedMemWeightSyncScheme"]


class SharedMemWeightSyncScheme(WeightSyncScheme):
    """Versioned, tear-free weight broadcast to workers on this host through shared memory.

    The sender copies each version into a free slot (one fused copy, off the event loop) and
    tells the workers where it is; swap-mode workers re-point their model at the slot without
    copying a byte. See :class:`WeightSyncScheme` for the common arguments.

    Args:
        bind: where the sender binds its control socket. By default (``"ipc://*"``) a fresh
            Unix socket in a new directory of mode 0700 (removed at close): cheaper per
            message than loopback TCP, and the kernel refuses processes of other users before
            they cost the sender anything; a loopback TCP port where there are no Unix
            sockets. ``"ipc://@*"`` binds a fresh abstract socket instead (Linux), which
            workers in another mount namespace of the same network namespace can reach.
            A ``tcp://`` bind (and the loopback port) admits only workers holding the
            scheme's CURVE keys, which the pickled scheme carries (see ``channels``).
        num_slots: slots created up front (at least 2).
        max_slots: the most slots the sender creates when versions stay in use side by side
            (sends to subsets of the workers, or workers that missed an ack).
        switch: receivers in swap mode only: how the model is pointed at a new version.
            ``"rebind"`` re-points every parameter and buffer (about a microsecond per tensor
            on the event loop). ``"remap"`` binds the model once to a fixed window of address
            space and moves each new slot's mapping into it (Linux; about 0.1 ms, whatever
            the number of tensors): each slot keeps its page tables, so a model read after
            every version is not faulted in again. ``"auto"`` (default) remaps models of 64
            or more tensors averaging under 1 MiB and re-binds the others; see the
            receiving page of the docs. Re-bound slots are
            mapped read only: a worker that writes into its weights in swap mode (a BatchNorm
            in train mode, parameter noise) dies of a segmentation fault; give it
            ``switch="remap"`` (one model only: a receiver of several models refuses it in
            swap mode) or ``apply_mode="copy"``.
        plane: another data plane instead of the shared-memory one built from the three
            arguments above (e.g. :class:`MemoryPlane` in tests); then none of them may be
            given.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        num_slots: int | None = None,
        max_slots: int | None = None,
        switch: SwitchMode | None = None,
        plane: DataPlane | None = None,
        **options: Unpack[SchemeOptions],
    ) -> None:
        options.setdefault("bind", LOCAL_BIND)
        if plane is None:
            plane = SharedMemPlane(
                num_slots=2 if num_slots is None else num_slots,
                max_slots=16 if max_slots is None else max_slots,
                switch="auto" if switch is None else switch,
            )
        else:
            given = {"num_slots": num_slots, "max_slots": max_slots, "switch": switch}
            refuse_both(given, "the shared-memory plane")
        super().__init__(address, plane=plane, **options)

    def _option(self, name: str) -> Any:
        plane = self.plane
        return getattr(plane, name) if isinstance(plane, SharedMemPlane) else None

    @property
    def num_slots(self) -> int | None:
        """Slots the plane creates up front (None when the scheme was given another plane)."""
        return cast("int | None", self._option("num_slots"))

    @property
    def max_slots(self) -> int | None:
        """The most slots the plane creates (None when the scheme was given another plane)."""
        return cast("int | None", self._option("max_slots"))

    @property
    def switch(self) -> SwitchMode | None:
        """How swap-mode receivers switch (None when the scheme was given another plane)."""
        return cast("SwitchMode | None", self._option("switch"))
