"""Where helper threads run: woken away from the CPU of the thread that wakes them.

A helper woken by a thread that goes on running (the caller copies its own share, or checks the
weights) is placed by Linux on its last CPU, or the waker's, when those look best, even busy,
and waits there for the scheduler's next balancing tick while another CPU idles: the helpers
begin late and the copy takes the caller's time alone. So, just before waking helpers, the
caller takes its own CPU out of their affinity (:meth:`HelperSteering.steer`), and each helper
puts the caller's full set back as soon as it runs (:func:`unsteer`). Only the owner's own
helper threads are touched, only within the caller's CPU set, and only where Linux offers the
calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Callable

from .._util.libc import libc

__all__ = ["HelperSteering", "unsteer"]


class HelperSteering:
    """Steers the helper threads whose names start with one of ``prefixes``; turns itself off
    for good where the calls are refused or this thread's CPU cannot be told."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        self.on = hasattr(os, "sched_setaffinity")
        self._prefixes = prefixes

    def steer(self) -> set[int] | None:
        """Keep the helpers off this thread's CPU until they run; the CPU set they are to get
        back (None: nothing was changed)."""
        if not self.on:
            return None
        getcpu = _sched_getcpu()
        try:
            cpus = os.sched_getaffinity(0)
            here = getcpu() if getcpu is not None else -1
            if here not in cpus:
                self.on = False  # no telling where this thread runs
                return None
            others = cpus - {here}
            if not others:
                return None  # one CPU: nowhere else to go
            for thread in threading.enumerate():
                tid = thread.native_id
                if tid is not None and thread.name.startswith(self._prefixes):
                    with contextlib.suppress(ProcessLookupError):  # it just ended
                        os.sched_setaffinity(tid, others)
        except OSError:
            self.on = False  # not allowed here (a sandbox): leave placement to the kernel
            return None
        return cpus


def unsteer(cpus: set[int]) -> None:
    """In a helper: take back the caller's CPU set."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cpus)


@functools.cache
def _sched_getcpu() -> Callable[[], int] | None:
    lib = libc()
    if lib is None:
        return None
    try:
        getcpu = lib["sched_getcpu"]
    except AttributeError:
        return None
    getcpu.argtypes, getcpu.restype = [], ctypes.c_int
    return getcpu
