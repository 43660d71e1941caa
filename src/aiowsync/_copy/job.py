"""A copy spread over threads: :class:`CopyJob`, and how a copy is cut into its pieces.

The calling thread and a few helper threads share a copy. Each helper first copies its *tail*
(a part given to it alone, at the end of the destination, taken as one call), then, like the
calling thread, takes pieces of the *head* from one queue until none is left. Pieces taken as
threads come free keep a slow thread (the last one to wake, or one that another process
preempted) from holding up the whole copy, as equal fixed shares would. A tail whose helper has
not begun by the time the calling thread runs out of pieces is copied by the calling thread,
which then waits only for the helpers that took work: a helper kept off every CPU (another
process busy on the CPU it was woken on) delays nothing it had not begun.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from .steer import unsteer

__all__ = [
    "EARLY_TAILS",
    "MAX_MOVE",
    "PIECES_PER_THREAD",
    "SETTLE_S",
    "SMALL_MOVE",
    "TAIL",
    "CopyJob",
    "Moves",
    "cut",
    "cut_moves",
    "early_share",
    "split_sizes",
]

SETTLE_S = 0.002
"""How long a copy started ahead of a check waits for its first helper to begin."""

SMALL_MOVE = 256 * 1024
"""Moves below this size are small: the calling thread takes them, and no piece is smaller."""

MAX_MOVE = 64 * 1024 * 1024
"""No single memmove is longer: glibc copies much longer ones with its own non-temporal stores,
which held the memory bus long enough to stall other processes' event loops during large sends;
``aiowsync._copy._stream`` keeps to the same length."""

PIECES_PER_THREAD = 8
"""The head of a copy is cut into about this many pieces per thread, so that threads which come
free early take the work of one that is late."""

TAIL = 0.8
"""The part of its fair share that each helper copies first, as its tail: the end of the
destination, while the calling thread may still be checking the source."""

EARLY_TAILS = 0.55
"""At most this part of a copy started before the caller's check goes to the helpers' tails,
all together. While the caller checks (its Python holds the interpreter lock), a helper can copy
only its tail, so the tail should outlast the check yet leave the caller a part as long as the
rest of the helper's: with a check of ``c`` seconds and ``t`` seconds for one thread to copy
everything, ``c / t <= share <= (1 + c / t) / 2``. This value meets both bounds for a model's
own tensors and for a ``TensorDict`` of as many leaves, the slowest check there is."""

CHECK_S_PER_TENSOR = 4.5e-6
"""The most a check was seen to cost per tensor, beside a running copy (a ``TensorDict``)."""

COPY_BYTES_PER_S = 10e9
"""A rough rate of one thread's copy between large buffers, for :func:`early_share` only."""

W = TypeVar("W")


def early_share(tensors: int, nbytes: int) -> float:
    """For a copy of ``nbytes`` bytes started before a check of ``tensors`` tensors: the
    expected ``c / t`` of :data:`EARLY_TAILS`, the check's cost over one thread's copy, from
    the worst cost per tensor seen. Below the usual tail share, the copy is cut as usual, so a
    few large tensors (checked at once) do not leave the caller waiting for an outsized tail."""
    if nbytes <= 0:
        return 0.0
    return tensors * CHECK_S_PER_TENSOR * COPY_BYTES_PER_S / nbytes


