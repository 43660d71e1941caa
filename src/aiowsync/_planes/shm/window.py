"""A window: one fixed range of virtual memory that shows one slot file at a time.

A swap-mode receiver binds its model's tensors to views of the window once. Switching to the
next version is then one ``mmap(MAP_FIXED)`` call that replaces the file shown in the window,
whatever the number of tensors; no tensor is re-bound and no byte is copied. The kernel swaps
the mapping atomically, so even an unguarded reader sees old or new pages, never a hole.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import weakref

import torch

from aiowsync._exceptions import TransportError
from aiowsync._util.libc import libc

from .slots import open_slot

__all__ = ["SlotWindow", "windows_supported"]

log = logging.getLogger("aiowsync.shm")

_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value
_KEPT_FILES = 32


def _mapping_calls() -> ctypes.CDLL | None:
    """The C library with ``mmap``/``munmap`` typed for the calls below; None off Linux."""
    c = libc()
    if c is None:
        return None
    c.mmap.restype = ctypes.c_void_p
    c.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    c.munmap.restype = ctypes.c_int
    c.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return c


_LIBC = _mapping_calls()


def _unmap(addr: int, size: int) -> None:
    assert _LIBC is not None
    _LIBC.munmap(addr, size)


def windows_supported() -> bool:
    return _LIBC is not None


class SlotWindow:
    """``nbytes`` of address space that maps whichever slot file :meth:`show` last named."""

    def __init__(self, nbytes: int) -> None:
        if _LIBC is None:
            raise OSError("slot windows need Linux")
        self.nbytes = nbytes
        self._size = max(nbytes, 1)
        self._fds: dict[str, int] = {}
        anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        self.addr = self._mmap(None, mmap.PROT_READ, anon, -1)
        array = (ctypes.c_uint8 * self._size).from_address(self.addr)
        self.tensor = torch.frombuffer(array, dtype=torch.uint8)[:nbytes]
        # ``array`` lives as long as this window and every storage made over it: the range is
        # given back once neither is left (a model still bound to it after a failed detach
        # keeps it). The window holds it itself because torch can move a storage elsewhere
        # (``share_memory_()``, torch.multiprocessing pickling) and drop its reference while
        # this window still maps slots at ``addr``. Not at interpreter exit, when a view may
        # still be read.
        self._array = array
        weakref.finalize(array, _unmap, self.addr, self._size).atexit = False
        self.showing: str | None = None

    def _mmap(self, addr: int | None, prot: int, flags: int, fd: int) -> int:
        assert _LIBC is not None
        got = _LIBC.mmap(addr, self._size, prot, flags, fd, 0)
        if got is None or got == _MAP_FAILED:
            err = ctypes.get_errno()
            raise TransportError(f"mmap failed: {os.strerror(err)}")
        return int(got)

    def open(self, path: str) -> int:
        """A descriptor of slot file ``path`` (checked and opened on first use, then kept)."""
        fd = self._fds.get(path)
        if fd is None:
            fd = open_slot(path, self.nbytes)
            # A sender has a few slots; more paths than that are not worth a descriptor each.
            while len(self._fds) >= _KEPT_FILES:
                old = next(p for p in self._fds if p != self.showing)
                os.close(self._fds.pop(old))
            self._fds[path] = fd
        return fd

    def show(self, path: str) -> None:
        """Map slot file ``path`` over the window, replacing what it showed."""
        if self.tensor.data_ptr() != self.addr:
            raise TransportError(
                "the model's tensors no longer use the slot window (torch moved their storage, "
                "e.g. by share_memory_()); switch='rebind' works with such models"
            )
        fd = self.open(path)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        # Private: what the model writes stays its own and goes with the next switch.
        self._mmap(self.addr, prot, mmap.MAP_PRIVATE | _MAP_NORESERVE | _MAP_FIXED, fd)
        self.showing = path

    def release(self) -> None:
        """Stop showing any slot (zeros from now on) so no slot memory stays pinned by us.

        The address range itself is kept while any tensor views it (zeros, not a segfault,
        for one still read); the last view's end gives it back.
        """
        if self.showing is not None:
            anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
            with contextlib.suppress(TransportError):
                self._mmap(self.addr, mmap.PROT_READ, anon, -1)
            self.showing = None
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
