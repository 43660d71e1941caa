"""A window: one fixed range of virtual memory that shows one slot file at a time.

A swap-mode receiver binds its model's tensors to views of the window once. Switching to the
next version then replaces the file shown in the window, whatever the number of tensors; no
tensor is re-bound and no byte is copied. The kernel swaps the mapping atomically, so even an
unguarded reader sees old or new pages, never a hole.

Each slot file also has a home: a range of its own where its mapping waits while the window
shows another file. A switch moves the shown mapping home and the next file's mapping into
the window with their page tables, so a model read after every version does not fault its
pages in again: mapped anew, 64 MiB of 4 KiB pages cost a reader some 7 ms of page faults and
unmapping at each version. A page the worker wrote is a private copy (what a worker writes
stays its own): once the switch is over, a home whose mapping holds one is mapped anew, so a
later version in that file shows the file's bytes. Where the kernel cannot move file mappings
(before Linux 5.13) or hides ``/proc/self/pagemap``, each switch maps the file anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import resource
import weakref

import torch

from aiowsync._exceptions import TransportError

from .mapping import MAP_FIXED, MAP_NORESERVE, WrittenPages, calls
from .slots import open_slot

__all__ = ["SlotWindow", "windows_supported"]

log = logging.getLogger("aiowsync.shm")

_KEPT_FILES = 32
_SHOWN = mmap.PROT_READ | mmap.PROT_WRITE
_PRIVATE_FILE = mmap.MAP_PRIVATE | MAP_NORESERVE | MAP_FIXED


def _faults() -> int:
    """Page faults taken by this process's threads so far. A page written into a private
    mapping becomes a private copy in a fault, counted here, so a mapping shown while this
    count stayed put holds none (and its page tables need no look)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_minflt + usage.ru_majflt


def windows_supported() -> bool:
    return calls is not None


class SlotWindow:
    """``nbytes`` of address space that maps whichever slot file :meth:`show` last named."""

    def __init__(self, nbytes: int) -> None:
        if calls is None:
            raise OSError("slot windows need Linux")
        self.nbytes = nbytes
        self._size = max(nbytes, 1)
        self._fds: dict[str, int] = {}
        self._homes: dict[str, int] = {}
        """Where each slot file's mapping waits while the window shows another."""
        self._unchecked: set[str] = set()
        """Homes whose pages the worker may have written while the window showed them."""
        self._check_pending = False
        self._faults_at_show: int | None = None
        """This process's page faults just before the mapping shown now came in."""
        self.addr = calls.reserve(self._size)
        array = (ctypes.c_uint8 * self._size).from_address(self.addr)
        self.tensor = torch.frombuffer(array, dtype=torch.uint8)[:nbytes]
        # ``array`` lives as long as this window and every storage made over it: the range is
        # given back once neither is left (a model still bound to it after a failed detach
        # keeps it). The window holds it itself because torch can move a storage elsewhere
        # (``share_memory_()``, torch.multiprocessing pickling) and drop its reference while
        # this window still maps slots at ``addr``. Not at interpreter exit, when a view may
        # still be read.
        self._array = array
        weakref.finalize(array, calls.unmap, self.addr, self._size).atexit = False
        self.showing: str | None = None
        try:
            self._written: WrittenPages | None = WrittenPages(self._size)
        except OSError as exc:
            log.info("no pagemap (%s): each switch maps the slot file anew", exc)
            self._written = None

    def open(self, path: str) -> int:
        """A descriptor of slot file ``path`` (checked and opened on first use, then kept)."""
        fd = self._fds.get(path)
        if fd is None:
            fd = open_slot(path, self.nbytes)
            # A sender has a few slots; more paths than that are not worth a descriptor each.
            while len(self._fds) >= _KEPT_FILES:
                old = next(p for p in self._fds if p != self.showing)
                os.close(self._fds.pop(old))
                self._unhome(old)
            self._fds[path] = fd
        return fd

    def show(self, path: str) -> None:
        """Show slot file ``path`` in the window, replacing what it showed."""
        assert calls is not None
        if self.tensor.data_ptr() != self.addr:
            raise TransportError(
                "the model's tensors no longer use the slot window (torch moved their storage, "
                "e.g. by share_memory_()); switch='rebind' works with such models"
            )
        fd = self.open(path)
        if self._written is not None:
            try:
                self._move_in(path, fd)
            except (OSError, TransportError) as exc:
                log.info("slot mappings cannot be moved (%s): each switch maps anew", exc)
                self._stop_moving()
            else:
                self.showing = path
                return
        # Private: what the model writes stays its own and goes with the next switch.
        calls.map(self.addr, self._size, _SHOWN, _PRIVATE_FILE, fd)
        self.showing = path

    def _move_in(self, path: str, fd: int) -> None:
        """Move the mapping of ``path`` into the window, and the one shown to its home."""
        assert calls is not None and self._written is not None
        if path == self.showing:
            now = _faults()
            if now != self._faults_at_show and self._written.any(self.addr):
                calls.map(self.addr, self._size, _SHOWN, _PRIVATE_FILE, fd)
            self._faults_at_show = now
            return
        home = self._homes.get(path)
        if home is None:
            home = calls.reserve(self._size)
            self._homes[path] = home
            calls.map(home, self._size, _SHOWN, _PRIVATE_FILE, fd)
        elif path in self._unchecked:
            self._check(path)  # not checked since it was shown last (no loop ran the check)
        shown = self._homes.get(self.showing) if self.showing is not None else None
        if shown is not None:
            # The window keeps a mapping of the same file without pages until the move below
            # replaces it: a reader meanwhile faults the shown version's bytes back in.
            calls.move(self.addr, shown, self._size)
        # Read after the move out: a write into the mapping before it is counted.
        now = _faults()
        if shown is not None and now != self._faults_at_show:
            assert self.showing is not None
            self._unchecked.add(self.showing)
            self._check_soon()
        calls.move(self._homes[path], self.addr, self._size)
        self._faults_at_show = now

    def _check_soon(self) -> None:
        """Check the homes just filled once the switch is over (after the ack), or now when
        no event loop runs here."""
        if self._check_pending:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._check_all()
        else:
            self._check_pending = True
            loop.call_soon(self._check_all)

    def _check_all(self) -> None:
        self._check_pending = False
        for path in list(self._unchecked):
            self._check(path)

    def _check(self, path: str) -> None:
        """Drop the pages of ``path``'s home if the worker wrote into any while it was
        shown: what it wrote belongs to that version, not to the next one in the file."""
        self._unchecked.discard(path)
        home = self._homes.get(path)
        if home is None or self._written is None or calls is None:
            return
        if self._written.any(home):
            try:
                calls.map(home, self._size, _SHOWN, _PRIVATE_FILE, self._fds[path])
            except (KeyError, TransportError):
                self._unhome(path)

    def _unhome(self, path: str) -> None:
        self._unchecked.discard(path)
        home = self._homes.pop(path, None)
        if home is not None and calls is not None:
            calls.unmap(home, self._size)

    def _stop_moving(self) -> None:
        for path in list(self._homes):
            self._unhome(path)
        if self._written is not None:
            self._written.close()
            self._written = None

    def release(self) -> None:
        """Stop showing any slot (zeros from now on) so no slot memory stays pinned by us.

        The address range itself is kept while any tensor views it (zeros, not a segfault,
        for one still read); the last view's end gives it back.
        """
        if self.showing is not None and calls is not None:
            anon = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED
            with contextlib.suppress(TransportError):
                calls.map(self.addr, self._size, mmap.PROT_READ, anon, -1)
            self.showing = None
        self._stop_moving()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
