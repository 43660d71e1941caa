"""The gather copy: tensors, given one by one, copied into the flat buffers they belong in.

A model of many tensors needs one copy per tensor, and each torch copy or ``memmove`` call pays
a few microseconds of setup and, from Python, a turn of the interpreter lock, which adds up to
more than the bytes themselves. :class:`GatherCopy` cuts the destination instead into a few
contiguous byte ranges per thread and fills each with a single ``torch.cat(pieces, out=range)``
(or, under non-temporal copies, a single ``_stream.copy_moves`` call), and keeps the views it
needs while the same sources come back.

It knows where each tensor goes only as :class:`Places` (bytes in buffers), which a layout
makes (``Layout.places``): the copy engine stays below the weights package.
"""

from __future__ import annotations

import collections
import contextlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import torch

from .engine import (
    PARALLEL_COPY_BYTES,
    CopyPolicy,
    byte_view,
    copy_packed,
    default_policy,
    pack_moves,
)
from .job import SETTLE_S, CopyJob, cut, early_share, split_sizes
from .omp import serial_torch

if TYPE_CHECKING:
    from .engine import Packed

__all__ = ["EarlyCopy", "GatherCopy", "Places", "Pointers"]

KEPT_SOURCES = 2
"""Source sets whose copy plans a :class:`GatherCopy` keeps."""
KEPT_DESTINATIONS = 8
"""Destinations whose output ranges a plan keeps, per kind of copy (a sender's slots; more are
rare)."""
RECENT_CALLS = 4
"""Calls whose source sets a :class:`GatherCopy` remembers, to tell sources that come back."""

Pointers: TypeAlias = tuple[int, ...]
"""A source set, named by its tensors' data pointers (which hold no reference to them)."""


@dataclass(frozen=True, slots=True)
class Places:
    """Where a gather copy puts the tensors it is given, in order, as bytes in buffers."""

    spans: tuple[tuple[int, int, int], ...]
    """(buffer, offset, nbytes) of each tensor."""
    buffers: int
    """How many destination buffers a copy fills."""
    total_bytes: int
    """Bytes of all destination buffers."""
    alignment: int
    """Gaps between tensors are shorter than this (they are filled from zeros)."""
    lazy_views: bool = False
    """Sources may be lazy conjugate or negated views (complex dtypes): each call checks."""


