"""The shared-memory scheme: weights travel through slots in /dev/shm on one host."""

from __future__ import annotations

from typing import Any, Literal

from ._channel import LOCAL_BIND, ChannelFactory
from ._config import Heartbeats, Timeouts
from ._planes import (
    ReceiverPlane,
    SenderPlane,
    SharedMemReceiverPlane,
    SharedMemSenderPlane,
    SwitchMode,
)
from ._scheme import WeightSyncScheme
from ._strategy import StrategyName

__all__ = ["SharedMemWeightSyncScheme"]


class SharedMemWeightSyncScheme(WeightSyncScheme):
    """Versioned, tear-free weight broadcast to workers on this host through shared memory.

    The sender copies each version into a free slot (one fused copy, off the event loop) and
    tells the workers where it is; swap-mode workers re-point their model at the slot without
    copying a byte. See :class:`WeightSyncScheme` for the common arguments.

    Args:
        bind: where the sender binds its control socket. By default (``"ipc://@*"``) a fresh
            abstract Unix socket on Linux: cheaper per message than loopback TCP, reachable
            from this host's network namespace only, nothing left behind; a loopback TCP port
            elsewhere.
        num_slots: slots created up front (at least 2).
        max_slots: the most slots the sender creates when versions stay in use side by side
            (sends to subsets of the workers, or workers that missed an ack).
        switch: receivers in swap mode only: how the model is pointed at a new version.
            ``"rebind"`` re-points every parameter and buffer (about a microsecond per tensor
            on the event loop). ``"remap"`` binds the model once to a fixed window of address
            space and maps each new slot over it (Linux): nearly free while the model was not
            read since the last switch, but every page that was read is unmapped at the switch
            (on the event loop) and faulted in again by the next read, about 4 ms and 6 ms
            per 64 MiB here. ``"auto"`` (default) remaps models of 64 or more tensors
            averaging under 1 MiB and re-binds the others. Workers that run their model
            between every two updates of many small tensors may prefer ``"rebind"``; see
            docs/concepts.md.
    """

    _same_host = True

    def __init__(
        self,
        address: str | None = None,
        *,
        num_slots: int = 2,
        max_slots: int = 16,
        switch: SwitchMode = "auto",
        strategy: StrategyName = "tensordict",
        model_id: str = "policy",
        bind: str = LOCAL_BIND,
        timeouts: Timeouts | None = None,
        heartbeats: Heartbeats | None = None,
        channels: ChannelFactory | None = None,
        apply_mode: Literal["auto", "swap", "copy"] = "auto",
        background: bool = True,
    ) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be at least 2, got {num_slots}")
        if max_slots < num_slots:
            raise ValueError(f"max_slots ({max_slots}) must be >= num_slots ({num_slots})")
        if switch not in ("auto", "rebind", "remap"):
            raise ValueError(f"switch must be 'auto', 'rebind' or 'remap', got {switch!r}")
        self.num_slots = num_slots
        self.max_slots = max_slots
        self.switch: SwitchMode = switch
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
        return {"num_slots": self.num_slots, "max_slots": self.max_slots, "switch": self.switch}

    def _sender_plane(self) -> SenderPlane:
        return SharedMemSenderPlane(self.num_slots, self.max_slots)

    def _receiver_plane(self) -> ReceiverPlane:
        return SharedMemReceiverPlane(switch=self.switch)
