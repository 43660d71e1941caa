"""Homes: where each slot file's private mapping waits, page tables and all, while the slot
window shows another file; and what is known of the pages in each.

A page of a private mapping is either the file's own (shared with every process that maps the
file, so it shows what the sender wrote last) or a private copy made when this process wrote
it, or when the kernel filled the mapping for ``mlock``. A copy must never reach the window
at a later version of its file. Every copy is made in a page fault of one of this process's
threads, so a home whose pages were looked at when the process's fault count stood at ``n``
holds none while the count still stands at ``n``. Otherwise its entries in
``/proc/self/pagemap`` are read, and a home holding a copy is mapped anew.

Not seen: writes made into this process's memory by another process (a debugger,
``process_vm_writev``), which fault in that process, and pages placed with userfaultfd
(``UFFDIO_COPY``), which fault nowhere.

A process that locks memory (``mlock``, ``mlockall``) does not move mappings: moving a locked
mapping would count its size as locked once more at each switch, without end.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import resource
import weakref

from aiowsync._exceptions import TransportError

from .mapping import MAP_FIXED, MAP_NORESERVE, Mappings, WrittenPages

__all__ = ["Homes", "faults", "moves_allowed"]

SHOWN = mmap.PROT_READ | mmap.PROT_WRITE
PRIVATE_FILE = mmap.MAP_PRIVATE | MAP_NORESERVE | MAP_FIXED


def faults() -> int:
    """Page faults taken by this process's threads so far (``mlock``'s fills included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def moves_allowed() -> bool:
    """False under strict overcommit (``vm.overcommit_memory=2``), where every home would
    count in full against the commit limit and a move refused for it, after the kernel
    unmapped its target, would leave a hole in the window."""
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/vm/overcommit_memory") as f:
        return int(f.read()) != 2
    return True


class Homes:
    """The homes of one window's slot files, ``size`` bytes each."""

    def __init__(self, calls: Mappings, size: int) -> None:
        self._calls = calls
        self._size = size
        self._written = WrittenPages(size)
        self._status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)
        self._at: dict[str, int] = {}
        self._clean_at: dict[str, int] = {}
        """The fault count when each home was last known to hold no private copy."""
        weakref.finalize(self, _let_go, calls, self._at, size, self._written, self._status)

    def __contains__(self, path: str) -> bool:
        return path in self._at

    def at(self, path: str) -> int:
        return self._at[path]

    def locked(self) -> bool:
        """Whether this process holds locked memory (``VmLck`` above 0; True when unknown)."""
        try:
            status = os.pread(self._status, 8192, 0)
            at = status.index(b"VmLck:")
            return int(status[at + 6 : status.index(b"kB", at)]) > 0
        except (OSError, ValueError):
            return True

    def written(self, addr: int) -> bool:
        """Whether the mapping at ``addr`` holds a private copy."""
        return self._written.any(addr)

    def ready(self, path: str, fd: int) -> int:
        """The home of ``path`` (through ``fd``), made if new, holding none of this process's
        copies: ready to be moved into the window."""
        addr = self._at.get(path)
        if addr is None:
            addr = self._calls.reserve(self._size)
            self._at[path] = addr
            self._clean_at[path] = self._map(addr, fd)
        elif self._clean_at.get(path) != faults():
            self.look(path, fd)
        return addr

    def left(self, path: str, clean_at: int | None) -> None:
        """``path``'s mapping came home from the window; it holds no copy as of fault count
        ``clean_at``, or may hold some (None)."""
        if clean_at is None:
            self._clean_at.pop(path, None)
        else:
            self._clean_at[path] = clean_at

    def unsure(self) -> list[str]:
        return [p for p in self._at if p not in self._clean_at]

    def look(self, path: str, fd: int) -> None:
        """Map ``path``'s home anew if it holds a private copy. ``TransportError`` when it
        cannot be mapped (the home is then gone)."""
        addr = self._at[path]
        now = faults()
        if self._written.any(addr):
            try:
                now = self._map(addr, fd)
            except TransportError:
                self.drop(path)
                raise
        self._clean_at[path] = now

    def _map(self, addr: int, fd: int) -> int:
        """Map the file of ``fd`` anew at ``addr``; the fault count it holds no copy at."""
        before = faults()
        self._calls.map(addr, self._size, SHOWN, PRIVATE_FILE, fd)
        return before

    def drop(self, path: str) -> None:
        self._clean_at.pop(path, None)
        addr = self._at.pop(path, None)
        if addr is not None:
            self._calls.unmap(addr, self._size)

    def close(self) -> None:
        for path in list(self._at):
            self.drop(path)
        self._written.close()
        if self._status >= 0:
            os.close(self._status)
            self._status = -1


def _let_go(
    calls: Mappings, at: dict[str, int], size: int, written: WrittenPages, status: int
) -> None:
    """A window dropped without ``release()``: its homes and descriptors go with it."""
    for addr in at.values():
        calls.unmap(addr, size)
    at.clear()
    written.close()
    with contextlib.suppress(OSError):
        os.close(status)
