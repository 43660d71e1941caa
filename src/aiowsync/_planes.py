"""The data-plane interface and the shared-memory plane.

A sender plane owns a set of slots. Staging a version is three steps so that the scheme can run
the bulk copy in a worker thread and stay consistent under cancellation:

1. ``reserve(pinned)`` on the loop: pick a slot holding none of the ``pinned`` versions;
2. ``write(slot, source)`` in a thread: copy the weights into it;
3. ``publish(slot, version)`` on the loop: record that the slot holds ``version`` and return the
   parameters a receiver needs to find it. ``release(slot)`` undoes a reservation instead.

A receiver plane turns those parameters into typed views of the staged version.
"""

from __future__ import annotations

import abc
import collections
import logging
import secrets
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ._exceptions import ProtocolError, TransportError, WeightSyncError
from ._layout import (
    EarlyCopy,
    GatherCopy,
    Layout,
    early_share,
    fused_copy,
    remember_hint,
    start_copy,
)
from ._protocol import ParamValue
from ._shm_slots import SlotFile, check_slot_path, remove_stale_slots
from ._shm_window import SlotWindow, windows_supported

__all__ = [
    "ReceiverPlane",
    "SenderPlane",
    "SharedMemReceiverPlane",
    "SharedMemSenderPlane",
    "Source",
    "Staged",
    "SwitchMode",
]

log = logging.getLogger("aiowsync.shm")

_KEPT_MAPPINGS = 32
"""Slot files a receiver keeps mapped (a sender has a few slots; at most 16 by default)."""

Params = dict[str, ParamValue]


@dataclass(frozen=True, slots=True)
class Source:
    """What to stage: flat buffers laid out like the layout (one copy each), or named tensors."""

    buffers: tuple[torch.Tensor, ...] | None = None
    tensors: Mapping[str, torch.Tensor] | None = None
    model: bool = False
    """The tensors are the sender's own model's: they come back on every send, so what is
    prepared to copy them is worth keeping from the first send on."""


@dataclass(frozen=True, slots=True)
class Staged:
    """A staged version on a receiver: the layout's flat buffers and a typed view per key."""

    buffers: list[torch.Tensor]
    views: dict[str, torch.Tensor]
    source: str = ""
    """Where it lives (the slot path for shared memory)."""
    bind_once: bool = False
    """The model stays bound to these views across versions (a window): once bound, the views
    are dropped, since they would only cost memory (about a kilobyte per tensor)."""


class SenderPlane(abc.ABC):
    layout: Layout

    transfers = False
    """True for planes that move the bytes after the announcement (see :meth:`transfer`)."""
    pins_receivers = True
    """True when receivers read the sender's slots, so versions they run must stay intact."""

    @abc.abstractmethod
    def setup(self, layout: Layout) -> None: ...

    @abc.abstractmethod
    def reserve(self, pinned: set[int]) -> int: ...

    @abc.abstractmethod
    def write(self, slot: int, source: Source) -> None: ...

    def write_checked(self, slot: int, make: Callable[[], Source], hint: Hashable = None) -> None:
        """``write(slot, make())``, where ``make`` checks the weights (blocking, so from a
        thread). A plane may start copying what an earlier write copied while ``make`` runs,
        and keep that copy when the source is the same. ``hint`` names where the weights come
        from (the sender's own model, or one weights object): the plane guesses the source
        the last write with the same hint copied."""
        del hint
        self.write(slot, make())

    @abc.abstractmethod
    def publish(self, slot: int, version: int) -> Params: ...

    @abc.abstractmethod
    def release(self, slot: int) -> None: ...

    @abc.abstractmethod
    def params_for(self, version: int) -> Params: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    def welcome_params(self) -> Params:
        """Parameters every receiver needs once, sent in the welcome."""
        return {}

    def seal(self, version: int) -> None:
        """Finish reading the source of ``version`` now (blocking): after this call the plane
        never reads the user's weights for it again. Planes that copy at :meth:`write` have
        nothing left to do."""
        del version

    def forget(self, worker: int) -> None:
        """``worker`` is lost or replaced: drop whatever state involves it."""
        del worker  # the shared-memory plane keeps nothing per worker

    # Planes with ``transfers`` move a published version to a set of receivers (a *route*),
    # in a worker thread, after the receivers were told the route's parameters.

    def route(self, members: Sequence[tuple[int, str]], version: int, purpose: str = "") -> Any:
        """The route to ``members`` ((worker index, session) pairs) for ``version``; cached by
        the plane."""
        raise NotImplementedError

    def route_params(self, route: Any, timeout: float) -> Params:
        """What the members of ``route`` need to take part in a transfer on it."""
        raise NotImplementedError

    def transfer(
        self,
        version: int,
        route: Any,
        deadline: float,
        after: threading.Event | None = None,
    ) -> None:
        """Move ``version`` along ``route`` by ``deadline`` (monotonic), once ``after`` is set;
        blocking. Every route handed out is passed here exactly once."""
        raise NotImplementedError


