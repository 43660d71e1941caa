"""Homes: where each slot file's private mapping waits, page tables and all, while the slot
window shows another file; and what is known of the pages in each.

A page of a private mapping is either the file's own (shared with every process that maps the
file, so it shows what the sender wrote last) or a private copy made when this process wrote
it, or when the kernel filled the mapping for ``mlock``. A copy must never reach the window
at a later version of its file. Where one may be, the home's entries in ``/proc/self/pagemap``
are read, and a home holding a copy is mapped anew. When may one be:

* A mapping shown in the window may be written by the worker's threads; every copy is made in
  a page fault of one of them, so a mapping that leaves the window while the process's fault
  count still stands where it stood when the mapping came in holds none.
* A home at rest is written by nobody: no code but the window's knows its address. Only
  ``mlock``'s fill (``mlock``, ``mlockall``) reaches it, and every page locked on the machine
  counts in ``unevictable_pgs_mlocked`` of ``/proc/vmstat``. So a home known clean while that
  count stood at ``n`` is clean while it still stands at ``n``, whatever other faults the
  worker takes (a policy's forward allocates and faults all the time). Where that count
  cannot be read, the process's fault count stands in for it.

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

_LOCKED_PAGES = b"\nunevictable_pgs_mlocked "
_TEXT_BYTES = 16384
"""Room for /proc/vmstat and /proc/self/status (a few KiB each)."""

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
        self._files = {"status": os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)}
        """Descriptors of /proc files read at each switch (``vmstat`` where it counts locked
        pages)."""
        self._text = bytearray(_TEXT_BYTES)
        """Where those files are read (allocated once: see :class:`.mapping.WrittenPages`)."""
        vmstat = _open_vmstat()
        if vmstat >= 0:
            self._files["vmstat"] = vmstat
        self._at: dict[str, int] = {}
        self._clean_at: dict[str, int] = {}
        """The :meth:`mark` when each home was last known to hold no private copy."""
        self._let_go = weakref.finalize(
            self, _let_go, calls, self._at, size, self._written, self._files
        )

    def __contains__(self, path: str) -> bool:
        return path in self._at

    def at(self, path: str) -> int:
        return self._at[path]

    @property
    def counts_locked_pages(self) -> bool:
        """Whether :meth:`mark` is the machine's count of locked pages."""
        return "vmstat" in self._files

    def mark(self) -> int:
        """A count that moves whenever a home at rest may have gained a private copy: pages
        locked on this machine so far, or this process's page faults where that count cannot
        be read."""
        vmstat = self._files.get("vmstat")
        if vmstat is not None:
            try:
                size = os.preadv(vmstat, [self._text], 0)
                at = self._text.index(_LOCKED_PAGES, 0, size) + len(_LOCKED_PAGES)
                return int(self._text[at : self._text.index(b"\n", at, size)])
            except (OSError, ValueError):
                # From now on the fault count, which moves more often; what was known clean
                # by the other count is looked at again.
                os.close(self._files.pop("vmstat"))
                self._clean_at.clear()
        return faults()

    def locked(self) -> bool:
        """Whether this process holds locked memory (``VmLck`` above 0; True when unknown)."""
        try:
            size = os.preadv(self._files["status"], [self._text], 0)
            at = self._text.index(b"VmLck:", 0, size)
            return int(self._text[at + 6 : self._text.index(b"kB", at, size)]) > 0
        except (OSError, ValueError, KeyError):
            return True

    def written(self, addr: int) -> bool:
        """Whether the mapping at ``addr`` holds a private copy."""
        return self._written.any(addr)

    def ready(self, path: str, fd: int, mark: int) -> int:
        """The home of ``path`` (through ``fd``), made if new, holding none of this process's
        copies: ready to be moved into the window. ``mark``: :meth:`mark`, read just now."""
        addr = self._at.get(path)
        if addr is None:
            addr = self._calls.reserve(self._size)
            self._at[path] = addr
            self._map(addr, fd)
            self._clean_at[path] = mark
        elif self._clean_at.get(path) != mark:
            self.look(path, fd)
        return addr

    def left(self, path: str, clean_at: int | None) -> None:
        """``path``'s mapping came home from the window; it holds no copy as of :meth:`mark`
        ``clean_at`` (read before it moved), or may hold some (None)."""
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
        now = self.mark()  # before the look: a copy made from here on moves it
        if self._written.any(addr):
            try:
                self._map(addr, fd)
            except TransportError:
                self.drop(path)
                raise
        self._clean_at[path] = now

    def _map(self, addr: int, fd: int) -> None:
        """Map the file of ``fd`` anew at ``addr`` (holding no copy, as of a mark read
        before)."""
        self._calls.map(addr, self._size, SHOWN, PRIVATE_FILE, fd)

    def drop(self, path: str) -> None:
        self._clean_at.pop(path, None)
        addr = self._at.pop(path, None)
        if addr is not None:
            self._calls.unmap(addr, self._size)

    def close(self) -> None:
        self._clean_at.clear()
        self._let_go()  # unmaps every home, closes every descriptor (once)


def _open_vmstat() -> int:
    """A descriptor of ``/proc/vmstat`` where it counts locked pages, else -1."""
    try:
        fd = os.open("/proc/vmstat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return -1
    try:
        if _LOCKED_PAGES in os.pread(fd, _TEXT_BYTES, 0):
            return fd
    except OSError:
        pass
    os.close(fd)
    return -1


def _let_go(
    calls: Mappings, at: dict[str, int], size: int, written: WrittenPages, files: dict[str, int]
) -> None:
    """Homes closed, or dropped without being closed: every home and descriptor goes."""
    for addr in at.values():
        calls.unmap(addr, size)
    at.clear()
    written.close()
    for fd in files.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    files.clear()
