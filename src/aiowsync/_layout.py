"""Layouts: where each tensor of a model lives inside a few flat, aligned byte buffers.

A :class:`Layout` is the ordered table ``(key, dtype, shape, buffer, offset)``. Keys are sorted so
that a module, its ``state_dict`` and its ``TensorDict`` all give the same layout. Every tensor
starts on an ``alignment``-byte boundary, so a typed view of a byte buffer is always legal.
"""

from __future__ import annotations

import array
import collections
import contextlib
import ctypes
import hashlib
import itertools
import json
import operator
import os
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache, cached_property
from typing import TYPE_CHECKING, Generic, TypeAlias, TypeVar

import torch
from torch import nn

from ._exceptions import LayoutMismatchError
from ._protocol import TensorDesc
from ._weights import WeightsLike, flatten_weights

try:
    from . import _stream
except ImportError:  # built without its C part (no compiler at install): plain copies
    _stream = None  # type: ignore[assignment]

__all__ = ["GatherCopy", "Layout", "TensorSpec"]

DEFAULT_ALIGNMENT = 64


def _dtype_from_name(name: str) -> torch.dtype:
    # A fixed table, never getattr(torch, name): names come from the wire, and some torch
    # attributes import whole subsystems or warn when touched.
    dtype = _DTYPES.get(name)
    if dtype is None:
        raise LayoutMismatchError([f"unknown dtype {name[:40]!r}"], context="layout")
    return dtype