class ReceiverPlane(abc.ABC):
    blocking_fetch = False
    """True when :meth:`fetch` blocks (a collective) and must run in a worker thread."""
    shares_sender_memory = True
    """True when fetched versions live in the sender's memory (then a closing receiver gives
    its model a private copy)."""

    @abc.abstractmethod
    def setup(
        self, layout: Layout, welcome: Mapping[str, ParamValue], *, swap: bool = True
    ) -> None:
        """Prepare for ``layout``; ``swap`` says the model will point into what is fetched."""

    @abc.abstractmethod
    def fetch(self, params: Mapping[str, ParamValue]) -> Staged:
        """The staged version named by ``params``, as flat buffers and typed views (no copy)."""

    def show(self, staged: Staged) -> Staged:
        """For swap mode: what the model should be bound to so that it runs ``staged``.

        Called inside the switch. The default is ``staged`` itself (re-bind every tensor);
        a plane may instead re-point a fixed window and return that window every time.
        """
        return staged

    @abc.abstractmethod
    def close(self) -> None: ...


@dataclass(slots=True)
class _Slot:
    file: SlotFile
    version: int | None = None
    busy: bool = False
    parts: list[torch.Tensor] = field(default_factory=list)
    views: dict[str, torch.Tensor] = field(default_factory=dict)


class SharedMemSenderPlane(SenderPlane):
    """Slots in /dev/shm; ``num_slots`` are made up front, more (up to ``max_slots``) on demand.

    More slots are needed only when versions stay in use side by side, e.g. after sends to a
    subset of the workers, or while a worker that missed an ack may still switch.
    """

    def __init__(self, num_slots: int = 2, max_slots: int = 16) -> None:
        if num_slots < 2:
            raise ValueError(f"num_slots must be at least 2, got {num_slots}")
        if max_slots < num_slots:
            raise ValueError(f"max_slots ({max_slots}) must be >= num_slots ({num_slots})")
        self.num_slots = num_slots
        self.max_slots = max_slots
        self._slots: list[_Slot] = []
        self._token = secrets.token_hex(6)
        self._closed = False

    def setup(self, layout: Layout) -> None:
        self.layout = layout
        self._gather = GatherCopy(layout)
        self._early = early_share(len(layout.specs), layout.total_bytes)
        """How a copy of whole buffers started before the check is cut (see start_copy)."""
        self._last_buffers: tuple[torch.Tensor, ...] | None = None
        """The buffers the last write copied, when it copied whole buffers."""
        self._last_tensors = False
        """The last write copied tensors through ``_gather``."""
        self._hinted: collections.OrderedDict[Hashable, tuple[torch.Tensor, ...] | None] = (
            collections.OrderedDict()
        )
        """By hint (the last few), what the last write with it copied: whole buffers, or
        None for tensors through ``_gather``."""
        remove_stale_slots()
        try:
            for _ in range(self.num_slots):
                self._add_slot()
        except BaseException:
            self.close()
            raise

    def _add_slot(self) -> _Slot:
        file = SlotFile.create(len(self._slots), self.layout.total_bytes, self._token)
        slot = _Slot(file)
        slot.parts = self.layout.split(file.tensor)
        slot.views = self.layout.views(slot.parts)
        self._slots.append(slot)
        return slot

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    def reserve(self, pinned: set[int]) -> int:
        if self._closed:
            raise WeightSyncError("the shared-memory plane is closed")
        for index, slot in enumerate(self._slots):
            if not slot.busy and (slot.version is None or slot.version not in pinned):
                slot.busy = True
                slot.version = None
                return index
        if len(self._slots) >= self.max_slots:
            raise WeightSyncError(
                f"all {len(self._slots)} shared-memory slots hold versions still in use "
                f"({sorted(pinned)}); raise max_slots or bring lagging workers up to date"
            )
        slot = self._add_slot()
        slot.busy = True
        return len(self._slots) - 1

    def write(self, slot: int, source: Source) -> None:
        self._slots[slot].file.back()
        self._write(slot, source, None, None)

    def write_checked(self, slot: int, make: Callable[[], Source], hint: Hashable = None) -> None:
        # A model's tensors (or its re-homed buffers) come back on every send, and checking a
        # thousand of them costs about a millisecond of cold Python: their copy starts first,
        # in helper threads, and is kept if make() returns the same tensors.
        s = self._slots[slot]
        s.file.back()
        if hint is None:
            last, tensors = self._last_buffers, self._last_tensors
        elif hint in self._hinted:
            last = self._hinted[hint]
            tensors = last is None
        else:
            # Weights not seen lately: at most the gather copy's own guess (the last call's
            # tensors, if they came twice in a row).
            last, tensors = None, self._last_tensors
        flat = start_copy(s.parts, last, self._early) if last is not None else None
        gather = self._gather.start(s.parts, hint) if last is None and tensors else None
        try:
            source = make()
            if flat is not None:
                if source.buffers is not None and _same(source.buffers, last):
                    flat.finish()
                    self._wrote(source.buffers, hint)
                    return
                flat.abandon()
            self._write(slot, source, gather, hint)
        except BaseException:
            if flat is not None:
                flat.abandon()
            if gather is not None:
                gather.job.abandon()
            raise

    def _write(self, slot: int, source: Source, early: EarlyCopy | None, hint: Hashable) -> None:
        """Copy ``source`` into ``slot``; ``early`` (of the gather copy) is finished or
        abandoned."""
        s = self._slots[slot]
        self._last_buffers, self._last_tensors = None, False
        self._hinted.pop(hint, None)
        if source.buffers is not None:
            if early is not None:
                early.job.abandon()
            # Whole buffers: fused_copy shares them among a few threads, in moves of at most
            # 64 MiB (see _MAX_MOVE in _layout).
            fused_copy(s.parts, list(source.buffers))
            self._wrote(source.buffers, hint)
        elif source.tensors is not None:
            keys, tensors = self.layout.keys, source.tensors
            src = [tensors[k] for k in keys]
            if self._gather.copy(s.parts, src, keep=source.model, early=early, hint=hint):
                self._wrote(None, hint)
            else:
                fused_copy([s.views[k] for k in keys], src)
        else:
            if early is not None:
                early.job.abandon()
            raise ValueError("empty source")

    def publish(self, slot: int, version: int) -> Params:
        if self._closed:
            raise WeightSyncError("the shared-memory plane is closed")
        s = self._slots[slot]
        s.version, s.busy = version, False
        return {"slot": slot, "path": s.file.path, "nbytes": s.file.nbytes}

    def release(self, slot: int) -> None:
        if self._closed:
            return
        s = self._slots[slot]
        s.busy, s.version = False, None

    def params_for(self, version: int) -> Params:
        for index, s in enumerate(self._slots):
            if s.version == version:
                return {"slot": index, "path": s.file.path, "nbytes": s.file.nbytes}
        raise KeyError(f"version {version} is in no slot")

    def _wrote(self, buffers: tuple[torch.Tensor, ...] | None, hint: Hashable) -> None:
        """Remember what a write copied: whole ``buffers``, or (None) tensors through
        ``_gather``."""
        self._last_buffers, self._last_tensors = buffers, buffers is None
        if hint is not None:
            remember_hint(self._hinted, hint, buffers)

    def close(self) -> None:
        self._closed = True
        if hasattr(self, "_gather"):
            self._gather.clear()
            self._hinted.clear()
        for s in self._slots:
            s.file.unlink()


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor] | None) -> bool:
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


