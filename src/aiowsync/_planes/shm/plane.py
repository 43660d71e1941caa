"""The shared-memory data plane: slots in /dev/shm that receivers on this host map by name."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from aiowsync._exceptions import ProtocolError, TransportError
from aiowsync._protocol import ParamValue
from aiowsync._weights.layout import Layout

from ..base import (
    DataPlane,
    ReceiverContext,
    ReceiverPlane,
    SenderContext,
    Staged,
)
from ..slot_table import check_slot_counts
from .sender import SharedMemSenderPlane
from .slots import SlotFile, check_slot_path
from .window import SlotWindow, windows_supported

__all__ = ["SharedMemPlane", "SharedMemReceiverPlane", "SharedMemSenderPlane", "SwitchMode"]

# The sender's half lives in its own module.

log = logging.getLogger("aiowsync.shm")

_KEPT_MAPPINGS = 32
"""Slot files a receiver keeps mapped (a sender has a few slots; at most 16 by default)."""

SwitchMode = Literal["auto", "rebind", "remap"]


def window_pays(layout: Layout) -> bool:
    """Whether ``switch="auto"`` remaps a window for this layout rather than re-binding.

    Re-binding costs about a microsecond per tensor on the event loop. Moving a window's
    mapping costs about 0.1 ms whatever the number of tensors, and the look for pages the
    worker wrote, after the switch, grows with the bytes it read (about 0.7 ms for 64 MiB):
    many small tensors favour the window, a few large ones the re-binding (docs/receiving.md
    has the figures).
    """
    count = len(layout.specs)
    return count >= 64 and layout.total_bytes < count * (1 << 20)


@dataclass(frozen=True, slots=True)
class SharedMemPlane(DataPlane):
    """Slots in ``/dev/shm`` on this host: the sender copies each version into a free slot,
    receivers map it by name (swap mode copies nothing).

    Args:
        num_slots: slots created up front (at least 2).
        max_slots: the most slots the sender creates when versions stay in use side by side
            (sends to subsets of the workers, or workers that missed an ack).
        switch: receivers in swap mode only: how the model is pointed at a new version (see
            :class:`SharedMemWeightSyncScheme`).
    """

    num_slots: int = 2
    max_slots: int = 16
    switch: SwitchMode = "auto"

    def __post_init__(self) -> None:
        check_slot_counts(self.num_slots, self.max_slots)
        if self.switch not in ("auto", "rebind", "remap"):
            raise ValueError(f"switch must be 'auto', 'rebind' or 'remap', got {self.switch!r}")

    def sender(self, context: SenderContext) -> SharedMemSenderPlane:
        return SharedMemSenderPlane(self.num_slots, self.max_slots)

    def receiver(self, context: ReceiverContext) -> SharedMemReceiverPlane:
        return SharedMemReceiverPlane(switch=self.switch)


class SharedMemReceiverPlane(ReceiverPlane):
    """Maps the sender's slot files by name, once each, and hands out typed views of them.

    Mappings are read only: a write into a model bound to one (a BatchNorm left in train
    mode) faults in this worker instead of changing the sender's slot and the other workers'
    weights. The slot window maps each version privately instead (ADR 0056).
    """

    def __init__(self, *, switch: SwitchMode = "auto") -> None:
        self._mapped: dict[str, Staged] = {}
        self._files: dict[str, list[torch.Tensor]] = {}
        """Several models: each slot file's buffers, by path."""
        self._switch = switch
        self._window: SlotWindow | None = None
        self._window_staged: Staged | None = None

    def setup(
        self, layout: Layout, welcome: Mapping[str, ParamValue], *, swap: bool = True
    ) -> None:
        self.layout = layout
        self._expected = layout.total_bytes
        owner = welcome.get("owner")
        # Only files named after the sender's pid are mapped (paths come from the wire).
        self._owner = owner if isinstance(owner, int) and owner > 0 else None
        if self._owner is None:
            raise ProtocolError(f"the welcome names no sender pid: {dict(welcome)}")
        # A window maps one file; a version of several models spans several (re-binding).
        wanted = not layout.sectioned and (
            self._switch == "remap" or (self._switch == "auto" and window_pays(layout))
        )
        if swap and wanted and not windows_supported():
            level = logging.WARNING if self._switch == "remap" else logging.INFO
            log.log(level, "no slot windows on this platform; switches re-bind each tensor")
        elif swap and wanted:
            try:
                self._window = SlotWindow(layout.total_bytes)
            except (OSError, TransportError) as exc:
                log.info("no slot window (%s); switches re-bind each tensor", exc)
            else:
                parts = layout.split(self._window.tensor)
                self._window_staged = Staged(
                    parts, layout.views(parts), "window", bind_once=True, shared=True
                )

    def show(self, staged: Staged) -> Staged:
        if self._window is None or self._window_staged is None:
            return staged
        self._window.show(staged.source)
        return self._window_staged

    def fetch_nowait(self, params: Mapping[str, ParamValue]) -> Staged:
        if self.layout.sectioned:
            return self._fetch_models(params)
        path, nbytes = params.get("path"), params.get("nbytes")
        if not isinstance(path, str) or not isinstance(nbytes, int):
            raise ProtocolError(f"update parameters lack a slot path and size: {dict(params)}")
        if nbytes != self._expected:
            raise ProtocolError(f"slot of {nbytes} bytes, the layout needs {self._expected}")
        if self._window is not None:
            # The window maps the slot itself; views of each slot would only cost memory. The
            # file is opened (and its path checked) now, so the switch itself cannot fail on it.
            check_slot_path(path, self._owner)
            self._window.open(path)
            return Staged([], {}, path, shared=True)
        return self._map(path, nbytes)

    def _map(self, path: str, nbytes: int, *, fd: int | None = None) -> Staged:
        """Slot file ``path`` mapped on its own (once, then cached); through ``fd`` when
        given (a descriptor of it that the window keeps)."""
        views = self._mapped.get(path)
        if views is None:
            # Paths come from the wire: checked before anything is opened, once per path.
            check_slot_path(path, self._owner)
            if len(self._mapped) >= _KEPT_MAPPINGS:
                # A sender has a few slots; a cache of every path ever named would grow.
                self._mapped.pop(next(iter(self._mapped)))
            if fd is None:
                file = SlotFile.open(path, nbytes, writable=False)
            else:
                file = SlotFile.open_descriptor(path, fd, nbytes)
            parts = self.layout.split(file.tensor)
            views = self._mapped[path] = Staged(parts, self.layout.views(parts), path, shared=True)
        return views

    def lease_buffers(self, staged: Staged) -> list[torch.Tensor] | None:
        if staged.buffers or self._window is None:
            return super().lease_buffers(staged)
        # The window shows whichever slot is live: a lease maps that slot itself, through the
        # descriptor the window keeps of it, which holds once the sender has removed the
        # file's name too (a sender that ended while this receiver runs on).
        path = staged.source
        return self._map(path, self._expected, fd=self._window.open(path)).buffers

    def _fetch_models(self, params: Mapping[str, ParamValue]) -> Staged:
        """A version of several models: one slot file per model, each mapped once."""
        layout = self.layout
        paths, parts = [], []
        for name, (first, last) in layout.sections.items():
            path, nbytes = params.get(f"path.{name}"), params.get(f"nbytes.{name}")
            if not isinstance(path, str) or not isinstance(nbytes, int):
                raise ProtocolError(f"update parameters lack the slot of model {name!r}")
            sizes = layout.buffer_sizes[first:last]
            if nbytes != sum(sizes):
                raise ProtocolError(
                    f"slot of {nbytes} bytes for model {name!r}, the layout needs {sum(sizes)}"
                )
            mapped = self._files.get(path)
            if mapped is None:
                check_slot_path(path, self._owner)  # paths come from the wire: checked first
                if len(self._files) >= _KEPT_MAPPINGS:
                    self._files.pop(next(iter(self._files)))
                file = SlotFile.open(path, nbytes, writable=False)
                mapped, start = [], 0
                for size in sizes:
                    mapped.append(file.tensor[start : start + size])
                    start += size
                self._files[path] = mapped
            paths.append(path)
            parts.extend(mapped)
        key = "\n".join(paths)
        staged = self._mapped.get(key)
        if staged is None:
            if len(self._mapped) >= _KEPT_MAPPINGS:
                self._mapped.pop(next(iter(self._mapped)))
            staged = self._mapped[key] = Staged(parts, layout.views(parts), key, shared=True)
        return staged

    async def fetch(self, params: Mapping[str, ParamValue]) -> Staged:
        return self.fetch_nowait(params)

    def close(self) -> None:
        # Views bound to the model keep their mapping alive; only our cache is dropped.
        self._mapped.clear()
        self._files.clear()
        if self._window is not None:
            self._window.release()
