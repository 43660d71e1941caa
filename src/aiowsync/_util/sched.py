"""Short time slices for the threads that carry control messages (Linux 6.12 and later).

Under Linux's EEVDF scheduler a thread that wakes on a busy CPU waits, at worst, for the
running thread's slice to end (0.75-3 ms by default, by the number of CPUs). A thread may ask
for a shorter slice with ``sched_setattr`` (``sched_runtime`` under the normal policy, no
privilege needed); the kernel then lets it run sooner when it wakes, without giving it a larger
share of the CPU. The threads that pass an update and its ack along (ZeroMQ's I/O threads, a
receiver's waker, a trainer's loop while it waits for acks) each run for microseconds per
message, so a short slice costs them nothing and saves each hop that wait. Kernels before 6.12
take the call and keep their slice; where the call itself is missing, nothing changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import struct
import threading
from collections.abc import Iterable, Iterator

__all__ = ["SHORT_SLICE_NS", "short_slice_while", "shorten", "shorten_all", "zmq_io_threads"]

SHORT_SLICE_NS = 100_000
"""The slice asked for: 0.1 ms, the least Linux grants."""

_SETATTR, _GETATTR = {"x86_64": (314, 315), "aarch64": (274, 275)}.get(
    platform.machine(), (None, None)
)
_ATTR = struct.Struct("IIQiIQQQII")
"""struct sched_attr: size, policy, flags, nice, priority, runtime, deadline, period, and
the two utilisation clamps."""
_SCHED_OTHER = 0

_libc: ctypes.CDLL | None = None
_lock = threading.Lock()
_held: dict[int, tuple[int, int]] = {}
"""By thread id: how many :func:`short_slice_while` blocks it is in, and the slice it had."""
_default: int | None = None


def _call(number: int | None, *args: object) -> bool:
    global _libc
    if number is None:
        return False
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return False
    return bool(_libc.syscall(number, *args) == 0)


def _get(tid: int) -> tuple[int, int, int] | None:
    """``(policy, nice, runtime)`` of thread ``tid`` (0: the caller), or None."""
    buf = ctypes.create_string_buffer(_ATTR.size)
    if not _call(_GETATTR, tid, buf, _ATTR.size, 0):
        return None
    _, policy, _, nice, _, runtime, *_ = _ATTR.unpack(buf.raw)
    return policy, nice, runtime


def _set(tid: int, nice: int, runtime: int) -> bool:
    attr = ctypes.create_string_buffer(
        _ATTR.pack(_ATTR.size, _SCHED_OTHER, 0, nice, 0, runtime, 0, 0, 0, 0)
    )
    return _call(_SETATTR, tid, attr, 0)


def shorten(tid: int = 0) -> int | None:
    """Give thread ``tid`` (0: the caller) the short slice, keeping its nice value; the
    slice it had, or None where it was left alone (another policy, a shorter slice of its
    own, or no such call here)."""
    got = _get(tid)
    if got is None:
        return None
    policy, nice, runtime = got
    if policy != _SCHED_OTHER or 0 < runtime <= SHORT_SLICE_NS:
        return None
    return runtime if _set(tid, nice, SHORT_SLICE_NS) else None


def _default_slice() -> int:
    """The slice the kernel reports for a thread that never asked for one."""
    global _default
    if _default is None:
        seen: list[int] = []

        def look() -> None:
            got = _get(0)
            seen.append(got[2] if got else 0)

        thread = threading.Thread(target=look, name="aiowsync-slice-probe")
        thread.start()
        thread.join()
        _default = seen[0] if seen else 0
    return _default


@contextlib.contextmanager
def short_slice_while() -> Iterator[None]:
    """The calling thread has the short slice inside the block, and its own slice again after
    the last of the blocks it is in (they nest, across awaits too)."""
    me = threading.get_native_id()
    default = _default_slice()
    with _lock:
        count, before = _held.get(me, (0, 0))
        if count == 0:
            had = shorten()
            before = -1 if had is None else had
        _held[me] = (count + 1, before)
    try:
        yield
    finally:
        with _lock:
            count, before = _held.pop(me)
            if count > 1:
                _held[me] = (count - 1, before)
            elif before >= 0:
                got = _get(0)
                if got is not None:
                    # A slice the kernel chose comes back as "none asked for" (0), so that it
                    # follows the kernel's setting again.
                    _set(0, got[1], 0 if before == default else before)


def zmq_io_threads() -> set[int]:
    """The ids of this process's ZeroMQ I/O threads."""
    found = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{name}/comm") as f:
                if f.read().startswith("ZMQbg/IO"):
                    found.add(int(name))
    return found


def shorten_all(tids: Iterable[int]) -> None:
    for tid in tids:
        shorten(tid)
