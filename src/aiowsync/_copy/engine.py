"""The copy engine: plain CPU tensors copied with memmoves or non-temporal stores, spread over a
few helper threads, under a :class:`CopyPolicy`.

Ordinary stores read each destination cache line before overwriting it; the non-temporal stores
of the small C module ``aiowsync._copy._stream`` do not, so they move two bytes over the memory bus
per byte copied instead of three, and leave the copy out of the caches. What these copies write
is read later, mostly by other processes (a sender's slot) or after the next optimizer step (a
receiver's private copy), so little is lost by that. Where the module was not built (no
compiler at install, or not x86-64), the same copies are made with ``memmove``.
"""

from __future__ import annotations

import array
import ctypes
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeAlias

import torch

from .job import SETTLE_S, SMALL_MOVE, CopyJob, Moves, cut_moves, split_sizes
from .omp import GatherPool, start_gather_pool
from .steer import HelperSteering

try:
    from . import _stream
except ImportError:  # built without its C part: plain copies
    _stream = None  # type: ignore[assignment]

if TYPE_CHECKING:
    Packed: TypeAlias = array.array[int]
    """Packed native uint64 (dst, src, nbytes) triples, as ``_stream.copy_moves`` reads them."""

_Run: TypeAlias = Callable[[Moves], None]

__all__ = [
    "MAX_THREADS",
    "PARALLEL_COPY_BYTES",
    "CopyPolicy",
    "byte_view",
    "copy_moves",
    "copy_packed",
    "default_policy",
    "fused_copy",
    "pack_moves",
    "start_copy",
    "streams_available",
]

MAX_THREADS = 4
"""Threads that share one copy, the calling one included: a copy is bound by memory, which a
few threads already keep busy."""

PARALLEL_COPY_BYTES = 4 * 1024 * 1024
"""Copies of fewer bytes run in the calling thread alone: waking helpers would cost more."""

_COPY_THREADS = "aiowsync-copy"
_GATHER_THREADS = "aiowsync-gather"
_numbers = itertools.count(1)
"""Numbers the policies, so that each steers only its own helper threads (named after it)."""


def streams_available() -> bool:
    """Whether ``aiowsync._copy._stream`` was built and copies with non-temporal stores here."""
    return _stream is not None and bool(_stream.STREAMS)


