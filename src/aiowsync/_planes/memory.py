"""In-process twin of the data plane, for fast single-process tests and tools.

It keeps the real planes' contract: versions are staged into slots nobody reads, a slot holding
a pinned version is never rewritten, receivers in swap mode read the sender's slot itself (as
with shared memory, without a byte copied), and staging above ``inline_bytes`` runs in a thread
that cancellation does not stop. Sender and receivers must live in one process; they find each
other through the plane's token, which the welcome carries.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .._copy.engine import CopyPolicy, fused_copy
from .._exceptions import ProtocolError, TransportError
from .._protocol import ParamValue
from .._weights.layout import Layout
from .base import (
    DataPlane,
    Params,
    ReceiverContext,
    ReceiverPlane,
    SenderContext,
    Source,
    Staged,
    WeightSource,
)
from .slot_table import InPlaceSenderPlane, SlotTable, check_slot_counts
from .stager import INLINE_COPY_BYTES, Stager

__all__ = ["MemoryPlane", "MemoryReceiverPlane", "MemorySenderPlane"]

_planes: weakref.WeakValueDictionary[str, MemorySenderPlane] = weakref.WeakValueDictionary()
_planes_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class MemoryPlane(DataPlane):
    """Slots in this process's memory; receivers must run in the same process.

    Pair it with :class:`MemoryChannelFactory` to run a scheme's sender and receivers in one
    process, e.g. ``WeightSyncScheme(plane=MemoryPlane(), channels=MemoryChannelFactory())``.

    Args:
        num_slots: slots created up front (at least 2).
        max_slots: the most slots the sender creates when versions stay in use side by side.
        inline_bytes: versions up to this size are copied on the event loop, larger ones in a
            staging thread (set it to 0 to exercise the thread with small models).
    """

    num_slots: int = 2
    max_slots: int = 16
    inline_bytes: int = INLINE_COPY_BYTES

    def __post_init__(self) -> None:
        check_slot_counts(self.num_slots, self.max_slots)
        if self.inline_bytes < 0:
            raise ValueError(f"inline_bytes must be >= 0, got {self.inline_bytes}")

    def sender(self, context: SenderContext) -> MemorySenderPlane:
        return MemorySenderPlane(self.num_slots, self.max_slots, self.inline_bytes)

    def receiver(self, context: ReceiverContext) -> MemoryReceiverPlane:
        return MemoryReceiverPlane()


def _complete_tensors(
    layout: Layout, source: Source, latest: Sequence[torch.Tensor] | None
) -> dict[str, torch.Tensor]:
    """Every key's tensor for ``source`` (given as ``tensors``): its own, and for the models
    it carries, views of ``latest`` (the buffers of the newest version)."""
    assert source.tensors is not None
    tensors = dict(source.tensors)
    if source.carry:
        if latest is None:
            raise ValueError("a send of some models needs an earlier version to take the rest from")
        views = layout.views(latest)
        for section in source.carry:
            for key in layout.section_keys(section):
                tensors[key] = views[key]
    return tensors


class MemorySenderPlane(InPlaceSenderPlane):
    what = "in-process"

    def __init__(self, num_slots: int, max_slots: int, inline_bytes: int) -> None:
        self.num_slots = num_slots
        self.token = secrets.token_hex(8)
        self._slots = SlotTable(self._make, max_slots=max_slots)
        self._stager = Stager(inline_bytes)
        self._policy = CopyPolicy()
        self._closed = False

    def _make(self, index: int) -> list[torch.Tensor]:
        return self.layout.allocate()

    def setup(self, layout: Layout) -> None:
        self.layout = layout
        for _ in range(self.num_slots):
            self._slots.add()
        with _planes_lock:
            _planes[self.token] = self

    def welcome_params(self) -> dict[str, ParamValue]:
        return {"plane": self.token}

    async def stage(self, slot: int, source: WeightSource) -> None:
        parts = self._slots[slot].value
        layout = self.layout

        latest = self._slots[self.latest].value if self.latest is not None else None

        def copy() -> None:
            snapshot = source.snapshot()
            if snapshot.buffers is not None:
                fused_copy(parts, list(snapshot.buffers), self._policy)
            elif snapshot.tensors is not None:
                views = layout.views(parts)
                keys = layout.keys
                tensors = _complete_tensors(layout, snapshot, latest)
                fused_copy([views[k] for k in keys], [tensors[k] for k in keys], self._policy)
            else:
                raise ValueError("empty source")

        await self._stager.run(layout.total_bytes, copy)

    def where(self, index: int) -> Params:
        return {"slot": index, "nbytes": self.layout.total_bytes}

    def staged_buffers(self, slot: int) -> list[torch.Tensor]:
        return self.buffers_of(slot)

    def buffers_of(self, slot: int) -> list[torch.Tensor]:
        if self._closed:
            raise TransportError("the in-process plane is closed")
        parts: list[torch.Tensor] = self._slots[slot].value
        return parts

    def close(self) -> None:
        self._closed = True
        self._stager.close()
        self._policy.close(wait=False)
        with _planes_lock:
            if _planes.get(self.token) is self:
                del _planes[self.token]


class MemoryReceiverPlane(ReceiverPlane):
    def setup(
        self, layout: Layout, welcome: Mapping[str, ParamValue], *, swap: bool = True
    ) -> None:
        token = welcome.get("plane")
        if not isinstance(token, str):
            raise ProtocolError(f"the welcome names no in-process plane: {dict(welcome)}")
        with _planes_lock:
            sender = _planes.get(token)
        if sender is None:
            raise TransportError(f"no in-process plane {token!r} in this process")
        self.layout = layout
        self._sender: MemorySenderPlane | None = sender
        self._views: dict[int, Staged] = {}

    def fetch_nowait(self, params: Mapping[str, ParamValue]) -> Staged:
        slot, nbytes = params.get("slot"), params.get("nbytes")
        if not isinstance(slot, int) or not isinstance(nbytes, int):
            raise ProtocolError(f"update parameters lack a slot and size: {dict(params)}")
        if nbytes != self.layout.total_bytes:
            raise ProtocolError(
                f"slot of {nbytes} bytes, the layout needs {self.layout.total_bytes}"
            )
        if self._sender is None:
            raise TransportError("the in-process plane is closed")
        staged = self._views.get(slot)
        if staged is None:
            try:
                parts = self._sender.buffers_of(slot)
            except IndexError:
                raise ProtocolError(f"no slot {slot}") from None
            staged = self._views[slot] = Staged(
                parts, self.layout.views(parts), str(slot), shared=True
            )
        return staged

    async def fetch(self, params: Mapping[str, ParamValue]) -> Staged:
        return self.fetch_nowait(params)

    def close(self) -> None:
        self._views = {}
        self._sender = None