SwitchMode = Literal["auto", "rebind", "remap"]


def _window_pays(layout: Layout) -> bool:
    """Whether ``switch="auto"`` remaps a window for this layout rather than re-binding.

    Re-binding costs about a microsecond per tensor (cold). Remapping costs next to nothing
    while the model's pages were not read since the last switch, but each page that was read
    costs about 0.2 us on the event loop at the switch (its mapping is torn down) and about
    0.4 us later (the next read faults it in): 4 ms and 6 ms for 64 MiB here. Many small
    tensors favour the window, a few large ones the re-binding: remapping 1 GiB took 17-50 ms
    here, re-binding its 4 tensors a few microseconds.
    """
    count = len(layout.specs)
    return count >= 64 and layout.total_bytes < count * (1 << 20)


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
        wanted = self._switch == "remap" or (self._switch == "auto" and _window_pays(layout))
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
                self._window_staged = Staged(parts, layout.views(parts), "window", bind_once=True)

    def show(self, staged: Staged) -> Staged:
        if self._window is None or self._window_staged is None:
            return staged
        self._window.show(staged.source)
        return self._window_staged

    def fetch(self, params: Mapping[str, ParamValue]) -> Staged:
        path, nbytes = params.get("path"), params.get("nbytes")
        if not isinstance(path, str) or not isinstance(nbytes, int):
            raise ProtocolError(f"update parameters lack a slot path and size: {dict(params)}")
        if nbytes != self._expected:
            raise ProtocolError(f"slot of {nbytes} bytes, the layout needs {self._expected}")
        if self._window is not None:
            # The window maps the slot itself; views of each slot would only cost memory. The
            # file is opened (and its path checked) now, so the switch itself cannot fail on it.
            self._window.open(path)
            return Staged([], {}, path)
        views = self._mapped.get(path)
        if views is None:
            # Paths come from the wire: checked before anything is opened, once per path.
            check_slot_path(path)
            if len(self._mapped) >= _KEPT_MAPPINGS:
                # A sender has a few slots; a cache of every path ever named would grow.
                self._mapped.pop(next(iter(self._mapped)))
            file = SlotFile.open(path, nbytes)
            parts = self.layout.split(file.tensor)
            views = self._mapped[path] = Staged(parts, self.layout.views(parts), path)
        return views

    def close(self) -> None:
        # Views bound to the model keep their mapping alive; only our cache is dropped.
        self._mapped.clear()
        if self._window is not None:
            self._window.release()
