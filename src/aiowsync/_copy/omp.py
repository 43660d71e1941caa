"""Threads in which torch runs single-threaded, through the OpenMP runtime torch uses.

``torch.cat`` takes its one-``memcpy``-per-piece path only when torch would not split the work
over OpenMP threads. OpenMP's thread count is a per-thread setting, so the gather threads (ours
alone) set it to 1 with ``omp_set_num_threads`` and nothing else in the process is affected.
Without torch's OpenMP runtime (another parallel backend, another platform) there is no such
pool, and callers fall back to plain fused copies.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

__all__ = ["GatherPool", "serial_torch", "start_gather_pool"]


@dataclass(frozen=True, slots=True)
class GatherPool:
    """Helper threads that run torch single-threaded, and the OpenMP calls that set it."""

    executor: ThreadPoolExecutor
    threads: int
    """Threads that share a copy, the calling one included."""
    set_threads: Callable[[int], None]
    get_threads: Callable[[], int]


def start_gather_pool(threads: int, name: str) -> GatherPool | None:
    """A pool for copies over ``threads`` threads (the caller copies one share itself, so it
    starts one fewer), its threads named ``name``; None where torch does not use OpenMP or the
    setting does not take."""
    omp = _omp_functions()
    if omp is None:
        return None
    executor = ThreadPoolExecutor(
        max_workers=max(1, threads - 1),
        thread_name_prefix=name,
        initializer=_serial_torch_thread,
        initargs=(omp[0],),
    )
    if executor.submit(torch.get_num_threads).result() != 1:
        executor.shutdown(wait=False)
        return None
    return GatherPool(executor, threads, *omp)


@contextlib.contextmanager
def serial_torch(pool: GatherPool) -> Iterator[None]:
    """Run torch single-threaded in this thread for the duration (OpenMP's thread count is a
    per-thread setting: nothing else is affected); restored afterwards."""
    torch.get_num_threads()  # torch's own first-use setting must come before ours
    before = pool.get_threads()
    pool.set_threads(1)
    try:
        yield
    finally:
        pool.set_threads(before)


def _serial_torch_thread(setter: Callable[[int], None]) -> None:
    torch.get_num_threads()  # torch sets this thread's OpenMP thread count on first use ...
    setter(1)  # ... so ours comes after it and sticks
    torch.set_grad_enabled(False)


@functools.cache
def _omp_functions() -> tuple[Callable[[int], None], Callable[[], int]] | None:
    """``omp_set_num_threads`` and ``omp_get_max_threads`` of the OpenMP runtime torch uses,
    if torch uses one (a forked child keeps the same libraries, so the answer holds there)."""
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