class CopyJob(Generic[W]):
    """A copy spread over the calling thread and a few helper threads.

    ``run`` copies one piece (of type ``W``); ``head`` is shared through one queue, each of
    ``tails`` goes to one helper. A job can be started before the caller knows that its source
    is still the right one, since checking a model's many tensors is slow cold Python that the
    helpers can spend copying. The caller then either :meth:`finish`-es the job or
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
        self._lock = threading.Condition(threading.Lock())
        self._claimed = [False] * len(tails)
        """Each tail is copied once, by its helper or, if that has not begun, by the caller."""
        self._busy = 0
        """Helpers copying a piece or a tail now."""
        self._closed = False
        """The caller is done: helpers that begin from now on take nothing."""
        self._errors: list[BaseException] = []

    def start(
        self,
        executor: ThreadPoolExecutor,
        *,
        settle: float = 0.0,
        steer: Callable[[], set[int] | None] | None = None,
    ) -> None:
        """Set the helpers going (one per tail). ``settle``: give the first helper up to that
        many seconds to begin its tail, since a caller about to run Python holds the
        interpreter lock that a helper needs to begin at all; meanwhile the caller copies
        pieces of the head, which frees that lock in each copy call, rather than leave its CPU
        idle. ``steer``: called just before the helpers are woken; the CPU set it returns is
        restored in each helper as it runs (see :class:`aiowsync._copy.steer.HelperSteering`).
        """
        if self._tails and steer is not None:
            self._cpus = steer()
        for i in range(len(self._tails)):
            try:
                self._futures.append(executor.submit(self._help, i))
            except RuntimeError:
                # The pool was shut down by its owner closing while this copy was under way
                # (a plane closing mid-send): the caller copies the tails left itself.
                break
        if settle > 0 and self._futures:
            try:
                self._settle(time.monotonic() + settle)
            except BaseException:
                self.abandon()
                raise

    def _settle(self, until: float) -> None:
        """Copy pieces of the head here until a helper has begun or ``until`` (monotonic)
        has come, then wait for the rest of that time if none has begun and no piece is left.

        A helper woken on a CPU that another process keeps busy may take milliseconds to
        begin; the caller's pieces are the ones it would copy after its check anyway.
        """
        while not self._begun.is_set():
            left = until - time.monotonic()
            if left <= 0:
                return
            with self._lock:
                i = next(self._taken) if not self._stopped else len(self._head)
            if i >= len(self._head):
                self._begun.wait(left)
                return
            self._run(self._head[i])

    def _claim(self, tail: int | None) -> W | None:
        """Tail ``tail`` (None: the head's next piece), if it is still to be copied; a helper
        that gets one is busy until it calls :meth:`_release`."""
        with self._lock:
            if self._closed or self._stopped:
                return None
            if tail is not None:
                if self._claimed[tail]:
                    return None
                self._claimed[tail] = True
                self._busy += 1
                return self._tails[tail]
            # ``next`` under the lock: each piece is taken once.
            i = next(self._taken)
            if i >= len(self._head):
                return None
            self._busy += 1
            return self._head[i]

    def _release(self, error: BaseException | None = None) -> None:
        with self._lock:
            self._busy -= 1
            if error is not None:
                self._errors.append(error)
            self._lock.notify_all()

    def _help(self, tail: int) -> None:
        if self._cpus is not None:
            unsteer(self._cpus)
        self._begun.set()
        for item in itertools.chain([self._claim(tail)], iter(lambda: self._claim(None), None)):
            if item is None:
                continue
            try:
                self._run(item)
            except BaseException as exc:
                self._release(exc)
                return
            self._release()

    def _drain_here(self) -> None:
        """The caller's share: pieces of the head, then every tail no helper has begun."""
        while True:
            with self._lock:
                if self._stopped:
                    return
                i = next(self._taken)
            if i >= len(self._head):
                break
            self._run(self._head[i])
        for t in range(len(self._tails)):
            with self._lock:
                if self._stopped or self._claimed[t]:
                    continue
                self._claimed[t] = True
            self._run(self._tails[t])

    def finish(self) -> None:
        """Copy the head's pieces alongside the helpers, and the tails they have not begun,
        then wait for the helpers that took work (a helper's error is raised here)."""
        try:
            self._drain_here()
        finally:
            self._wait()

    def abandon(self) -> None:
        """Stop taking pieces and wait for the helpers; what they copied is to be overwritten,
        so their errors are dropped."""
        self._stopped = True
        with contextlib.suppress(Exception):
            self._wait()

    def _wait(self) -> None:
        with self._lock:
            self._closed = True
            while self._busy:
                self._lock.wait()
            errors = self._errors
        if errors:
            raise errors[0]


def split_sizes(total: int, threads: int, early: float = 0.0) -> tuple[list[int], list[int]]:
    """Byte counts of the head's pieces and of the helpers' tails for a copy of ``total``
    bytes over ``threads`` threads: the tails come last in the destination, in this order.
    ``early``: for a copy started before the caller's check, the check's expected cost over
    one thread's copy (:func:`early_share`); the tails take that part of the bytes, if it is
    more than usual, up to :data:`EARLY_TAILS`."""
    helpers = threads - 1
    fair = total // threads
    share = int(fair * TAIL)
    if early > 0 and helpers:
        share = max(share, int(total * min(early, EARLY_TAILS)) // helpers)
    tail = share if helpers and fair >= 2 * SMALL_MOVE else 0
    head = total - helpers * tail
    count = max(1, min(threads * PIECES_PER_THREAD, head // SMALL_MOVE))
    piece = -(-head // count)
    heads = [min(piece, head - start) for start in range(0, head, piece)] if head else []
    return heads, [tail] * helpers if tail else []


def cut(lengths: Iterable[int], sizes: list[int]) -> Iterator[tuple[int, int, int, int]]:
    """Items of ``lengths`` bytes laid end to end and cut into consecutive groups of ``sizes``
    bytes (the last group takes any rest), no cut longer than :data:`MAX_MOVE`: for each cut,
    (group, item, offset in the item, length)."""
    k, room, last_group = 0, sizes[0] if sizes else 0, len(sizes) - 1
    for i, n in enumerate(lengths):
        done = 0
        while done < n:
            last = k == last_group
            take = min(n - done, MAX_MOVE) if last else min(n - done, room, MAX_MOVE)
            yield k, i, done, take
            done += take
            room -= take
            if room <= 0 and not last:
                k += 1
                room = sizes[k]


Moves = list[tuple[int, int, int]]
"""(dst, src, nbytes) memmoves."""


def cut_moves(moves: Moves, sizes: list[int]) -> list[Moves]:
    """``moves`` cut by :func:`cut` into groups of ``sizes`` bytes (a group may be empty)."""
    groups: list[Moves] = [[] for _ in sizes]
    for k, i, at, n in cut([m[2] for m in moves], sizes):
        d, s, _ = moves[i]
        groups[k].append((d + at, s + at, n))
    return groups