class CopyPolicy:
    """How copies of weights are made: with non-temporal stores or ordinary ones, and on which
    helper threads.

    Its owner (a data plane) creates one and passes it down to every copy it makes. The copy
    threads and the gather threads start at first use and :meth:`close` releases them (a copy
    made after that starts new ones). A forked child never uses its parent's threads, which it
    does not have: its policies start new ones.

    ``streaming``: copy with the non-temporal stores of ``aiowsync._copy._stream``. By default they
    are used where that module was built and streams, unless the environment sets
    ``AIOWSYNC_STREAM=0`` (read when the policy is created). Asking for them where they are
    not available raises ``RuntimeError``.
    """

    def __init__(self, *, streaming: bool | None = None) -> None:
        if streaming is None:
            streaming = streams_available() and os.environ.get("AIOWSYNC_STREAM") != "0"
        elif streaming and not streams_available():
            raise RuntimeError(
                "non-temporal copies are not available: aiowsync._copy._stream was not built"
            )
        self._streaming = streaming
        number = next(_numbers)
        self._copy_name = f"{_COPY_THREADS}-{number}"
        self._gather_name = f"{_GATHER_THREADS}-{number}"
        # ThreadPoolExecutor names its threads "<prefix>_<n>".
        self._steering = HelperSteering((f"{self._copy_name}_", f"{self._gather_name}_"))
        self._forget()
        _live.add(self)

    def _forget(self) -> None:
        """Drop the threads without stopping them (in a forked child, which has none of them;
        a lock that one of them held stays held there, so the lock is new too)."""
        self._lock = threading.Lock()
        self._copy_pool: ThreadPoolExecutor | None = None
        self._gather: GatherPool | None = None
        self._gather_checked = False
        self._closed = False

    @property
    def streaming(self) -> bool:
        """Whether copies use non-temporal stores."""
        return self._streaming

    def copy_executor(self) -> ThreadPoolExecutor:
        """The helper threads of memmove copies (started at first use)."""
        with self._lock:
            if self._closed:
                return _SHUT  # a copy under way as its owner closes runs in its own thread
            if self._copy_pool is None:
                self._copy_pool = ThreadPoolExecutor(
                    max_workers=MAX_THREADS - 1, thread_name_prefix=self._copy_name
                )
            return self._copy_pool

    def gather_pool(self) -> GatherPool | None:
        """The helper threads of gather copies, in which torch runs single-threaded; None
        where that cannot be arranged (see :mod:`aiowsync._copy.omp`)."""
        if self._gather_checked:
            return self._gather
        with self._lock:
            if self._closed:
                return None
            if not self._gather_checked:
                threads = max(1, min(MAX_THREADS, torch.get_num_threads()))
                self._gather = start_gather_pool(threads, self._gather_name)
                self._gather_checked = True
            return self._gather

    def steer_helpers(self) -> set[int] | None:
        """Keep this policy's helpers off the calling thread's CPU until they run; the CPU set
        they are to take back (see :mod:`aiowsync._copy.steer`)."""
        return self._steering.steer()

    def close(self, *, wait: bool = True) -> None:
        """Stop the helper threads after the copies they run, waiting for them to end unless
        ``wait`` is false (an owner closing on an event loop); idempotent. A copy started
        after this runs in its caller's thread alone."""
        with self._lock:
            self._closed = True
            pools = [self._copy_pool, self._gather.executor if self._gather else None]
            self._copy_pool, self._gather, self._gather_checked = None, None, False
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=wait)

    def __repr__(self) -> str:
        return f"CopyPolicy(streaming={self._streaming})"


_SHUT = ThreadPoolExecutor(max_workers=1)
_SHUT.shutdown()
"""The executor of a closed policy: it takes no work (see :meth:`CopyJob.start`)."""

_live: weakref.WeakSet[CopyPolicy] = weakref.WeakSet()
"""Every policy of this process, for the fork handler."""
_default: CopyPolicy | None = None
_default_lock = threading.Lock()


def default_policy() -> CopyPolicy:
    """The policy of the process's defaults, for callers that pass none: one instance,
    created at first use and never closed."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = CopyPolicy()
    return _default


def _forget_pools_in_child() -> None:
    global _default_lock
    _default_lock = threading.Lock()
    for policy in list(_live):
        policy._forget()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)


def fused_copy(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], policy: CopyPolicy | None = None
) -> None:
    """``dst[i].copy_(src[i])`` for every i, as fast as the device allows.

    On CPU, torch copies a list tensor by tensor and starts an OpenMP parallel region for each
    mid-sized one; with idle OpenMP threads sleeping (``OMP_WAIT_POLICY=PASSIVE``) every region
    pays to wake them, which costs more than the copy for a model of many tensors. Contiguous
    CPU tensors are therefore copied with plain memmoves (see :func:`copy_moves`). Anything
    else takes ``torch._foreach_copy_``.
    """
    if not dst:
        return
    dst, src = list(dst), list(src)
    with torch.no_grad():
        moves, total, others = _moves(dst, src)
        if others:
            torch._foreach_copy_([dst[i] for i in others], [src[i] for i in others])
        if moves:
            _copy_moves(moves, total, policy or default_policy())


def copy_moves(moves: Moves, policy: CopyPolicy | None = None) -> None:
    """Memmoves (dst, src, nbytes): in this thread when they are small in total, else in
    pieces that a few threads take from one queue."""
    _copy_moves(moves, sum(n for _, _, n in moves), policy or default_policy())


def _copy_moves(moves: Moves, total: int, policy: CopyPolicy) -> None:
    if total < PARALLEL_COPY_BYTES:
        _share(policy)(moves)
    else:
        _parallel_copy(moves, total, policy)


def _moves(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]
) -> tuple[Moves, int, list[int]]:
    """The (dst, src, nbytes) memmoves of the pairs that are plain CPU tensors, their bytes,
    and the indices of the other pairs."""
    moves: Moves = []
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


def _memmove_share(moves: Moves) -> None:
    # ctypes releases the GIL around memmove, so shares in several threads copy in parallel.
    move = ctypes.memmove
    for dst, src, n in moves:
        move(dst, src, n)


def _stream_share(moves: Moves) -> None:
    copy_packed(pack_moves(moves))


def _share(policy: CopyPolicy) -> _Run:
    """What copies one thread's share of memmoves under ``policy``."""
    return _stream_share if policy.streaming else _memmove_share


