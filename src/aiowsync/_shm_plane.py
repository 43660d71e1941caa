"""The shared-memory data plane: slots in /dev/shm that receivers on this host map by name."""

from __future__ import annotations

import collections
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ._copy import CopyPolicy, fused_copy, start_copy
from ._copy_job import early_share
from ._exceptions import ProtocolError, TransportError
from ._gather import EarlyCopy, GatherCopy, remember_hint
from ._layout import Layout
from ._plane import (
    DataPlane,
    Params,
    ReceiverContext,
    ReceiverPlane,
    SenderContext,
    Source,
    Staged,
    WeightSource,
)
from ._protocol import ParamValue
from ._shm_slots import SlotFile, check_slot_path, remove_stale_slots
from ._shm_window import SlotWindow, windows_supported
from ._slot_table import InPlaceSenderPlane, SlotTable, check_slot_counts
from ._stager import Stager

__all__ = ["SharedMemPlane", "SharedMemReceiverPlane", "SharedMemSenderPlane", "SwitchMode"]

log = logging.getLogger("aiowsync.shm")

_KEPT_MAPPINGS = 32
"""Slot files a receiver keeps mapped (a sender has a few slots; at most 16 by default)."""

SwitchMode = Literal["auto", "rebind", "remap"]


def window_pays(layout: Layout) -> bool:
    """Whether ``switch="auto"`` remaps a window for this layout rather than re-binding.

    Re-binding costs about a microsecond per tensor on the event loop. Remapping costs next
    to nothing while the model's pages were not read since the last switch, but each page
    that was read is torn down at the switch and faulted in again by the next read, and a
    large model takes long to remap: many small tensors favour the window, a few large ones
    the re-binding (docs/concepts.md has the figures).
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


@dataclass(slots=True)
class _File:
    file: SlotFile
    parts: list[torch.Tensor] = field(default_factory=list)
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    content: dict[str, int] = field(default_factory=dict)
    """By model (section), which staging wrote the bytes it holds: a send of some models
    copies the others only into a slot whose bytes of them are not the latest already."""


class SharedMemSenderPlane(InPlaceSenderPlane):
    """``num_slots`` slot files made up front, more (up to ``max_slots``) on demand.

    More slots are needed only when versions stay in use side by side, e.g. after sends to a
    subset of the workers, or while a worker that missed an ack may still switch.
    """

    what = "shared-memory"

    def __init__(
        self, num_slots: int = 2, max_slots: int = 16, policy: CopyPolicy | None = None
    ) -> None:
        self.num_slots = num_slots
        self._slots = SlotTable(self._make_file, max_slots=max_slots)
        self._token = secrets.token_hex(6)
        self._stager = Stager()
        self._policy = policy or CopyPolicy()
        """How this plane copies (its own; its threads are released at close)."""
        self._closed = False

    def setup(self, layout: Layout) -> None:
        self.layout = layout
        self._gather = GatherCopy(layout, self._policy)
        self._early = early_share(len(layout.specs), layout.total_bytes)
        """How a copy of whole buffers started before the check is cut (see start_copy)."""
        self._last: collections.OrderedDict[object, tuple[torch.Tensor, ...] | None] = (
            collections.OrderedDict()
        )
        """By source key (the last few), what the last staging from it copied: whole
        buffers, or None for tensors through the gather copy."""
        self._last_tensors = False
        """The last staging copied tensors through the gather copy."""
        self._serial = 0
        """Counts stagings: the ``content`` marks of the slots."""
        remove_stale_slots()
        try:
            for _ in range(self.num_slots):
                self._slots.add()
        except BaseException:
            self.close()
            raise

    def _make_file(self, index: int) -> _File:
        file = SlotFile.create(index, self.layout.total_bytes, self._token)
        parts = self.layout.split(file.tensor)
        return _File(file, parts, self.layout.views(parts))

    async def stage(self, slot: int, source: WeightSource) -> None:
        if self.layout.total_bytes <= self._stager.inline_bytes:
            # Small: checked and copied on the loop, with nothing started early.
            self._slots[slot].value.file.back()
            self._write(slot, source.snapshot(), None, source.key)
        else:
            await self._stager.run(self.layout.total_bytes, lambda: self._stage(slot, source))

    def _stage(self, slot: int, source: WeightSource) -> None:
        # A model's tensors (or its re-homed buffers) come back on every send, and checking a
        # thousand of them costs cold Python time: their copy starts first, in helper threads,
        # and is kept if the snapshot holds the same tensors.
        record = self._slots[slot].value
        record.file.back()  # a slot's first use allocates its pages: never on the loop
        parts = record.parts
        key = source.key
        if source.partial:
            # Some models only: nothing is worth copying before the check, and the bytes of
            # the others in this slot may be the latest already.
            last, tensors = None, False
        elif key in self._last:
            last = self._last[key]
            tensors = last is None
        else:
            # Weights not seen lately: at most the gather copy's own guess (the last call's
            # tensors, if they came twice in a row).
            last, tensors = None, self._last_tensors
        flat = start_copy(parts, last, self._early, self._policy) if last is not None else None
        gather = self._gather.start(parts, key) if tensors else None
        try:
            snapshot = source.snapshot()
            if flat is not None:
                if snapshot.buffers is not None and _same(snapshot.buffers, last):
                    flat.finish()
                    self._copied(key, snapshot.buffers)
                    self._serial += 1
                    record.content = dict.fromkeys(self.layout.sections, self._serial)
                    return
                flat.abandon()
            self._write(
                slot, snapshot, gather, key, clobbered=flat is not None or gather is not None
            )
        except BaseException:
            if flat is not None:
                flat.abandon()
            if gather is not None:
                gather.job.abandon()
            raise

    def _write(
        self,
        slot: int,
        source: Source,
        early: EarlyCopy | None,
        key: object,
        *,
        clobbered: bool = False,
    ) -> None:
        """Copy ``source`` into ``slot``; ``early`` (of the gather copy) is finished or
        abandoned. ``clobbered``: a copy started before the check wrote into the slot."""
        s = self._slots[slot].value
        self._last.pop(key, None)
        self._last_tensors = False
        self._serial += 1
        # What it held counts again only once written.
        before, s.content = ({} if clobbered else s.content), {}
        if source.carry or source.cast:
            if early is not None:
                early.job.abandon()
            s.content = self._write_some(s, source, before)
            return
        if source.buffers is not None:
            if early is not None:
                early.job.abandon()
            fused_copy(s.parts, list(source.buffers), self._policy)
            self._copied(key, source.buffers)
        elif source.tensors is not None:
            keys, tensors = self.layout.keys, source.tensors
            src = [tensors[k] for k in keys]
            if self._gather.copy(s.parts, src, keep=source.model, early=early, hint=key):
                self._copied(key, None)
            else:
                fused_copy([s.views[k] for k in keys], src, self._policy)
        else:
            if early is not None:
                early.job.abandon()
            raise ValueError("empty source")
        s.content = dict.fromkeys(self.layout.sections, self._serial)

    def _write_some(self, record: _File, source: Source, before: dict[str, int]) -> dict[str, int]:
        """Copy a source tensor by tensor (casting where dtypes differ), and the models it
        carries from the newest slot, unless this slot holds their newest bytes already."""
        assert source.tensors is not None
        layout, latest = self.layout, None
        if source.carry:
            if self.latest is None:
                raise ValueError("a send of some models needs an earlier version")
            latest = self._slots[self.latest].value
        content = {}
        for section in source.carry:
            assert latest is not None
            want = latest.content[section]
            if before.get(section) != want:
                first, last = layout.sections[section]
                fused_copy(record.parts[first:last], latest.parts[first:last], self._policy)
            content[section] = want
        keys = [k for k in layout.keys if k in source.tensors]
        fused_copy([record.views[k] for k in keys], [source.tensors[k] for k in keys], self._policy)
        content.update({sec: self._serial for sec in layout.sections if sec not in source.carry})
        return content

    def _copied(self, key: object, buffers: tuple[torch.Tensor, ...] | None) -> None:
        """Remember what a staging from ``key`` copied: whole ``buffers``, or (None) tensors
        through the gather copy."""
        self._last_tensors = buffers is None
        remember_hint(self._last, key, buffers)

    def where(self, index: int) -> Params:
        file = self._slots[index].value.file
        return {"slot": index, "path": file.path, "nbytes": file.nbytes}

    def close(self) -> None:
        self._closed = True
        self._stager.close()
        if hasattr(self, "_gather"):
            self._gather.clear()
            self._last.clear()
        for s in self._slots:
            s.value.file.unlink()
        self._policy.close(wait=False)


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor] | None) -> bool:
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class SharedMemReceiverPlane(ReceiverPlane):
    """Maps the sender's slot files by name, once each, and hands out typed views of them."""

    def __init__(self, *, switch: SwitchMode = "auto") -> None:
        self._mapped: dict[str, Staged] = {}
        self._switch = switch
        self._window: SlotWindow | None = None
        self._window_staged: Staged | None = None

    def setup(
        self, layout: Layout, welcome: Mapping[str, ParamValue], *, swap: bool = True
    ) -> None:
        self.layout = layout
        self._expected = layout.total_bytes
        wanted = self._switch == "remap" or (self._switch == "auto" and window_pays(layout))
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
        path, nbytes = params.get("path"), params.get("nbytes")
        if not isinstance(path, str) or not isinstance(nbytes, int):
            raise ProtocolError(f"update parameters lack a slot path and size: {dict(params)}")
        if nbytes != self._expected:
            raise ProtocolError(f"slot of {nbytes} bytes, the layout needs {self._expected}")
        if self._window is not None:
            # The window maps the slot itself; views of each slot would only cost memory. The
            # file is opened (and its path checked) now, so the switch itself cannot fail on it.
            self._window.open(path)
            return Staged([], {}, path, shared=True)
        views = self._mapped.get(path)
        if views is None:
            # Paths come from the wire: checked before anything is opened, once per path.
            check_slot_path(path)
            if len(self._mapped) >= _KEPT_MAPPINGS:
                # A sender has a few slots; a cache of every path ever named would grow.
                self._mapped.pop(next(iter(self._mapped)))
            file = SlotFile.open(path, nbytes)
            parts = self.layout.split(file.tensor)
            views = self._mapped[path] = Staged(parts, self.layout.views(parts), path, shared=True)
        return views

    async def fetch(self, params: Mapping[str, ParamValue]) -> Staged:
        return self.fetch_nowait(params)

    def close(self) -> None:
        # Views bound to the model keep their mapping alive; only our cache is dropped.
        self._mapped.clear()
        if self._window is not None:
            self._window.release()
