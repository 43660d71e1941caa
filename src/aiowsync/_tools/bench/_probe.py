"""Measurements a benchmark process takes of itself: how responsive its event loop (or its
interpreter, for a process without one) stays, and how much private memory it holds."""

from __future__ import annotations

import asyncio
import ctypes
import os
import re
import threading
import time
from collections.abc import Callable

__all__ = [
    "ThreadTicker",
    "Ticker",
    "host_steal_ms",
    "malloc_trim",
    "private_memory",
    "runnable_tasks",
    "wait_quiet",
]


def host_steal_ms() -> float:
    """CPU time the hypervisor has taken from this virtual machine so far (``/proc/stat``
    steal, all CPUs, counted in clock ticks), in ms; 0.0 where Linux does not say."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) * 1000 / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def runnable_tasks() -> int | None:
    """Tasks of the whole machine that are running or ready to run right now, the caller
    included (the fourth field of ``/proc/loadavg``); None where Linux does not say."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


QUIET_READS = 3
"""Consecutive reads, :data:`QUIET_STEP_S` apart, that must find no task but the reader's
for the machine to count as quiet."""
QUIET_STEP_S = 0.001
QUIET_MOST_S = 0.5
"""The longest :func:`wait_quiet` waits."""
QUIET_AGAIN_S = 0.05
"""The longest it waits right after a wait that gave up: a machine that some other program
keeps busy for good would otherwise cost :data:`QUIET_MOST_S` per sample."""


async def wait_quiet(
    most: float = QUIET_MOST_S, *, read: Callable[[], int | None] = runnable_tasks
) -> tuple[float, bool]:
    """Wait until no task of the machine but this one is running or ready to run, in
    :data:`QUIET_READS` reads in a row, or until ``most`` seconds have passed. Returns the
    seconds waited and whether the machine was found quiet (always True where Linux does not
    say how many tasks are runnable). ``read`` counts the runnable tasks (a test gives its own
    readings)."""
    start = time.perf_counter()
    streak = 0
    while True:
        count = read()
        if count is None:
            return 0.0, True
        streak = streak + 1 if count <= 1 else 0
        waited = time.perf_counter() - start
        if streak >= QUIET_READS:
            return waited, True
        if waited >= most:
            return waited, False
        await asyncio.sleep(QUIET_STEP_S)


class Ticker:
    """Sleeps ``period`` seconds in a loop on an event loop and records the longest interval
    between two wake-ups."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.max_gap = 0.0
        self.max_at = 0.0
        self.ticks = 0

    async def run(self) -> None:
        clock = time.perf_counter
        last = clock()
        while True:
            await asyncio.sleep(self.period)
            now = clock()
            gap = now - last
            last = now
            self.ticks += 1
            if gap > self.max_gap:
                self.max_gap, self.max_at = gap, now

    def mark(self) -> tuple[float, int, float]:
        """The longest gap, the tick count and when that gap ended (``time.perf_counter()``,
        the system-wide monotonic clock on Linux) since the last mark (all reset)."""
        out = (self.max_gap, self.ticks, self.max_at)
        self.max_gap, self.ticks, self.max_at = 0.0, 0, 0.0
        return out


class ThreadTicker:
    """The same probe in a daemon thread, for processes whose work is done by threads (TorchRL's
    workers): the longest time the interpreter kept this thread from waking up."""

    def __init__(self, period: float = 0.001) -> None:
        self.period = period
        self.max_gap = 0.0
        self._running = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-ticker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        clock = time.perf_counter
        while not self._stop.is_set():
            if not self._running.wait(0.1):
                continue
            last = clock()
            while self._running.is_set() and not self._stop.is_set():
                time.sleep(self.period)
                now = clock()
                self.max_gap = max(self.max_gap, now - last)
                last = now

    def start(self) -> None:
        self.max_gap = 0.0
        self._running.set()

    def mark(self) -> float:
        out, self.max_gap = self.max_gap, 0.0
        return out

    def stop(self) -> None:
        self._running.clear()

    def close(self) -> None:
        self._stop.set()
        self._running.clear()
        self._thread.join(1.0)


_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")
SHM_PREFIX = "/dev/shm/aiowsync"


def private_memory(pid: int | str = "self") -> dict[str, int]:
    """Private (unshared) memory of a process in KiB.

    ``private_kb``: Private_Clean + Private_Dirty from ``smaps_rollup``; ``shm_kb``: the
    Private_* of mappings of aiowsync slot files (``/dev/shm/aiowsync*``), which count as private
    only when no other process maps those pages; ``own_kb``: the difference, memory that is
    really the process's own.
    """
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    shm = 0
    path = ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if _MAPPING.match(line):
                parts = line.split(maxsplit=5)
                path = parts[5].strip() if len(parts) > 5 else ""
            elif path.startswith(SHM_PREFIX) and line.startswith(
                ("Private_Clean:", "Private_Dirty:")
            ):
                shm += int(line.split()[1])
    return {"private_kb": total, "shm_kb": shm, "own_kb": total - shm}


def malloc_trim() -> bool:
    """Ask glibc to hand freed heap memory back to the kernel (diagnostic only)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
