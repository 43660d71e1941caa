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
stays its own), which must not come back at a later version of its file: a home that may hold
one is looked through and mapped anew (see :mod:`.homes`). Where the kernel cannot move file
mappings (before Linux 5.13), hides ``/proc/self/pagemap``, or commits memory strictly
(``vm.overcommit_memory=2``), and in a process that locks memory, each switch maps the file
anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import mmap
import os
import weakref

import torch

from aiowsync._exceptions import TransportError

from .homes import PRIVATE_FILE, SHOWN, Homes, faults, moves_allowed
from .mapping import MAP_FIXED, MAP_NORESERVE, calls
from .slots import open_slot

__all__ = ["SlotWindow", "windows_supported"]

log = logging.getLogger("aiowsync.shm")

_KEPT_FILES = 32


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
        weakref.finalize(self, _close_all, self._fds)
        self.showing: str | None = None
        self._faults_at_show = 0
        """This process's page faults just before the mapping shown now came in."""
        self._check_pending = False
        self._homes: Homes | None = None
        """None where mappings are not moved: each switch maps the slot file anew."""
        if moves_allowed():
            try:
                self._homes = Homes(calls, self._size)
            except OSError as exc:
                log.info("no pagemap (%s): each switch maps the slot file anew", exc)

    def open(self, path: str) -> int:
        """A descriptor of slot file ``path`` (checked and opened on first use, then kept)."""
        fd = self._fds.get(path)
        if fd is None:
            fd = open_slot(path, self.nbytes)
            # A sender has a few slots; more paths than that are not worth a descriptor each.
            while len(self._fds) >= _KEPT_FILES:
                old = next(p for p in self._fds if p != self.showing)
                os.close(self._fds.pop(old))
                if self._homes is not None:
                    self._homes.drop(old)
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
        if self._homes is not None:
            try:
                self._move_in(self._homes, path, fd)
            except (OSError, TransportError) as exc:
                # Moves fail for good on kernels before 5.13, and in a process that locks
                # memory; address space or mappings running out are taken as lasting too.
                log.info("slot mappings cannot be moved (%s): each switch maps anew", exc)
                self._stop_moving()
            else:
                self.showing = path
                return
        # Private: what the model writes stays its own and goes with the next switch.
        calls.map(self.addr, self._size, SHOWN, PRIVATE_FILE, fd)
        self.showing = path

    def _move_in(self, homes: Homes, path: str, fd: int) -> None:
        """Move the mapping of ``path`` into the window, and the one shown to its home."""
        assert calls is not None
        shown = self.showing
        if path == shown:
            now = faults()
            if now != self._faults_at_show and homes.written(self.addr):
                calls.map(self.addr, self._size, SHOWN, PRIVATE_FILE, fd)
            self._faults_at_show = now
            return
        # Before anything moves: a copy made from here on (mlock filling a home, or a
        # mapping made anew) moves the counts past these, and is looked for.
        mark = homes.mark()
        incoming = faults()
        home = homes.ready(path, fd, mark)
        # Before any move, after the home was made (mlockall(MCL_FUTURE) locks it).
        if homes.locked():
            raise OSError("this process locks memory")
        if shown is not None and shown in homes:
            # The window keeps a mapping of the same file without pages until the move below
            # replaces it: a reader meanwhile faults the shown version's bytes back in.
            calls.move(self.addr, homes.at(shown), self._size)
            # Read after the move out: a write into the mapping before it is counted.
            now = faults()
            homes.left(shown, mark if now == self._faults_at_show else None)
            if now != self._faults_at_show:
                self._check_soon()
        self._faults_at_show = incoming
        calls.move(home, self.addr, self._size)

    def _check_soon(self) -> None:
        """Look through the homes that may hold the worker's writes once the switch is over
        (after the ack), or now when no event loop runs here; a home shown before that is
        looked through first in any case."""
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
        homes = self._homes
        if homes is None:
            return
        for path in homes.unsure():
            fd = self._fds.get(path)
            if fd is None:
                homes.drop(path)
                continue
            # A home that cannot be mapped anew is dropped: the next show makes another.
            with contextlib.suppress(TransportError):
                homes.look(path, fd)

    def _stop_moving(self) -> None:
        if self._homes is not None:
            self._homes.close()
            self._homes = None

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
        _close_all(self._fds)


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()
