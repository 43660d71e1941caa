"""The sender's half of the shared-memory plane: slot files in /dev/shm, one set per model.

Each model of a scheme (one, or several with ``models=``) has slot files of its own, made up
front (``num_slots``) and on demand (up to ``max_slots``). A version is one slot of each
model: a send of some models writes new slots of those models only, and the version points
at the other models' slots of the version before, so their bytes are neither copied nor
touched. A slot is reused once no version that a receiver may still read points at it.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from aiowsync._copy.engine import CopyPolicy, fused_copy, start_copy
from aiowsync._copy.gather import EarlyCopy, GatherCopy
from aiowsync._copy.job import early_share
from aiowsync._copy.recent import Copied, RecentCopies
from aiowsync._exceptions import WeightSyncError
from aiowsync._util.pids import pid_alive
from aiowsync._weights.layout import Layout

from ..base import Delivery, InPlace, Member, Params, SenderPlane, Source, WeightSource
from ..slot_table import SlotTable
from ..stager import Stager
from .slots import SlotFile, remove_stale_slots

__all__ = ["SharedMemSenderPlane"]


log = logging.getLogger("aiowsync.shm")


@dataclass(slots=True)
class _File:
    """One slot file of one model: its buffers of the layout, and typed views of its keys."""

    file: SlotFile
    parts: list[torch.Tensor]
    views: dict[str, torch.Tensor]


@dataclass(slots=True)
class _Reserved:
    """A version being staged: the versions it must not overwrite, and its slots so far."""

    pinned: set[int]
    slots: dict[str, int] = field(default_factory=dict)
    """Model (section) to its slot index, for the models this version writes."""


class SharedMemSenderPlane(SenderPlane):
    """``num_slots`` slot files per model made up front, more (up to ``max_slots``) on demand.

    More slots are needed only when versions stay in use side by side, e.g. after sends to a
    subset of the workers, or while a worker that missed an ack may still switch.
    """

    what = "shared-memory"

    def __init__(
        self, num_slots: int = 2, max_slots: int = 16, policy: CopyPolicy | None = None
    ) -> None:
        self.num_slots = num_slots
        self.max_slots = max_slots
        self._stager = Stager()
        self._policy = policy or CopyPolicy()
        """How this plane copies (its own; its threads are released at close)."""
        self._closed = False
        self._tables: dict[str, SlotTable[_File]] = {}
        self._reserved: dict[int, _Reserved] = {}
        self._handles = itertools.count()
        self._held: dict[int, dict[str, int]] = {}
        """By published version, the version whose bytes each model's slot holds (the
        version itself for the models it wrote)."""
        self._latest: int | None = None

    # -- set-up -------------------------------------------------------------------------------

    def welcome_params(self) -> Params:
        """The sender's pid: receivers map only slot files named after it."""
        return {"owner": os.getpid()}

    def setup(self, layout: Layout) -> None:
        self.layout = layout
        self._gather = GatherCopy(layout.places, self._policy)
        self._gathers: dict[frozenset[str], tuple[Layout, GatherCopy]] = {}
        """The layouts and gather copies of sends of some models, by the models they write."""
        self._early = early_share(len(layout.specs), layout.total_bytes)
        """How a copy of whole buffers started before the check is cut (see start_copy)."""
        self._recent = RecentCopies()
        """By source key, what the last staging from it copied (what to start early)."""
        remove_stale_slots()
        names = list(layout.sections)
        try:
            for number, name in enumerate(names):
                table: SlotTable[_File] = SlotTable(
                    functools.partial(self._make_file, name, number), max_slots=self.max_slots
                )
                self._tables[name] = table
                for _ in range(self.num_slots):
                    table.add()
        except BaseException:
            self.close()
            raise

    def _make_file(self, section: str, number: int, index: int) -> _File:
        first, last = self.layout.sections[section]
        sizes = self.layout.buffer_sizes[first:last]
        # Slot files of one model are numbered apart from the others' (index * 1000 + model).
        file = SlotFile.create(index * 1000 + number, sum(sizes))
        parts, start = [], 0
        for size in sizes:
            parts.append(file.tensor[start : start + size])
            start += size
        keys = set(self.layout.section_keys(section)) if self.layout.sectioned else None
        views = {}
        for s in self.layout.specs:
            if keys is None or s.key in keys:
                raw = parts[s.buffer - first][s.offset : s.offset + s.nbytes]
                views[s.key] = raw.view(s.dtype).view(s.shape)
        return _File(file, parts, views)

    # -- slots --------------------------------------------------------------------------------

    def reserve(self, pinned: set[int]) -> int:
        if self._closed:
            raise WeightSyncError(f"the {self.what} plane is closed")
        # Versions no receiver may read any more, and not the latest, are forgotten.
        for version in [v for v in self._held if v not in pinned and v != self._latest]:
            del self._held[version]
        handle = next(self._handles)
        self._reserved[handle] = _Reserved(set(pinned))
        return handle

    def _take_slots(self, handle: int, sections: Sequence[str]) -> list[_File]:
        """A slot of each model of ``sections`` that no pinned version points at."""
        reserved = self._reserved[handle]
        for name in sections:
            table = self._tables[name]
            pinned = {held[name] for v, held in self._held.items() if v in reserved.pinned}
            _renew_removed(table, pinned)
            reserved.slots[name] = table.reserve_unpinned(pinned, self.what)
        return [self._tables[n][i].value for n, i in reserved.slots.items()]

    def publish(self, slot: int, version: int) -> None:
        if self._closed:
            raise WeightSyncError(f"the {self.what} plane is closed")
        reserved = self._reserved.pop(slot)
        before = self._held.get(self._latest) if self._latest is not None else None
        held = {}
        for name, table in self._tables.items():
            if name in reserved.slots:
                table.publish(reserved.slots[name], version)
                held[name] = version
            else:
                assert before is not None, "a version of some models needs one before it"
                held[name] = before[name]
        self._held[version] = held
        self._latest = version

    def staged_buffers(self, slot: int) -> list[torch.Tensor]:
        reserved = self._reserved[slot]
        latest = self._held.get(self._latest) if self._latest is not None else None
        out: list[torch.Tensor] = []
        for name, table in self._tables.items():
            if name in reserved.slots:
                index = reserved.slots[name]
            else:
                assert latest is not None, "a version of some models needs one before it"
                index = table.index_of(latest[name])
            out.extend(table[index].value.parts)
        return out

    def release(self, slot: int) -> None:
        reserved = self._reserved.pop(slot, None)
        if reserved is not None and not self._closed:
            for name, index in reserved.slots.items():
                self._tables[name].release(index)

    def deliver(
        self,
        version: int,
        members: Sequence[Member],
        deadline: float,
        *,
        purpose: str = "",
        since: int | None = None,
    ) -> Delivery:
        held = self._held[version]
        if not self.layout.sectioned:
            index = self._tables[""].index_of(held[""])
            file = self._tables[""][index].value.file
            return InPlace({"slot": index, "path": file.path, "nbytes": file.nbytes})
        params: Params = {}
        for name, table in self._tables.items():
            file = table[table.index_of(held[name])].value.file
            params[f"path.{name}"] = file.path
            params[f"nbytes.{name}"] = file.nbytes
        return InPlace(params)

    def process_gone(self, pid: int) -> bool | None:
        return not pid_alive(pid)

    # -- staging ------------------------------------------------------------------------------

    async def stage(self, slot: int, source: WeightSource) -> None:
        sections = [name for name in self._tables if name not in source.carry]
        files = self._take_slots(slot, sections)
        nbytes = sum(f.file.nbytes for f in files)  # the models written, not all of them
        if nbytes <= self._stager.inline_bytes:
            # Small: checked and copied on the loop, with nothing started early.
            for f in files:
                f.file.back()
            self._write(files, source.snapshot(), None, source.key)
        else:
            await self._stager.run(nbytes, lambda: self._stage(files, source))

    def _stage(self, files: list[_File], source: WeightSource) -> None:
        # A model's tensors (or its re-homed buffers) come back on every send, and checking a
        # thousand of them costs cold Python time: their copy starts first, in helper threads,
        # and is kept if the snapshot holds the same tensors.
        for f in files:
            f.file.back()  # a slot's first use allocates its pages: never on the loop
        parts = [p for f in files for p in f.parts]
        key = source.key
        copier = self._copier(source)[1]
        # Some models have no re-homed buffers, and only the same source is worth a guess
        # (the gather copy of those models copied its tensors); weights not seen lately may
        # be the tensors copied twice in a row.
        guess = self._recent.last(key) if source.carry else self._recent.guess(key)
        last = guess.buffers if guess is not None else None
        tensors = guess.sources if guess is not None else None
        flat = start_copy(parts, last, self._early, self._policy) if last is not None else None
        gather = copier.start(parts, tensors) if tensors is not None else None
        try:
            snapshot = source.snapshot()
            if flat is not None:
                if snapshot.buffers is not None and _same(snapshot.buffers, last):
                    flat.finish()
                    self._recent.copied(key, Copied(buffers=snapshot.buffers))
                    return
                flat.abandon()
            self._write(files, snapshot, gather, key)
        except BaseException:
            if flat is not None:
                flat.abandon()
            if gather is not None:
                gather.job.abandon()
            raise

    def _write(
        self, files: list[_File], source: Source, early: EarlyCopy | None, key: object
    ) -> None:
        """Copy ``source`` into the slots ``files`` (one per model it writes); ``early`` (of
        the gather copy) is finished or abandoned."""
        self._recent.forget(key)
        parts = [p for f in files for p in f.parts]
        if source.carry or source.cast:
            # Some models (into their own slots), or a cast (tensor by tensor).
            assert source.tensors is not None
            written, copier = self._copier(source)
            src = [source.tensors[k] for k in written.keys]
            if not source.cast:
                copied = copier.copy(parts, src, keep=True, early=early)
                if copied is not None:  # these models' tensors, through their gather copy
                    self._recent.copied(key, Copied(sources=copied))
                    return
            if early is not None:
                early.job.abandon()
            views = {k: v for f in files for k, v in f.views.items()}
            fused_copy([views[k] for k in written.keys], src, self._policy)
            return
        if source.buffers is not None:
            if early is not None:
                early.job.abandon()
            fused_copy(parts, list(source.buffers), self._policy)
            self._recent.copied(key, Copied(buffers=source.buffers))
        elif source.tensors is not None:
            keys, tensors = self.layout.keys, source.tensors
            src = [tensors[k] for k in keys]
            copied = self._gather.copy(parts, src, keep=source.model, early=early)
            if copied is not None:
                self._recent.copied(key, Copied(sources=copied))
            else:
                views = {k: v for f in files for k, v in f.views.items()}
                fused_copy([views[k] for k in keys], src, self._policy)
        else:
            if early is not None:
                early.job.abandon()
            raise ValueError("empty source")

    def _copier(self, source: WeightSource | Source) -> tuple[Layout, GatherCopy]:
        """The layout of the models a source writes (all, or those of a partial one) and
        their gather copy: the layout of some models keeps their buffers as they are in the
        whole layout."""
        if not source.carry:
            return self.layout, self._gather
        written = frozenset(self.layout.sections) - source.carry
        found = self._gathers.get(written)
        if found is None:
            subset = self.layout.subset(written)
            found = self._gathers[written] = (subset, GatherCopy(subset.places, self._policy))
        return found

    def close(self) -> None:
        self._closed = True
        self._stager.close()
        if hasattr(self, "_gather"):
            self._gather.clear()
            for _, copier in self._gathers.values():
                copier.clear()
            self._recent.clear()
        for table in self._tables.values():
            for s in table:
                s.value.file.unlink()
        # An unlinked file's pages stay allocated while it is mapped: the mappings go now,
        # not with the scheme object (a staging thread still running holds its own).
        self._tables.clear()
        self._held.clear()
        self._policy.close(wait=False)


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor] | None) -> bool:
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _renew_removed(table: SlotTable[_File], pinned: set[int]) -> None:
    """Replace the slot files whose name was removed under the sender (logind's RemoveIPC at
    logout, a tidy-up ``rm``) by new ones, where no version in use is in them: the sender
    could still write the old ones, but no worker could open them any more."""
    for index, slot in enumerate(table.slots):
        if slot.busy or (slot.version is not None and slot.version in pinned):
            continue
        path = slot.value.file.path
        if not slot.value.file.name_is_ours():
            # Removed, or (once removed) replaced by another user's file or link: either
            # way no worker could open this slot by its name any more.
            log.warning("shared-memory slot %s was removed by another process; made anew", path)
            slot.value.file.release()
            table.renew(index)
