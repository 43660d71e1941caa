"""A version's flat image in buckets, packed from its source one bucket at a time.

The distributed sender packs each version into a private slot while it sends it: bucket i+1
is packed while bucket i is on the wire, so the copy out of the user's weights overlaps the
network instead of coming before it.
"""

from __future__ import annotations

import bisect
import operator
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from aiowsync._copy.engine import CopyPolicy, byte_view, copy_moves, fused_copy
from aiowsync._weights.layout import Layout

from ..base import Source
from ..digest import Chunks

__all__ = [
    "Buckets",
    "Image",
    "Packer",
    "as_bytes",
    "choose_bucket_bytes",
    "plain_pointers",
    "section_spans",
]

_MiB = 1 << 20
STAR_BUCKET_BYTES = 32 * _MiB
"""A star's buckets: on loopback, 16 to 64 MiB performed alike, and smaller ones paid for
their many rounds of sends."""
CHAIN_BUCKETS_PER_MEMBER = 8
"""A chain's buckets per member: a send takes about (buckets + members - 1) bucket times,
so eight per member keep it within about 1.12x one link's transfer."""
MIN_BUCKET_BYTES = 1 * _MiB
_is_cpu = operator.attrgetter("is_cpu")


def choose_bucket_bytes(total: int, topology: str, members: int) -> int:
    """The bucket size for a model of ``total`` bytes sent to ``members`` workers.

    A star sends each bucket to every member itself: 32 MiB buckets (only the first one's
    packing is not overlapped). A chain pipelines only with enough buckets to fill it: each
    bucket must pass every member, so the last member gets the last bucket ``members - 1``
    bucket times after the first one did. Its buckets are ``total / (8 * members)``, rounded
    up to 256 KiB, between 1 and 32 MiB.
    """
    if topology != "chain":
        return STAR_BUCKET_BYTES
    count = CHAIN_BUCKETS_PER_MEMBER * max(1, members)
    step = _MiB // 4
    size = -(-total // count)
    size = -(-size // step) * step
    return max(MIN_BUCKET_BYTES, min(STAR_BUCKET_BYTES, size))


class Buckets:
    """Byte ranges of a version's flat image, and which piece of each source lands in each.

    A source is a list of segments ``(global offset, nbytes)`` (a tensor of the layout, or one
    of its flat buffers); a bucket's plan lists ``(segment, start, stop)`` byte ranges within
    segments, so that packing bucket i copies exactly bytes ``ranges[i]`` of the image.
    """

    def __init__(
        self, total: int, bucket_bytes: int, spans: Sequence[tuple[int, int]] = ()
    ) -> None:
        """Buckets of at most about ``bucket_bytes`` over ``[0, total)``; with ``spans`` (the
        byte ranges of the models of a layout of several), no bucket crosses from one span
        into the next, so that each model's bytes travel in buckets of their own."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.ranges: list[tuple[int, int]] = []
        self.span_of: list[int] = []
        """The span (model) each bucket belongs to."""
        for number, (start, stop) in enumerate(spans or [(0, total)]):
            ranges = [(lo, min(lo + bucket_bytes, stop)) for lo in range(start, stop, bucket_bytes)]
            if len(ranges) > 1 and ranges[-1][1] - ranges[-1][0] < bucket_bytes // 8:
                # A sliver (often just alignment padding) rides with the bucket before it:
                # one collective fewer, for a bucket at most 1/8 larger.
                ranges[-2:] = [(ranges[-2][0], stop)]
            self.ranges += ranges
            self.span_of += [number] * len(ranges)

    def plan(self, segments: Sequence[tuple[int, int]]) -> list[list[tuple[int, int, int]]]:
        starts = [offset for offset, _ in segments]
        plans: list[list[tuple[int, int, int]]] = []
        for lo, hi in self.ranges:
            pieces = []
            index = max(0, bisect.bisect_right(starts, lo) - 1)
            while index < len(segments) and segments[index][0] < hi:
                offset, nbytes = segments[index]
                a, b = max(lo, offset), min(hi, offset + nbytes)
                if a < b:
                    pieces.append((index, a - offset, b - offset))
                index += 1
            plans.append(pieces)
        return plans


def section_spans(layout: Layout) -> list[tuple[int, int]]:
    """The byte range of each model of a layout of several, in the layout's flat image, in
    the layout's section order (one range, all of it, for one model)."""
    starts = [0]
    for size in layout.buffer_sizes:
        starts.append(starts[-1] + size)
    return [(starts[first], starts[last]) for first, last in layout.sections.values()]


def plain_pointers(tensors: Sequence[torch.Tensor], device: torch.device) -> list[int]:
    """The tensors' addresses when every one is a plain contiguous CPU tensor (and the slots
    are on the CPU too), else ``[]``: then packing goes through tensor views."""
    if device.type != "cpu":
        return []
    # map() over the C accessors: some 0.2 ms for a thousand tensors, a fifth of a loop that
    # asks each one for its device.
    plain = (
        all(map(_is_cpu, tensors))
        and all(map(torch.Tensor.is_contiguous, tensors))
        and not any(map(torch.Tensor.is_conj, tensors))
        and not any(map(torch.Tensor.is_neg, tensors))
    )
    return list(map(torch.Tensor.data_ptr, tensors)) if plain else []


def _holds(tensors: Sequence[torch.Tensor]) -> list[Any]:
    """What keeps the memory of ``tensors`` alive: their storages (a tenth of the cost of
    detached views), or detached views of those that have none to give."""
    try:
        return list(map(torch.Tensor.untyped_storage, tensors))
    except (RuntimeError, NotImplementedError):
        return [t.detach() for t in tensors]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as contiguous bytes (lazy conjugates and negations resolved)."""
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return byte_view(t)


@dataclass(slots=True)
class Image:
    """A slot's flat bytes, and how far the version staged in it is packed."""

    flat: torch.Tensor
    source: Source | None = None
    # The storages of the source's tensors (held while we read them, even if the model is
    # given other tensors meanwhile) and the tensors' addresses.
    source_refs: list[Any] | None = None
    source_pointers: list[int] | None = None  # [] when not all plain CPU tensors
    packed: int = 0  # buckets packed so far
    hashes: dict[int, int] = field(default_factory=dict)
    """Digest buckets (see :class:`~aiowsync._planes.digest.Chunks`) hashed so far."""
    complete: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Packer:
    """Packs sources laid out by ``layout`` into images, bucket by bucket; thread-safe."""

    def __init__(
        self, layout: Layout, bucket_bytes: int, device: torch.device, policy: CopyPolicy
    ) -> None:
        self.layout = layout
        self.device = device
        self._policy = policy
        self._spans = section_spans(layout)
        self.buckets = Buckets(layout.total_bytes, bucket_bytes, self._spans)
        self.chunks = Chunks(layout, self.buckets.ranges)
        starts = [0]
        for size in layout.buffer_sizes[:-1]:
            starts.append(starts[-1] + size)
        self._buffer_starts = starts
        self._tensor_starts = [starts[s.buffer] + s.offset for s in layout.specs]
        self._tensor_plan = self.buckets.plan(
            [(start, s.nbytes) for start, s in zip(self._tensor_starts, layout.specs, strict=True)]
        )
        self._buffer_plan = self.buckets.plan(list(zip(starts, layout.buffer_sizes, strict=True)))

    def new_image(self) -> Image:
        # Zeroed: the alignment gaps between tensors travel too, and must not carry whatever
        # this process's memory held before.
        return Image(torch.zeros(self.layout.total_bytes, dtype=torch.uint8, device=self.device))

    def start(self, image: Image, source: Source) -> None:
        """Make ``source`` the next thing packed into ``image``; nothing is copied yet."""
        if source.buffers is None and source.tensors is None:
            raise ValueError("empty source")
        image.source, image.packed, image.source_pointers, image.source_refs = source, 0, None, None
        image.hashes = {}
        image.complete.clear()

    def fill(self, image: Image, source: Source) -> None:
        """Pack the tensors ``source`` gives now, one by one (casting where dtypes differ).
        A send of some models gives only theirs: the image's other models are never sent
        from it."""
        assert source.tensors is not None
        views = self.layout.views(self.layout.split(image.flat))
        keys = [k for k in self.layout.keys if k in source.tensors]
        image.hashes = {}
        fused_copy([views[k] for k in keys], [source.tensors[k] for k in keys], self._policy)
        with image.lock:
            image.source = image.source_refs = image.source_pointers = None
            image.packed = len(self.buckets.ranges)
            image.complete.set()

    def copy_models(self, image: Image, sources: Mapping[int, Image]) -> None:
        """Copy into ``image`` the bytes of models (by number) from the images that hold
        them (a version that carries them takes a copy instead of pointing at those)."""
        for number, source in sources.items():
            lo, hi = self._spans[number]
            image.flat[lo:hi].copy_(source.flat[lo:hi])

    def pack(self, image: Image, index: int) -> None:
        """Pack buckets up to ``index`` (a no-op for those already packed)."""
        with image.lock:
            while image.packed <= index and image.source is not None:
                self._pack_one(image, image.packed, image.source)

    def hash_bucket(self, image: Image, index: int) -> None:
        """Hash the digest buckets that bucket ``index`` (packed) completes."""
        for chunk in self.chunks.completed_by[index]:
            image.hashes[chunk] = self.chunks.hash(image.flat, chunk)

    def hashes(self, image: Image, chunks: range) -> list[int]:
        """The hashes of digest buckets ``chunks`` of ``image``, those not hashed yet hashed
        now (after packing what is left)."""
        if any(c not in image.hashes for c in chunks):
            self.seal(image)
            for chunk in chunks:
                if chunk not in image.hashes:
                    image.hashes[chunk] = self.chunks.hash(image.flat, chunk)
        return [image.hashes[c] for c in chunks]

    def seal(self, image: Image) -> None:
        """Pack whatever is not packed yet: after this the source is never read again."""
        while image.source is not None and image.packed < len(self.buckets.ranges):
            self.pack(image, image.packed)

    def _pack_one(self, image: Image, index: int, source: Source) -> None:
        if source.buffers is not None:
            plan, starts = self._buffer_plan[index], self._buffer_starts
        else:
            plan, starts = self._tensor_plan[index], self._tensor_starts
        if image.source_pointers is None:
            segments = self._segments(source)
            image.source_refs = _holds(segments)
            image.source_pointers = plain_pointers(segments, self.device)
        pointers = image.source_pointers
        if pointers:
            # Plain memmoves between addresses: a tensor view per piece costs more than the
            # copy itself when a model has many small tensors.
            base = image.flat.data_ptr()
            moves = [(base + starts[seg] + a, pointers[seg] + a, b - a) for seg, a, b in plan]
            copy_moves(moves, self._policy)
        else:
            self._pack_views(image, source, plan, starts)
        image.packed = index + 1
        if image.packed == len(self.buckets.ranges):
            image.source = image.source_refs = image.source_pointers = None
            image.complete.set()

    def _segments(self, source: Source) -> list[torch.Tensor]:
        if source.buffers is not None:
            return list(source.buffers)
        assert source.tensors is not None
        return [source.tensors[k] for k in self.layout.keys]

    def _pack_views(
        self,
        image: Image,
        source: Source,
        plan: list[tuple[int, int, int]],
        starts: list[int],
    ) -> None:
        pieces: Mapping[int, torch.Tensor]
        if source.buffers is not None:
            pieces = dict(enumerate(source.buffers))
        else:
            assert source.tensors is not None
            tensors, keys = source.tensors, self.layout.keys
            pieces = {seg: tensors[keys[seg]] for seg, _, _ in plan}
        dsts, srcs = [], []
        for seg, a, b in plan:
            start = starts[seg] + a
            srcs.append(as_bytes(pieces[seg])[a:b])
            dsts.append(image.flat[start : start + (b - a)])
        fused_copy(dsts, srcs, self._policy)