class GatherCopy:
    """Copies tensors, given one by one, into flat buffers at their ``places``, under ``policy``.

    The destination is cut into a few contiguous byte ranges per thread (threads take them
    from one queue, see :class:`aiowsync._copy.job.CopyJob`), and each range is filled with
    a single ``torch.cat(pieces, out=range)``: torch copies a contiguous concatenation with
    one ``memcpy`` per piece and no per-piece setup, as long as the calling thread runs torch
    single-threaded (see :mod:`aiowsync._copy.omp`). The gaps between tensors (alignment padding)
    are filled from a small zero tensor. Under non-temporal copies, each thread's ranges go
    instead to one ``copy_moves`` call, as packed (destination, piece, length) moves.

    The pieces are views of the sources, slow enough to make that they are kept (a *plan*
    per source set) while the same source tensors come back, as a model's do on every send,
    and rebuilt when any source moved. A plan serves every destination (each slot of a
    sender): only its few output ranges are cut per destination, and kept too. Plans are
    kept only for source sets seen before among the last few calls, so weights passed once
    are not kept alive by a plan, and for at most :data:`KEPT_SOURCES` source sets (a sender
    that alternates its model and one copy of its weights keeps both).

    :meth:`copy` returns the pointers of the sources it copied, and :meth:`start` copies
    again a source set named by such pointers: which set to guess is the caller's to remember
    (the shared-memory sender keeps it by source, with what else it copied).
    """

    def __init__(self, places: Places, policy: CopyPolicy | None = None) -> None:
        self.places = places
        self.policy = policy or default_policy()
        self._plans: dict[Pointers, _Plan] = {}
        """Kept plans by source pointers."""
        self._kept: list[Pointers] = []
        """Source pointers whose plans are kept, oldest first."""
        self._recent: collections.deque[Pointers] = collections.deque(maxlen=RECENT_CALLS)
        """Source pointers of the last calls (no reference to the tensors is held)."""
        self._zeros = torch.zeros(places.alignment, dtype=torch.uint8)
        self._early = early_share(len(places.spans), places.total_bytes)
        """How the copies that :meth:`start` begins are cut (see ``split_sizes``)."""

    def start(self, dst: Sequence[torch.Tensor], key: Pointers) -> EarlyCopy | None:
        """Start copying the source set ``key`` (as a call to :meth:`copy` returned it) into
        ``dst``, in helper threads, before the caller has checked that the next sources are
        those tensors. None when there is nothing to start (no plan kept for that set). The
        result must be passed to :meth:`copy` (which finishes or abandons it) or abandoned."""
        plan = self._kept_plan(key)
        pool = self.policy.gather_pool()
        if plan is None or pool is None:
            return None
        self._check_buffers(dst)
        job = plan.job(dst, self.policy.streaming, early=self._early)
        job.start(pool.executor, settle=SETTLE_S, steer=self.policy.steer_helpers)
        return EarlyCopy(job, key)

    def copy(
        self,
        dst: Sequence[torch.Tensor],
        src: Sequence[torch.Tensor],
        *,
        keep: bool = False,
        early: EarlyCopy | None = None,
    ) -> Pointers | None:
        """Copy ``src`` (one tensor per place, in order, already checked to fit them) into the
        byte buffers ``dst``, and return their pointers (for :meth:`start`). Returns None,
        having copied nothing, when this way does not apply: a small model, sources that are
        not plain contiguous CPU tensors, or no single-threaded torch threads on this platform.

        ``keep`` says the sources will come back (a model's own tensors): their plan is kept
        from this first call on. ``early``, from :meth:`start` with the same ``dst``, is
        finished when ``src`` are the tensors it copies, else abandoned (and ``src`` copied
        as usual); either way, no helper thread writes into ``dst`` once this returns."""
        try:
            return self._copy(dst, src, keep, early)
        except BaseException:
            if early is not None:
                early.job.abandon()
            raise

    def _copy(
        self,
        dst: Sequence[torch.Tensor],
        src: Sequence[torch.Tensor],
        keep: bool,
        early: EarlyCopy | None,
    ) -> Pointers | None:
        pool = self.policy.gather_pool()
        places = self.places
        if (
            pool is None
            or places.total_bytes < PARALLEL_COPY_BYTES
            or len(src) != len(places.spans)
            or not _all_plain(src, places.lazy_views)
        ):
            if early is not None:
                early.job.abandon()
            return None
        self._check_buffers(dst)
        key = tuple(map(_data_ptr, src))
        if early is not None and early.key == key and key in self._plans:
            job = early.job  # its plan was found at its pointers when it started
        else:
            if early is not None:
                early.job.abandon()
            plan = self._kept_plan(key)
            if plan is None:
                if not all(t.is_cpu for t in src):
                    return None
                try:
                    plan = self._plan(src, pool.threads)
                except RuntimeError:
                    return None  # a source torch cannot view as bytes (a lazy negation)
                if keep or key in self._kept or key in self._recent:
                    self._keep(key, plan)
            job = plan.job(dst, self.policy.streaming)
            job.start(pool.executor, steer=self.policy.steer_helpers)
        if not self._recent or self._recent[-1] != key:
            self._recent.append(key)
        with serial_torch(pool):
            job.finish()
        return key

    def _kept_plan(self, key: Pointers) -> _Plan | None:
        """The plan kept for the sources at ``key``, if their memory is still there (a plan
        whose sources moved is dropped)."""
        plan = self._plans.get(key)
        if plan is not None and not plan.still_at(key):
            del self._plans[key]
            with contextlib.suppress(ValueError):
                self._kept.remove(key)
            return None
        return plan

    def _check_buffers(self, dst: Sequence[torch.Tensor]) -> None:
        if len(dst) != self.places.buffers:
            raise ValueError(f"expected {self.places.buffers} buffers, got {len(dst)}")

    def _keep(self, key: Pointers, plan: _Plan) -> None:
        if key not in self._kept:
            self._kept.append(key)
            if len(self._kept) > KEPT_SOURCES:
                self._plans.pop(self._kept.pop(0), None)
        self._plans[key] = plan

    def clear(self) -> None:
        """Drop every plan (and with them the views of sources and destinations they hold)."""
        self._plans.clear()
        self._kept.clear()
        self._recent.clear()

    def _plan(self, src: Sequence[torch.Tensor], threads: int) -> _Plan:
        # (buffer, start, piece): the bytes of every buffer up to its last tensor, in order.
        segments: list[tuple[int, int, torch.Tensor]] = []
        sources: list[tuple[int, torch.Tensor]] = []
        ends = [0] * self.places.buffers
        with torch.no_grad():
            for i, ((b, offset, nbytes), t) in enumerate(zip(self.places.spans, src, strict=True)):
                if t.nbytes != nbytes:
                    raise ValueError(f"tensor {i}: {t.nbytes} bytes, its place has {nbytes}")
                if not nbytes:
                    continue
                end = ends[b]
                if offset > end:
                    segments.append((b, end, self._zeros[: offset - end]))
                view = byte_view(t)
                segments.append((b, offset, view))
                sources.append((i, view))
                ends[b] = offset + nbytes
        return _Plan(segments, sum(ends), threads, sources)


@dataclass(frozen=True, slots=True)
class EarlyCopy:
    """A copy :meth:`GatherCopy.start` began before its sources were checked."""

    job: _GatherJob
    key: Pointers
    """Pointers of the sources it copies."""


@dataclass(slots=True, eq=False)
class _Run:
    """A contiguous byte range ``[start, end)`` of one destination buffer and, in order, the
    pieces that fill it."""

    buffer: int
    start: int
    end: int
    pieces: list[torch.Tensor]