_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where one tensor lives: ``nbytes`` bytes at ``offset`` in buffer number ``buffer``."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    buffer: int
    offset: int

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of data (no padding)."""
        return self.numel * self.dtype.itemsize

    def describe(self) -> str:
        """dtype and shape, as in error messages (``float32[4, 16]``)."""
        return f"{_dtype_name(self.dtype)}{list(self.shape)}"


class Layout:
    """The packing table of a set of named tensors.

    Build one with :meth:`from_weights` (a module, a ``TensorDict`` or a state_dict) or
    :meth:`from_descs` (the form that travels in the handshake).
    """

    __slots__ = ("__dict__", "alignment", "buffer_sizes", "specs")

    def __init__(
        self,
        shapes: Iterable[tuple[str, torch.dtype, Sequence[int]]],
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        bucket_bytes: int | None = None,
    ) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if bucket_bytes is not None and bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        rows = sorted(
            ((k, dt, tuple(int(d) for d in s)) for k, dt, s in shapes), key=lambda row: row[0]
        )
        specs: list[TensorSpec] = []
        sizes: list[int] = [0]
        seen: set[str] = set()
        for key, dtype, shape in rows:
            if key in seen:
                raise ValueError(f"duplicate key {key!r}")
            seen.add(key)
            if any(d < 0 for d in shape):
                raise ValueError(f"negative dimension in {key!r}: {shape}")
            spec_bytes = TensorSpec(key, dtype, shape, 0, 0).nbytes
            offset = _round_up(sizes[-1], alignment)
            if bucket_bytes is not None and sizes[-1] > 0 and offset + spec_bytes > bucket_bytes:
                sizes.append(0)
                offset = 0
            specs.append(TensorSpec(key, dtype, shape, len(sizes) - 1, offset))
            sizes[-1] = offset + spec_bytes
        self.specs: tuple[TensorSpec, ...] = tuple(specs)
        self.buffer_sizes: tuple[int, ...] = tuple(_round_up(s, alignment) for s in sizes)
        self.alignment = alignment

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_weights(
        cls,
        weights: WeightsLike,
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        bucket_bytes: int | None = None,
    ) -> Layout:
        """The layout of a module, a ``TensorDict`` or a state_dict (dotted keys)."""
        flat = flatten_weights(weights)
        return cls(
            ((k, t.dtype, tuple(t.shape)) for k, t in flat.items()),
            alignment=alignment,
            bucket_bytes=bucket_bytes,
        )

    @classmethod
    def from_descs(
        cls,
        descs: Iterable[TensorDesc],
        *,
        alignment: int = DEFAULT_ALIGNMENT,
        bucket_bytes: int | None = None,
    ) -> Layout:
        """The layout described by ``descs`` (as a receiver's hello carries them)."""
        return cls(
            ((d.key, _dtype_from_name(d.dtype), d.shape) for d in descs),
            alignment=alignment,
            bucket_bytes=bucket_bytes,
        )

    def descs(self) -> tuple[TensorDesc, ...]:
        """The rows as they travel in a hello: key, dtype name, shape."""
        return tuple(TensorDesc(s.key, _dtype_name(s.dtype), s.shape) for s in self.specs)

    # -- identity -----------------------------------------------------------------------------

    @cached_property
    def fingerprint(self) -> str:
        """SHA-256 over keys, dtypes and shapes (not offsets: those follow from them)."""
        rows = [[s.key, _dtype_name(s.dtype), list(s.shape)] for s in self.specs]
        return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()

    @property
    def total_bytes(self) -> int:
        """Bytes of all flat buffers, alignment padding included."""
        return sum(self.buffer_sizes)

    @property
    def payload_bytes(self) -> int:
        """Bytes of tensor data, without alignment padding."""
        return sum(s.nbytes for s in self.specs)

    @cached_property
    def keys(self) -> tuple[str, ...]:
        return tuple(s.key for s in self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Layout):
            return NotImplemented
        return self.fingerprint == other.fingerprint and self.alignment == other.alignment

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        n, size, fp = len(self.specs), self.total_bytes, self.fingerprint[:12]
        return f"Layout({n} tensors, {size} bytes, {fp})"

    # -- checks -------------------------------------------------------------------------------

    def differences(self, other: Layout) -> list[str]:
        """One line per key whose presence, dtype or shape differs; empty when compatible."""
        mine = {s.key: s for s in self.specs}
        theirs = {s.key: s for s in other.specs}
        out: list[str] = []
        for key in sorted(mine.keys() | theirs.keys()):
            a, b = mine.get(key), theirs.get(key)
            if a is None:
                assert b is not None
                out.append(f"{key}: unexpected key ({b.describe()})")
            elif b is None:
                out.append(f"{key}: missing (expected {a.describe()})")
            elif a.shape != b.shape or a.dtype != b.dtype:
                out.append(f"{key}: expected {a.describe()}, got {b.describe()}")
        return out

    def check_compatible(self, other: Layout, *, context: str = "model") -> None:
        """Raise :class:`LayoutMismatchError` naming every difference between the layouts."""
        if other.fingerprint != self.fingerprint:
            raise LayoutMismatchError(self.differences(other), context=context)

    @cached_property
    def _expected(self) -> tuple[list[torch.dtype], list[torch.Size]]:
        return [s.dtype for s in self.specs], [torch.Size(s.shape) for s in self.specs]

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Check flat named tensors against this layout before any byte is written."""
        if len(tensors) == len(self.specs):
            # The common case, all in order, in one pass of C calls (0.1 ms per 1000 tensors).
            try:
                values = [tensors[k] for k in self.keys]
                dtypes, sizes = self._expected
                if list(map(_get_dtype, values)) == dtypes and list(map(_size, values)) == sizes:
                    return
            except (KeyError, TypeError, AttributeError):
                pass
        problems: list[str] = []
        for spec in self.specs:
            t = tensors.get(spec.key)
            if t is None:
                problems.append(f"{spec.key}: missing (expected {spec.describe()})")
            elif t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                problems.append(
                    f"{spec.key}: expected {spec.describe()}, got "
                    f"{_dtype_name(t.dtype)}{list(t.shape)}"
                )
        known = set(self.keys)
        problems.extend(f"{k}: unexpected key" for k in sorted(tensors) if k not in known)
        if problems:
            raise LayoutMismatchError(problems)

    # -- buffers and views --------------------------------------------------------------------

    def allocate(self, device: torch.device | str = "cpu") -> list[torch.Tensor]:
        """Fresh zeroed byte buffers for this layout."""
        return [torch.zeros(n, dtype=torch.uint8, device=device) for n in self.buffer_sizes]

    def views(self, buffers: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Typed, shaped views of ``buffers`` (byte tensors), one per key, in layout order."""
        if len(buffers) != len(self.buffer_sizes):
            raise ValueError(f"expected {len(self.buffer_sizes)} buffers, got {len(buffers)}")
        for buf, size in zip(buffers, self.buffer_sizes, strict=True):
            if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < size:
                raise ValueError(f"buffers must be 1-D uint8 of at least {size} bytes")
        out: dict[str, torch.Tensor] = {}
        for s in self.specs:
            raw = buffers[s.buffer][s.offset : s.offset + s.nbytes]
            out[s.key] = raw.view(s.dtype).view(s.shape)
        return out

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Cut one flat byte tensor of ``total_bytes`` into this layout's buffers (views)."""
        out, start = [], 0
        for size in self.buffer_sizes:
            out.append(flat[start : start + size])
            start += size
        return out

    def pack(self, tensors: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> None:
        """Copy named tensors into views ``dst`` (from :meth:`views`) with fused copies."""
        fused_copy([dst[k] for k in self.keys], [tensors[k] for k in self.keys])


def refuse_meta(tensors: Mapping[str, torch.Tensor], why: str) -> None:
    """Raise ``ValueError`` if any tensor is on the meta device (``why``: what it cannot do)."""
    if not any(map(_is_meta, tensors.values())):
        return
    meta = [k for k, t in tensors.items() if t.is_meta]
    raise ValueError(
        f"the model has tensors on the meta device ({', '.join(meta[:5])}"
        f"{', ...' if len(meta) > 5 else ''}): {why}; "
        "materialise the model first (e.g. model.to_empty(device='cpu'))"
    )


_is_meta = operator.attrgetter("is_meta")


def fused_copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i, as fast as the device allows.

    On CPU, torch copies a list tensor by tensor and starts an OpenMP parallel region for each
    mid-sized one; with idle OpenMP threads sleeping (``OMP_WAIT_POLICY=PASSIVE``) every region
    pays to wake them, which made a 1000-tensor 64 MiB copy about 3x slower than one flat copy
    here. Contiguous CPU tensors are therefore copied with plain memmoves: in this thread when
    they are small in total, else in pieces that a few threads take from one queue. Anything else
    takes ``torch._foreach_copy_``.
    """
    if not dst:
        return
    dst, src = list(dst), list(src)
    with torch.no_grad():
        moves, total, others = _moves(dst, src)
        if others:
            torch._foreach_copy_([dst[i] for i in others], [src[i] for i in others])
        if not moves:
            return
        if total < _PARALLEL_COPY_BYTES:
            # Small: memmoves in this thread. Waking torch's sleeping OpenMP team for each
            # tensor would cost more than the copy (a 1 MiB model: ~350 us against ~60 us).
            _copy_share(moves)
        else:
            _parallel_copy(moves, total)


_Moves = list[tuple[int, int, int]]
"""(dst, src, nbytes) memmoves."""


def _moves(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]
) -> tuple[_Moves, int, list[int]]:
    """The (dst, src, nbytes) memmoves of the pairs that are plain CPU tensors, their bytes,
    and the indices of the other pairs."""
    moves: _Moves = []
    others: list[int] = []
    total = 0
    for i, (d, s) in enumerate(zip(dst, src, strict=True)):
        if _plain_cpu(d, s):
            n = d.nbytes
            moves.append((d.data_ptr(), s.data_ptr(), n))
            total += n
        else:
            others.append(i)
    return moves, total, others


_PARALLEL_COPY_BYTES = 4 * 1024 * 1024
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


def _plain_cpu(d: torch.Tensor, s: torch.Tensor) -> bool:
    # Called for every tensor of every send: the cheapest attribute reads first.
    return (
        d.is_cpu
        and s.is_cpu
        and d.dtype == s.dtype
        and d.is_contiguous()
        and s.is_contiguous()
        and d.shape == s.shape
        and not (s.is_conj() or s.is_neg() or d.is_conj() or d.is_neg())
    )


def _copy_share(moves: list[tuple[int, int, int]]) -> None:
    if streaming():
        _copy_packed(pack_moves(moves))
        return
    # ctypes releases the GIL around memmove, so shares in several threads copy in parallel.
    move = ctypes.memmove
    for dst, src, n in moves:
        move(dst, src, n)


# -- non-temporal copies ------------------------------------------------------------------------
#
# Ordinary stores read each destination cache line before overwriting it; the non-temporal
# stores of the small C module ``_stream`` do not, so they move two bytes over the memory bus
# per byte copied instead of three, and leave the copy out of the caches. What these copies
# write is read later, mostly by other processes (a sender's slot) or after the next
# optimizer step (a receiver's private copy), so little is lost by that. Here the
# 1000-tensor 64 MiB gather went from 4.9-5.1 ms to 3.5-3.7 ms with two threads
# (docs/decisions.md, 49). Every copy of this module goes through it where it was built, on
# x86-64; elsewhere, the copies above are used.

_streaming = _stream is not None and _stream.STREAMS and os.environ.get("AIOWSYNC_STREAM") != "0"


def streaming() -> bool:
    """Whether copies use non-temporal stores (the ``_stream`` module was built, on x86-64,
    and ``AIOWSYNC_STREAM=0`` is not set)."""
    return _streaming


def set_streaming(on: bool) -> bool:
    """Turn non-temporal copies on or off for this process (benchmarks compare the two);
    returns the previous setting. Turning them on where they are not available raises
    ``RuntimeError``."""
    global _streaming
    if on and (_stream is None or not _stream.STREAMS):
        raise RuntimeError("non-temporal copies are not available: aiowsync._stream was not built")
    before, _streaming = _streaming, on
    return before


def pack_moves(moves: Iterable[tuple[int, int, int]]) -> array.array[int]:
    """``moves`` (dst, src, nbytes) as the packed native uint64 triples ``_stream`` reads."""
    return array.array("Q", itertools.chain.from_iterable(moves))


_SMALL_MOVE = 256 * 1024
_MAX_MOVE = 64 * 1024 * 1024
"""No single memmove is longer. glibc copied much longer ones (190 MiB and up here) with its
own non-temporal stores, and during 1 GiB sends the other processes' event loops then stalled
up to 20-30 ms, against a few ms with moves of this size (docs/decisions.md, 21). ``_stream``
keeps to the same length, and the loops did not stall (decision 49)."""


_PIECES_PER_THREAD = 8
"""The shared part of a parallel copy is cut into about this many pieces per thread, which the
threads take from one queue as they come free. Equal fixed shares finished only as fast as the
slowest thread: the last one to wake, or one the machine's other processes preempted. Taking
pieces as they come made a 1000-tensor 64 MiB copy 0.3-0.6 ms faster here (1.06-1.13x one
flat copy down to 0.93-1.02x), and a flat 256 MiB one 1.05-1.17x down to 1.0x."""

_TAIL = 0.8
"""The part of its fair share that each helper thread of a parallel copy copies first, as one
call: the end of the destination, while the calling thread may still be checking the source
(see :class:`CopyJob`). The rest is shared through the queue."""

_EARLY_TAILS = 0.55
"""At most this part of a copy started before the caller's check goes to the helpers' tails,
all together. While the caller checks (its Python holds the interpreter lock), a helper can
copy only its tail: the tail should outlast the check, yet leave the caller a part as long as
the rest of the helper's. With a check of ``c`` seconds and ``t`` seconds for one thread to
copy everything, that is ``c / t <= share <= (1 + c / t) / 2``. Here one thread copies 64 MiB
in about 6.6 ms; a model's own 1000 tensors check in about 0.6 ms (0.09-0.55) and a
``TensorDict`` of 1000 leaves in 3.5-4.5 ms beside a copy (0.53-0.84): 0.55 is at the edge of
both. A few large tensors check in microseconds (``c / t`` near 0): their early copy is cut
like any other (see :func:`early_share`)."""

_CHECK_S_PER_TENSOR = 4.5e-6
"""The most a check was seen to cost per tensor, beside a running copy (a ``TensorDict``)."""
_COPY_BYTES_PER_S = 10e9
"""About what one thread copies per second between large buffers here (64 MiB in 6.6 ms)."""


def early_share(tensors: int, nbytes: int) -> float:
    """For a copy of ``nbytes`` bytes started before a check of ``tensors`` tensors: the
    expected ``c / t`` of :data:`_EARLY_TAILS`, the check's cost over one thread's copy, from
    the worst cost per tensor seen. Below the usual tail share, the copy is cut as usual.

    With the early share applied to a few large tensors, the helper's fixed tail ran past
    the caller's part: in a send of 256 MiB to 4 workers, the staging thread had copied its
    45% and waited 4-10 ms for the helper's 55% (docs/decisions.md, 45)."""
    if nbytes <= 0:
        return 0.0
    return tensors * _CHECK_S_PER_TENSOR * _COPY_BYTES_PER_S / nbytes


_SETTLE_S = 0.002
"""How long a copy started ahead of a check waits for its first helper to begin."""

W = TypeVar("W")


class CopyJob(Generic[W]):
    """A copy spread over the calling thread and a few helper threads.

    Each helper first copies its *tail* (a piece given to it alone, taken as one call, which
    needs the interpreter lock only to start), then, like the calling thread, takes pieces
    of the *head* from one queue until none is left.

    A job can be started before the caller knows that its source is still the right one:
    the check of a model's thousand tensors costs about a millisecond of cold Python, which
    the helpers spend copying. The caller then either :meth:`finish`-es the job or
    :meth:`abandon`-s it; either way, every helper has stopped once that returns.
    """

    def __init__(self, head: list[W], tails: list[W], run: Callable[[W], None]) -> None:
        self._head = head
        self._tails = tails
        self._run = run
        self._taken = itertools.count()
        self._stopped = False
        self._futures: list[Future[None]] = []
        self._begun = threading.Event()
        self._cpus: set[int] | None = None

    def start(self, executor: ThreadPoolExecutor, *, settle: float = 0.0) -> None:
        """Set the helpers going (one per tail). ``settle``: wait up to that many seconds for
        the first helper to begin its tail. A caller about to run Python holds the
        interpreter lock, which a helper needs to begin at all: without the wait, the helper
        would start only once the caller's own copy lets the lock go."""
        if self._tails:
            self._cpus = _steer_helpers()
        self._futures = [executor.submit(self._help, tail) for tail in self._tails]
        if settle > 0 and self._futures:
            self._begun.wait(settle)

    def _help(self, tail: W) -> None:
        if self._cpus is not None:
            _unsteer(self._cpus)
        self._begun.set()
        if not self._stopped:
            self._run(tail)
        self._drain()

    def _drain(self) -> None:
        # ``next`` on an itertools.count is atomic under the GIL: each piece is taken once.
        head, n = self._head, len(self._head)
        for i in self._taken:
            if i >= n or self._stopped:
                return
            self._run(head[i])

    def finish(self) -> None:
        """Copy the head's pieces alongside the helpers, then wait for them (a helper's error
        is raised here)."""
        try:
            self._drain()
        finally:
            self._wait()

    def abandon(self) -> None:
        """Stop taking pieces and wait for the helpers; what they copied is to be overwritten,
        so their errors are dropped."""
        self._stopped = True
        with contextlib.suppress(Exception):
            self._wait()

    def _wait(self) -> None:
        for future in self._futures:
            future.result()


def _split_sizes(total: int, threads: int, early: float = 0.0) -> tuple[list[int], list[int]]:
    """Byte counts of the head's pieces and of the helpers' tails for a copy of ``total``
    bytes over ``threads`` threads: the tails come last in the destination, in this order.
    ``early``: for a copy started before the caller's check, the check's expected cost over
    one thread's copy (:func:`early_share`); the tails take that part of the bytes, if it is
    more than usual, up to :data:`_EARLY_TAILS`."""
    helpers = threads - 1
    fair = total // threads
    share = int(fair * _TAIL)
    if early > 0 and helpers:
        share = max(share, int(total * min(early, _EARLY_TAILS)) // helpers)
    tail = share if helpers and fair >= 2 * _SMALL_MOVE else 0
    head = total - helpers * tail
    count = max(1, min(threads * _PIECES_PER_THREAD, head // _SMALL_MOVE))
    piece = -(-head // count)
    heads = [min(piece, head - start) for start in range(0, head, piece)] if head else []
    return heads, [tail] * helpers if tail else []


def start_copy(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], early: float = 0.0
) -> CopyJob[_Moves] | None:
    """:func:`fused_copy` of large plain CPU tensors, started in helper threads and to be
    finished (or abandoned) by the caller, who checks meanwhile (``early``: see
    :func:`_split_sizes`); None, having copied nothing, for anything else."""
    moves, total, others = _moves(dst, src)
    if others or total < _PARALLEL_COPY_BYTES:
        return None
    job = _move_job(moves, total, early)
    job.start(_copy_pool_executor(), settle=_SETTLE_S)
    return job


def _copy_pool_executor() -> ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix=_COPY_THREADS)
        return _copy_pool


# -- where helper threads run -------------------------------------------------------------------
#
# A helper woken by a thread that goes on running (the caller copies its own share, or checks
# the weights) is placed by Linux on its last CPU, or the waker's, when those look best, even
# busy, and waits there for the scheduler's next balancing tick while another CPU idles: on
# the 2-CPU machine of docs/benchmarks.md, helpers began 1-4 ms late and the copies of a
# 1000-tensor model took 7-9 ms instead of 5-6 (docs/decisions.md, 44). So, just before
# waking helpers, the caller takes its own CPU out of their affinity, and each helper puts
# the caller's full set back as soon as it runs. Only our own helper threads are touched,
# only within the caller's CPU set, and only where Linux offers the calls.

_COPY_THREADS = "aiowsync-copy"
_GATHER_THREADS = "aiowsync-gather"
_steering = hasattr(os, "sched_setaffinity")


@cache
def _sched_getcpu() -> Callable[[], int] | None:
    try:
        return ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError):
        return None


def _steer_helpers() -> set[int] | None:
    """Keep the helpers off this thread's CPU until they run; the CPU set they are to get back
    (None: nothing was changed)."""
    global _steering
    if not _steering:
        return None
    getcpu = _sched_getcpu()
    try:
        cpus = os.sched_getaffinity(0)
        here = getcpu() if getcpu is not None else -1
        if here not in cpus:
            _steering = False  # no telling where this thread runs
            return None
        others = cpus - {here}
        if not others:
            return None  # one CPU: nowhere else to go
        for thread in threading.enumerate():
            tid = thread.native_id
            if tid is not None and thread.name.startswith((_COPY_THREADS, _GATHER_THREADS)):
                with contextlib.suppress(ProcessLookupError):  # it just ended
                    os.sched_setaffinity(tid, others)
    except OSError:
        _steering = False  # not allowed here (a sandbox): leave placement to the kernel
        return None
    return cpus


def _unsteer(cpus: set[int]) -> None:
    """In a helper: take back the caller's CPU set."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cpus)


def _parallel_copy(moves: list[tuple[int, int, int]], total: int) -> None:
    """``moves`` (dst, src, nbytes) spread over up to four threads, this one included."""
    job = _move_job(moves, total)
    job.start(_copy_pool_executor())
    job.finish()


def _move_job(moves: list[tuple[int, int, int]], total: int, early: float = 0.0) -> CopyJob[_Moves]:
    """A :class:`CopyJob` for ``moves`` (not started; ``early``: see :func:`_split_sizes`).

    Every memmove gives up the GIL and must take it back, so threads that each make many
    small moves mostly wait for one another. The calling thread therefore takes the small
    moves first (its first piece of the head), smallest first, up to its fair share of the
    bytes; the other moves are laid end to end and cut into the helpers' tails (from the end)
    and the head's pieces, each cut again into memmoves of at most ``_MAX_MOVE`` bytes.
    """
    threads = max(1, min(4, torch.get_num_threads()))
    fair = max(1, -(-total // threads))
    own: _Moves = []
    own_bytes = 0
    rest: _Moves = []
    for d, s, n in sorted(moves, key=lambda m: m[2]):
        if n < _SMALL_MOVE and own_bytes + n <= fair:
            own.append((d, s, n))
            own_bytes += n
        else:
            rest.append((d, s, n))
    rest.reverse()  # largest first
    heads, tails = _split_sizes(total - own_bytes, threads, early)
    cut = _cut_moves(rest, heads + tails)
    head = [g for g in [own, *cut[: len(heads)]] if g]
    return CopyJob(head, [g for g in cut[len(heads) :] if g], _copy_share)


def _cut(lengths: Iterable[int], sizes: list[int]) -> Iterator[tuple[int, int, int, int]]:
    """Items of ``lengths`` bytes laid end to end and cut into consecutive groups of ``sizes``
    bytes (the last group takes any rest), no cut longer than ``_MAX_MOVE``: for each cut,
    (group, item, offset in the item, length)."""
    k, room, last_group = 0, sizes[0] if sizes else 0, len(sizes) - 1
    for i, n in enumerate(lengths):
        done = 0
        while done < n:
            last = k == last_group
            take = min(n - done, _MAX_MOVE) if last else min(n - done, room, _MAX_MOVE)
            yield k, i, done, take
            done += take
            room -= take
            if room <= 0 and not last:
                k += 1
                room = sizes[k]


def _cut_moves(moves: _Moves, sizes: list[int]) -> list[_Moves]:
    """``moves`` cut by :func:`_cut` into groups of ``sizes`` bytes (a group may be empty)."""
    groups: list[_Moves] = [[] for _ in sizes]
    for k, i, at, n in _cut([m[2] for m in moves], sizes):
        d, s, _ = moves[i]
        groups[k].append((d + at, s + at, n))
    return groups


_KEPT_SOURCES = 2
"""Source sets whose copy plans a :class:`GatherCopy` keeps."""
_KEPT_DESTINATIONS = 8
"""Destinations whose output ranges a plan keeps, per kind of copy (a sender's slots; more are
rare)."""
_KEPT_HINTS = 4
"""Hints whose last source set a :class:`GatherCopy` (or a plane) remembers."""

V = TypeVar("V")


def remember_hint(table: collections.OrderedDict[Hashable, V], hint: Hashable, value: V) -> None:
    """``table[hint] = value``, keeping only the :data:`_KEPT_HINTS` hints set last."""
    table[hint] = value
    table.move_to_end(hint)
    if len(table) > _KEPT_HINTS:
        table.popitem(last=False)


class GatherCopy:
    """Copies a layout's tensors, given one by one, into its flat buffers.

    A model of many tensors needs one copy per tensor, and each torch copy or ``memmove`` call
    pays a few microseconds of setup and, from Python, a turn of the interpreter lock: for the
    1000-tensor 64 MiB model that made the copy about 2x one flat copy of the same bytes. Here
    the destination is cut instead into a few contiguous byte ranges per thread (threads take
    them from one queue, see :data:`_PIECES_PER_THREAD`), and each range is filled with a
    single ``torch.cat(pieces, out=range)``: torch copies a contiguous
    concatenation with one ``memcpy`` per piece and no per-piece setup, as long as the calling
    thread runs torch single-threaded (see :func:`_gather_pool`). The gaps between tensors
    (alignment padding) are filled from a small zero tensor. Where ``_stream`` copies (see
    :func:`streaming`), each thread's ranges go instead to one ``copy_moves`` call, as
    packed (destination, piece, length) moves, kept with the ranges.

    The pieces are views of the sources, which take about 2 us each to make; they are kept
    (a *plan* per source set) while the same source tensors come back, as a model's do on
    every send, and rebuilt when any source moved. A plan serves every destination (each
    slot of a sender): only its few output ranges are cut per destination, and kept too.
    Plans are kept only for source sets seen before among the last few calls, so weights
    passed once are not kept alive by a plan, and for at most :data:`_KEPT_SOURCES` source
    sets (a sender that alternates its model and one copy of its weights keeps both).

    A caller may name where its sources come from with a *hint* (any hashable: the sender
    passes one for its own model and one per weights object it is given). :meth:`start` then
    guesses the source set that the last call with the same hint copied, so a sender that
    alternates two sources still gets its copy started early.
    """

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._plans: dict[tuple[int, ...], _Plan] = {}
        """Kept plans by source pointers."""
        self._kept: list[tuple[int, ...]] = []
        """Source pointers whose plans are kept, oldest first."""
        self._recent: collections.deque[tuple[int, ...]] = collections.deque(maxlen=4)
        """Source pointers of the last calls (no reference to the tensors is held)."""
        self._last: tuple[int, ...] | None = None
        """Source pointers of the last call that copied (what :meth:`start` copies again)."""
        self._repeated = False
        """The last call copied the same sources as the one before: without a hint,
        :meth:`start` guesses that the next one will too (a sender alternating two source
        sets would otherwise start, and throw away, a copy of the wrong one at every call)."""
        self._hinted: collections.OrderedDict[Hashable, tuple[int, ...]] = collections.OrderedDict()
        """Source pointers of the last call with each hint (the last few hints)."""
        self._zeros = torch.zeros(layout.alignment, dtype=torch.uint8)
        # Lazy conjugate and negative views exist only for complex tensors (sources match the
        # layout's dtypes), so only complex layouts pay for that check on every call.
        self._lazy_views = any(spec.dtype.is_complex for spec in layout.specs)
        self._early = early_share(len(layout.specs), layout.total_bytes)
        """How the copies that :meth:`start` begins are cut (see :func:`_split_sizes`)."""

    def start(self, dst: Sequence[torch.Tensor], hint: Hashable = None) -> EarlyCopy | None:
        """Start copying a source set seen before into ``dst``, in helper threads, before the
        caller has checked that the next sources are those tensors: the set last copied with
        ``hint`` or, for a hint not seen lately, the last call's set if the two calls before
        copied the same one. None when there is nothing to start (no such set, or no plan
        kept for it). The result must be passed to :meth:`copy` (which finishes or abandons
        it) or abandoned."""
        key = self._hinted.get(hint) if hint is not None else None
        if key is None and self._repeated:
            key = self._last
        plan = self._plans.get(key) if key is not None else None
        pool = _gather_pool()
        if plan is None or key is None or pool is None:
            return None
        if len(dst) != len(self.layout.buffer_sizes):
            raise ValueError(f"expected {len(self.layout.buffer_sizes)} buffers, got {len(dst)}")
        job = plan.job(dst, early=self._early)
        job.start(pool.executor, settle=_SETTLE_S)
        return EarlyCopy(job, key)

    def copy(
        self,
        dst: Sequence[torch.Tensor],
        src: Sequence[torch.Tensor],
        *,
        keep: bool = False,
        early: EarlyCopy | None = None,
        hint: Hashable = None,
    ) -> bool:
        """Copy ``src`` (one tensor per layout key, in layout order, already checked against
        the layout) into the byte buffers ``dst``. Returns False, having copied nothing, when
        this way does not apply: a small model, sources that are not plain contiguous CPU
        tensors, or no single-threaded torch threads on this platform.

        ``keep`` says the sources will come back (a model's own tensors): their plan is kept
        from this first call on. ``early``, from :meth:`start` with the same ``dst``, is
        finished when ``src`` are the tensors it copies, else abandoned (and ``src`` copied
        as usual); either way, no helper thread writes into ``dst`` once this returns.
        ``hint``: where ``src`` comes from (see :meth:`start`)."""
        try:
            return self._copy(dst, src, keep, early, hint)
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
        hint: Hashable,
    ) -> bool:
        pool = _gather_pool()
        if (
            pool is None
            or self.layout.total_bytes < _PARALLEL_COPY_BYTES
            or len(src) != len(self.layout.specs)
            or not _all_plain(src, self._lazy_views)
        ):
            if early is not None:
                early.job.abandon()
            return False
        if len(dst) != len(self.layout.buffer_sizes):
            raise ValueError(f"expected {len(self.layout.buffer_sizes)} buffers, got {len(dst)}")
        key = tuple(map(_data_ptr, src))
        if early is not None and early.key == key and key in self._plans:
            job = early.job
        else:
            if early is not None:
                early.job.abandon()
            plan = self._plans.get(key)
            if plan is None:
                if not all(t.is_cpu for t in src):
                    return False
                try:
                    plan = self._plan(src, pool.threads)
                except RuntimeError:
                    return False  # a source torch cannot view as bytes (a lazy negation)
                if keep or key in self._kept or key in self._recent:
                    self._keep(key, plan)
            job = plan.job(dst)
            job.start(pool.executor)
        if not self._recent or self._recent[-1] != key:
            self._recent.append(key)
        self._repeated, self._last = key == self._last, key
        if hint is not None:
            remember_hint(self._hinted, hint, key)
        with _serial_torch(pool):
            job.finish()
        return True

    def _keep(self, key: tuple[int, ...], plan: _Plan) -> None:
        if key not in self._kept:
            self._kept.append(key)
            if len(self._kept) > _KEPT_SOURCES:
                self._plans.pop(self._kept.pop(0), None)
        self._plans[key] = plan

    def clear(self) -> None:
        """Drop every plan (and with them the views of sources and destinations they hold)."""
        self._plans.clear()
        self._kept.clear()
        self._recent.clear()
        self._hinted.clear()
        self._last, self._repeated = None, False

    def _plan(self, src: Sequence[torch.Tensor], threads: int) -> _Plan:
        layout = self.layout
        # (buffer, start, piece): the bytes of every buffer up to its last tensor, in order.
        segments: list[tuple[int, int, torch.Tensor]] = []
        ends = [0] * len(layout.buffer_sizes)
        with torch.no_grad():
            for spec, t in zip(layout.specs, src, strict=True):
                if t.nbytes != spec.nbytes:
                    raise ValueError(f"{spec.key}: {t.nbytes} bytes, the layout has {spec.nbytes}")
                if not spec.nbytes:
                    continue
                b, end = spec.buffer, ends[spec.buffer]
                if spec.offset > end:
                    segments.append((b, end, self._zeros[: spec.offset - end]))
                segments.append((b, spec.offset, byte_view(t)))
                ends[b] = spec.offset + spec.nbytes
        return _Plan(segments, sum(ends), threads)


@dataclass(frozen=True, slots=True)
class EarlyCopy:
    """A copy :meth:`GatherCopy.start` began before its sources were checked."""

    job: _GatherJob
    key: tuple[int, ...]
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
    _Packed: TypeAlias = array.array[int]
    """One thread's work as packed (dst, src, nbytes) moves, for :func:`_copy_packed`."""
    _GatherJob: TypeAlias = CopyJob[_Share] | CopyJob[_Packed]


class _Plan:
    """The pieces of one source set, cut into the head's pieces and the helpers' tails of a
    :class:`CopyJob` (one cut for copies started after the check, one for those started
    before it), and their output ranges per destination (by the destination buffers'
    pointers; a sender has a few slots, each met again and again)."""

    def __init__(self, segments: list[tuple[int, int, torch.Tensor]], total: int, threads: int):
        self._segments = segments
        """(buffer, start, piece): the bytes of every buffer up to its last tensor, in order."""
        self._total = total
        self._threads = threads
        self._cuts: dict[float, tuple[list[list[_Run]], list[list[_Run]]]] = {}
        self._destinations: dict[tuple[float, tuple[int, ...]], _Outputs] = {}
        """Output ranges per (cut, destination pointers)."""

    def _groups(self, early: float) -> tuple[list[list[_Run]], list[list[_Run]]]:
        cut = self._cuts.get(early)
        if cut is not None:
            return cut
        heads, tails = _split_sizes(self._total, self._threads, early)
        segments = self._segments
        groups: list[list[_Run]] = [[] for _ in heads + tails]
        for k, i, done, take in _cut([p.numel() for _, _, p in segments], heads + tails):
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
        cut = ([g for g in groups[: len(heads)] if g], [g for g in groups[len(heads) :] if g])
        self._cuts[early] = cut
        return cut

    def job(self, dst: Sequence[torch.Tensor], early: float = 0.0) -> _GatherJob:
        """A job (not started) that fills ``dst``; ``early``: started before the check (see
        :func:`_split_sizes`)."""
        key = (early, tuple(map(_data_ptr, dst)))
        out = self._destinations.get(key)
        if out is None:
            if len(self._destinations) >= _KEPT_DESTINATIONS:
                self._destinations.clear()

            def outputs(groups: list[list[_Run]]) -> list[_Share]:
                return [[(r.pieces, dst[r.buffer][r.start : r.end]) for r in g] for g in groups]

            head, tails = self._groups(early)
            out = self._destinations[key] = _Outputs(outputs(head), outputs(tails))
        if streaming():
            if out.packed is None:
                out.packed = (
                    [_share_moves(s) for s in out.head],
                    [_share_moves(s) for s in out.tails],
                )
            return CopyJob(out.packed[0], out.packed[1], _copy_packed)
        return CopyJob(out.head, out.tails, _gather_share)


@dataclass(slots=True, eq=False)
class _Outputs:
    """A plan's shares for one destination: the head's and the tails', and the same as
    packed moves once a non-temporal copy asked for them (their addresses stay valid while
    the shares hold the views)."""

    head: list[_Share]
    tails: list[_Share]
    packed: tuple[list[_Packed], list[_Packed]] | None = None


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a flat uint8 view. (``reshape(-1)`` keeps the odd
    stride that torch allows on a dimension of size one, which ``view`` then refuses.)"""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def _gather_share(share: _Share) -> None:
    for pieces, out in share:
        torch.cat(pieces, out=out)


def _share_moves(share: _Share) -> _Packed:
    """The memmoves that fill ``share``'s output ranges with their pieces, packed."""
    moves = []
    for pieces, out in share:
        at = out.data_ptr()
        for piece in pieces:
            n = piece.numel()
            moves.append((at, piece.data_ptr(), n))
            at += n
    return pack_moves(moves)


def _copy_packed(moves: _Packed) -> None:
    assert _stream is not None
    _stream.copy_moves(moves)


_data_ptr = torch.Tensor.data_ptr
_size = torch.Tensor.size
_get_dtype = operator.attrgetter("dtype")
_is_contiguous = torch.Tensor.is_contiguous


def _all_plain(tensors: Sequence[torch.Tensor], lazy_views: bool = True) -> bool:
    """Contiguous, and their memory holds their values (no lazy conjugate or negation)."""
    return all(map(_is_contiguous, tensors)) and not (
        lazy_views
        and (any(map(torch.Tensor.is_conj, tensors)) or any(map(torch.Tensor.is_neg, tensors)))
    )


@dataclass(frozen=True, slots=True)
class _GatherPool:
    executor: ThreadPoolExecutor
    threads: int
    set_threads: Callable[[int], None]
    get_threads: Callable[[], int]


@contextlib.contextmanager
def _serial_torch(pool: _GatherPool) -> Iterator[None]:
    """Run torch single-threaded in this thread for the duration (OpenMP's thread count is a
    per-thread setting: nothing else is affected); restored afterwards."""
    torch.get_num_threads()  # torch's own first-use setting must come before ours
    before = pool.get_threads()
    pool.set_threads(1)
    try:
        yield
    finally:
        pool.set_threads(before)


_gather: _GatherPool | None = None
_gather_checked = False


def _gather_pool() -> _GatherPool | None:
    """Threads in which torch runs single-threaded, or None where that cannot be arranged.

    ``torch.cat`` takes its one-``memcpy``-per-piece path only when torch would not split the
    work over OpenMP threads. OpenMP's thread count is a per-thread setting, so these threads
    (ours alone) set it to 1 with ``omp_set_num_threads`` and nothing else in the process is
    affected. Without torch's OpenMP runtime (another parallel backend, another platform) the
    callers fall back to :func:`fused_copy`.
    """
    global _gather, _gather_checked
    if _gather_checked:
        return _gather
    with _copy_pool_lock:
        if not _gather_checked:
            omp = _omp_functions()
            if omp is not None:
                count = max(1, min(4, torch.get_num_threads()))
                # The calling thread copies one share itself.
                executor = ThreadPoolExecutor(
                    max_workers=max(1, count - 1),
                    thread_name_prefix=_GATHER_THREADS,
                    initializer=_serial_torch_thread,
                    initargs=(omp[0],),
                )
                if executor.submit(torch.get_num_threads).result() == 1:
                    _gather = _GatherPool(executor, count, *omp)
                else:
                    executor.shutdown(wait=False)
            _gather_checked = True
    return _gather


def _serial_torch_thread(setter: Callable[[int], None]) -> None:
    torch.get_num_threads()  # torch sets this thread's OpenMP thread count on first use ...
    setter(1)  # ... so ours comes after it and sticks
    torch.set_grad_enabled(False)


def _omp_functions() -> tuple[Callable[[int], None], Callable[[], int]] | None:
    """``omp_set_num_threads`` and ``omp_get_max_threads`` of the OpenMP runtime torch uses,
    if torch uses one."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    candidates: list[str | None] = []
    with contextlib.suppress(OSError), open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rsplit(" ", 1)[-1].strip()
            name = os.path.basename(path)
            if name.startswith(("libgomp", "libiomp")) and path not in candidates:
                candidates.append(path)
    candidates.append(None)  # whatever the process exports
    for candidate in candidates:
        try:
            lib = ctypes.CDLL(candidate)
            set_threads, get_threads = lib.omp_set_num_threads, lib.omp_get_max_threads
        except (OSError, AttributeError):
            continue
        set_threads.argtypes, set_threads.restype = [ctypes.c_int], None
        get_threads.argtypes, get_threads.restype = [], ctypes.c_int
        return set_threads, get_threads
    return None


def _forget_pools_in_child() -> None:
    # A forked child has none of the parent's threads, and a lock one of them held stays held.
    global _copy_pool, _copy_pool_lock, _gather, _gather_checked
    _copy_pool, _gather, _gather_checked = None, None, False
    _copy_pool_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)


def bind_views(targets: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]) -> None:
    """Make every target tensor (a module's parameters and buffers) use the matching view.

    The tensor objects keep their identity (optimizers and hooks keep working); only their
    storage changes. Nothing is copied. (Assigning ``.data`` is allowed in any grad mode.)
    """
    for key, t in targets.items():
        t.data = views[key]


def module_targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter and buffer of ``module`` under its dotted key.

    A tensor reachable under several names (tied weights) appears once, under its first name;
    rebinding that one tensor object rebinds every alias.
    """
    out: dict[str, torch.Tensor] = dict(module.named_parameters())
    out.update(module.named_buffers())
    return out


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def rehome(module: nn.Module, layout: Layout) -> list[torch.Tensor]:
    """Move every parameter and buffer of ``module`` into fresh flat buffers of ``layout``.

    Afterwards each tensor of the module is a view of the returned buffers, so a snapshot of the
    whole model is one ``copy_`` per buffer. Tensor objects keep their identity, so an optimizer
    built earlier keeps working. The buffers live on the module's device.
    """
    targets = module_targets(module)
    layout.check(targets)
    if _overlapping(targets.values()):
        # Two tensors sharing memory (a buffer viewing a parameter) would each get a slice of
        # their own, and an update to one would no longer show in the other.
        raise ValueError("some of the module's tensors share memory; they cannot be re-homed")
    devices = {t.device for t in targets.values()}
    if len(devices) > 1:
        raise ValueError(f"cannot re-home a module spread over several devices: {devices}")
    device = devices.pop() if devices else torch.device("cpu")
    buffers = layout.allocate(device)
    views = layout.views(buffers)
    layout.pack(targets, views)
    bind_views(targets, views)
    return buffers


def _overlapping(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether the memory of any two of ``tensors`` overlaps (views of one buffer that do not
    overlap, as a re-homed model's are, are fine)."""
    spans = []
    for t in tensors:
        if not t.nbytes:
            continue
        if t.is_contiguous():
            start = t.data_ptr()
            spans.append((start, start + t.nbytes))
        else:  # its exact extent takes more work than it is worth: the whole storage
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    spans.sort()
    # Sorted by start, any overlap shows between neighbours.
    return any(b[0] < a[1] for a, b in itertools.pairwise(spans))


def is_homed(targets: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]) -> bool:
    """True while every target tensor still is exactly its view (same memory, shape, strides)."""
    for key, t in targets.items():
        v = views.get(key)
        if v is None or t.data_ptr() != v.data_ptr() or t.shape != v.shape:
            return False
    return len(targets) == len(views)