def _copy_share(moves: Moves, policy: CopyPolicy | None = None) -> None:
    """``moves`` in this thread."""
    _share(policy or default_policy())(moves)


def pack_moves(moves: Iterable[tuple[int, int, int]]) -> Packed:
    """``moves`` (dst, src, nbytes) as the packed native uint64 triples ``_stream`` reads."""
    return array.array("Q", itertools.chain.from_iterable(moves))


def copy_packed(moves: Packed) -> None:
    """Packed moves (see :func:`pack_moves`) with non-temporal stores."""
    assert _stream is not None
    _stream.copy_moves(moves)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The bytes of contiguous ``t`` as a flat uint8 view. (``reshape(-1)`` keeps the odd
    stride that torch allows on a dimension of size one, which ``view`` then refuses.)"""
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def start_copy(
    dst: Sequence[torch.Tensor],
    src: Sequence[torch.Tensor],
    early: float = 0.0,
    policy: CopyPolicy | None = None,
) -> CopyJob[Moves] | None:
    """:func:`fused_copy` of large plain CPU tensors, started in helper threads and to be
    finished (or abandoned) by the caller, who checks meanwhile (``early``: see
    :func:`aiowsync._copy.job.split_sizes`); None, having copied nothing, for anything else."""
    moves, total, others = _moves(dst, src)
    if others or total < PARALLEL_COPY_BYTES:
        return None
    policy = policy or default_policy()
    job = _move_job(moves, total, policy, early)
    job.start(policy.copy_executor(), settle=SETTLE_S, steer=policy.steer_helpers)
    return job


def _parallel_copy(moves: Moves, total: int, policy: CopyPolicy | None = None) -> None:
    """``moves`` (dst, src, nbytes) spread over up to :data:`MAX_THREADS` threads, this one
    included."""
    policy = policy or default_policy()
    job = _move_job(moves, total, policy)
    job.start(policy.copy_executor(), steer=policy.steer_helpers)
    job.finish()


def _move_job(moves: Moves, total: int, policy: CopyPolicy, early: float = 0.0) -> CopyJob[Moves]:
    """A :class:`CopyJob` for ``moves`` (not started; ``early``: see ``split_sizes``).

    Every memmove gives up the GIL and must take it back, so threads that each make many
    small moves mostly wait for one another. The calling thread therefore takes the small
    moves first (its first piece of the head), smallest first, up to its fair share of the
    bytes; the other moves are laid end to end and cut into the helpers' tails (from the end)
    and the head's pieces, each cut again into memmoves of at most ``MAX_MOVE`` bytes.
    """
    threads = max(1, min(MAX_THREADS, torch.get_num_threads()))
    fair = max(1, -(-total // threads))
    own: Moves = []
    own_bytes = 0
    rest: Moves = []
    for d, s, n in sorted(moves, key=lambda m: m[2]):
        if n < SMALL_MOVE and own_bytes + n <= fair:
            own.append((d, s, n))
            own_bytes += n
        else:
            rest.append((d, s, n))
    rest.reverse()  # largest first
    heads, tails = split_sizes(total - own_bytes, threads, early)
    cut = cut_moves(rest, heads + tails)
    head = [g for g in [own, *cut[: len(heads)]] if g]
    return CopyJob(head, [g for g in cut[len(heads) :] if g], _share(policy))