_Share = list[tuple[list[torch.Tensor], torch.Tensor]]
"""One thread's work: (pieces, the output range they fill) pairs."""
if TYPE_CHECKING:
    _GatherJob: TypeAlias = CopyJob[_Share] | CopyJob[Packed]


class _Plan:
    """The pieces of one source set, cut into the head's pieces and the helpers' tails of a
    :class:`CopyJob` (one cut for copies started after the check, one for those started
    before it), and their output ranges per destination (by the destination buffers'
    pointers; a sender has a few slots, each met again and again)."""

    def __init__(
        self,
        segments: list[tuple[int, int, torch.Tensor]],
        total: int,
        threads: int,
        sources: list[tuple[int, torch.Tensor]],
    ):
        self._segments = segments
        """(buffer, start, piece): the bytes of every buffer up to its last tensor, in order."""
        self._views = [view for _, view in sources]
        self._picked = operator.itemgetter(*[i for i, _ in sources]) if sources else None
        """The pointers of the sources the views are of, picked from a source set's key."""
        self._total = total
        self._threads = threads
        self._cuts: dict[float, tuple[list[list[_Run]], list[list[_Run]]]] = {}
        self._destinations: dict[tuple[float, tuple[int, ...]], _Outputs] = {}
        """Output ranges per (cut, destination pointers)."""

    def still_at(self, key: Pointers) -> bool:
        """Whether the sources' memory is still where ``key`` (the pointers the plan was kept
        under) says. A storage can move under its tensors (``share_memory_()``, a storage
        freed and grown again by ``resize_``): the plan's views follow it, and other tensors
        may then come to lie at the old pointers, which would find this plan."""
        if self._picked is None:
            return True
        picked = self._picked(key)
        wanted = list(picked) if isinstance(picked, tuple) else [picked]
        return list(map(_data_ptr, self._views)) == wanted

    def _groups(self, early: float) -> tuple[list[list[_Run]], list[list[_Run]]]:
        found = self._cuts.get(early)
        if found is not None:
            return found
        heads, tails = split_sizes(self._total, self._threads, early)
        segments = self._segments
        groups: list[list[_Run]] = [[] for _ in heads + tails]
        for k, i, done, take in cut([p.numel() for _, _, p in segments], heads + tails):
            b, start, piece = segments[i]
            part = piece if take == piece.numel() else piece[done : done + take]
            runs = groups[k]
            run = runs[-1] if runs else None
            at = start + done
            if run is not None and run.buffer == b and run.end == at:
                run.pieces.append(part)
                run.end = at + take
            else:
                runs.append(_Run(b, at, at + take, [part]))
        made = ([g for g in groups[: len(heads)] if g], [g for g in groups[len(heads) :] if g])
        self._cuts[early] = made
        return made

    def job(self, dst: Sequence[torch.Tensor], streaming: bool, early: float = 0.0) -> _GatherJob:
        """A job (not started) that fills ``dst``, with non-temporal stores if ``streaming``;
        ``early``: started before the check (see ``split_sizes``)."""
        key = (early, tuple(map(_data_ptr, dst)))
        out = self._destinations.get(key)
        if out is None:
            if len(self._destinations) >= KEPT_DESTINATIONS:
                self._destinations.clear()

            def outputs(groups: list[list[_Run]]) -> list[_Share]:
                return [[(r.pieces, dst[r.buffer][r.start : r.end]) for r in g] for g in groups]

            head, tails = self._groups(early)
            out = self._destinations[key] = _Outputs(outputs(head), outputs(tails))
        if streaming:
            if out.packed is None:
                out.packed = (
                    [_share_moves(s) for s in out.head],
                    [_share_moves(s) for s in out.tails],
                )
            return CopyJob(out.packed[0], out.packed[1], copy_packed)
        return CopyJob(out.head, out.tails, _gather_share)


@dataclass(slots=True, eq=False)
class _Outputs:
    """A plan's shares for one destination: the head's and the tails', and the same as
    packed moves once a non-temporal copy asked for them (their addresses stay valid while
    the shares hold the views)."""

    head: list[_Share]
    tails: list[_Share]
    packed: tuple[list[Packed], list[Packed]] | None = None


def _gather_share(share: _Share) -> None:
    for pieces, out in share:
        torch.cat(pieces, out=out)


def _share_moves(share: _Share) -> Packed:
    """The memmoves that fill ``share``'s output ranges with their pieces, packed."""
    moves = []
    for pieces, out in share:
        at = out.data_ptr()
        for piece in pieces:
            n = piece.numel()
            moves.append((at, piece.data_ptr(), n))
            at += n
    return pack_moves(moves)


_data_ptr = torch.Tensor.data_ptr
_is_contiguous = torch.Tensor.is_contiguous
_is_conj = torch.Tensor.is_conj
_is_neg = torch.Tensor.is_neg


def _all_plain(tensors: Sequence[torch.Tensor], lazy_views: bool = True) -> bool:
    """Contiguous, and their memory holds their values (no lazy conjugate or negation)."""
    return all(map(_is_contiguous, tensors)) and not (
        lazy_views and (any(map(_is_conj, tensors)) or any(map(_is_neg, tensors)))
    )
