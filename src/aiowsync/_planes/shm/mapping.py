"""The memory-mapping calls that the slot window needs and Python's ``mmap`` module lacks:
mappings at a chosen address, moves of a mapping with its page tables, and a look at which
pages of a range this process wrote.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any

import torch

from aiowsync._exceptions import TransportError
from aiowsync._util.libc import libc

__all__ = ["PAGE", "Mappings", "WrittenPages", "calls"]

PAGE = mmap.PAGESIZE
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MREMAP_DONTUNMAP = 4
_ALIGN = 2 << 20
"""Ranges start on 2 MiB boundaries, so that a move hands over whole page-table pages."""
_FAILED = ctypes.c_void_p(-1).value


class Mappings:
    """``mmap``, ``mremap`` and ``munmap`` of the C library, typed, for ranges of ``size``
    bytes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        ptr, size, num = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        _typed(lib.mmap, ptr, ptr, size, num, num, num, ctypes.c_long)
        _typed(lib.mremap, ptr, ptr, size, size, num, ptr)
        _typed(lib.munmap, num, ptr, size)
        self._lib = lib

    def map(self, addr: int | None, size: int, prot: int, flags: int, fd: int) -> int:
        got = self._lib.mmap(addr, size, prot, flags, fd, 0)
        if got is None or got == _FAILED:
            raise TransportError(f"mmap failed: {os.strerror(ctypes.get_errno())}")
        return int(got)

    def reserve(self, size: int) -> int:
        """``size`` bytes of address space that read as zeros, starting on a 2 MiB boundary."""
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
        span = _pages(size)
        start = self.map(None, span + _ALIGN, mmap.PROT_READ, flags, -1)
        addr = -(-start // _ALIGN) * _ALIGN
        if addr > start:
            self.unmap(start, addr - start)
        self.unmap(addr + span, start + _ALIGN - addr)
        return addr

    def move(self, source: int, target: int, size: int) -> None:
        """Move the mapping at ``source`` over the one at ``target``, page tables included
        (nothing is faulted in again); ``source`` keeps a mapping of the same file without
        pages. ``OSError`` where the kernel cannot (before Linux 5.13 for file mappings)."""
        flags = _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP
        got = self._lib.mremap(source, size, size, flags, target)
        if got is None or got == _FAILED:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    def unmap(self, addr: int, size: int) -> None:
        if size > 0:
            self._lib.munmap(addr, size)


def _typed(function: Any, restype: Any, *argtypes: Any) -> None:
    function.restype = restype
    function.argtypes = list(argtypes)


def _pages(size: int) -> int:
    return -(-max(size, 1) // PAGE) * PAGE


def _load() -> Mappings | None:
    lib = libc()
    return None if lib is None else Mappings(lib)


calls = _load()
"""The mapping calls, or None off Linux."""


class WrittenPages:
    """Tells whether this process wrote into a private file mapping of at most ``size``
    bytes: a written page is a private copy, which ``/proc/self/pagemap`` shows as a page
    that is present (or swapped out) and not the file's."""

    def __init__(self, size: int) -> None:
        self._fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        self._buffer = bytearray(_pages(size) // PAGE * 8)
        self._entries = torch.frombuffer(self._buffer, dtype=torch.int64)
        # A look allocates nothing: buffers this large would come from fresh pages, and the
        # page faults they cost would count as the worker's (see .homes).
        self._flags = torch.empty_like(self._entries)
        self._copies = torch.empty(self._entries.shape, dtype=torch.bool)
        self._swapped = torch.empty_like(self._copies)

    def any(self, addr: int) -> bool:
        """Whether any page of the mapping at ``addr`` was written (True too when the pagemap
        cannot be read)."""
        try:
            n = os.preadv(self._fd, [self._buffer], addr // PAGE * 8)
        except OSError:
            return True
        if n != len(self._buffer):
            return True
        # Bits 63, 62 and 61 of an entry: present, swapped, the file's page (or shared). A
        # copy is present and not the file's, or swapped out.
        flags = torch.bitwise_right_shift(self._entries, 61, out=self._flags).bitwise_and_(7)
        torch.eq(flags, 4, out=self._copies)
        torch.eq(flags, 2, out=self._swapped)
        return bool(self._copies.logical_or_(self._swapped).any())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
