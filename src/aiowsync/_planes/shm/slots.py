"""Slots in named POSIX shared memory: files in /dev/shm that any local process can map.

A slot file is named ``aiowsync-<sender pid>-<random token>-<slot index>``, the token drawn
afresh for each file so that no name can be foretold; it is created exclusively with mode 0600
and removed when the sender shuts down. A sender that crashed cannot remove its
files, so every new sender first removes the files of senders whose process no longer exists.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import warnings
from pathlib import Path

import torch

from aiowsync._exceptions import TransportError
from aiowsync._util.pids import pid_alive

__all__ = [
    "SHM_DIR",
    "SlotFile",
    "check_slot_path",
    "open_slot",
    "pid_alive",
    "remove_stale_slots",
]

log = logging.getLogger("aiowsync.shm")

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"aiowsync-(\d+)-([0-9a-f]+)-(\d+)")
"""A slot file's name (matched whole: no trailing newline or anything else)."""


def remove_stale_slots(directory: Path = SHM_DIR) -> list[str]:
    """Remove slot files whose creating process is gone; returns the names removed."""
    removed: list[str] = []
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    me = os.getuid()
    for path in entries:
        m = _NAME.fullmatch(path.name)
        if m is None:
            continue
        # Another user's file is never ours to judge, whatever its name says: the owner is
        # checked before the pid that the name claims, and a pid that looks dead may live in
        # another pid namespace: its lock on the file says so.
        with contextlib.suppress(OSError):
            if path.stat().st_uid == me and not _owner_lives(path, int(m.group(1))):
                path.unlink()
                removed.append(path.name)
    if removed:
        log.info("removed %d shared-memory slot(s) left by dead senders", len(removed))
    return removed


def _owner_lives(path: Path, pid: int) -> bool:
    """Whether the sender that made slot ``path`` may still live: its pid exists here, or
    it holds its lock on the file (from a pid namespace where this pid means nothing)."""
    if pid_alive(pid):
        return True
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def check_slot_path(path: str, owner: int | None = None) -> None:
    """``TransportError`` unless ``path`` names an aiowsync slot file in the shm directory
    (of the sender with pid ``owner``, when given)."""
    m = _NAME.fullmatch(os.path.basename(path))
    if m is None or os.path.dirname(path) != str(SHM_DIR):
        raise TransportError(f"{path!r} is not an aiowsync shared-memory slot")
    if owner is not None and int(m.group(1)) != owner:
        raise TransportError(f"{path!r} is not a slot of this worker's sender (pid {owner})")


def open_slot(path: str, nbytes: int, *, writable: bool = True) -> int:
    """A descriptor of an existing slot file (read-write unless not ``writable``), checked
    first.

    Slot paths come from the control channel, so only a regular file of ours (this user's,
    not a link) of at least ``nbytes`` bytes is opened. The open itself does not wait: a
    FIFO put under a slot's name would hold a read-only open until someone writes to it.
    """
    check_slot_path(path)
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise TransportError(f"cannot open shared-memory slot {path}: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise TransportError(f"{path} is not a slot file of this user")
        if st.st_size < nbytes:
            raise TransportError(f"shared-memory slot {path} is smaller than {nbytes} bytes")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _map(
    path: str, nbytes: int, flags: int, *, writable: bool = True
) -> tuple[torch.Tensor, int | None]:
    """Map ``path`` shared (created with ``O_CREAT`` in ``flags``); not ``writable``: read
    only, so that a write through the mapping faults in this process instead of reaching
    the file. A file created here comes with a descriptor on which its owner's lock is held
    (see :func:`remove_stale_slots`), to be closed once the file is removed."""
    created = bool(flags & os.O_CREAT)
    if created:
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TransportError(f"cannot create shared-memory slot {path}: {exc}") from None
    else:
        fd = open_slot(path, nbytes, writable=writable)
    held = False
    try:
        if created:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a new file: nobody else holds it
            os.ftruncate(fd, max(nbytes, 1))
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, prot)
        held = created
    except OSError as exc:
        if created:
            with contextlib.suppress(OSError):
                os.unlink(path)
        raise TransportError(f"cannot map shared-memory slot {path}: {exc}") from None
    finally:
        if not held:
            os.close(fd)
    return _tensor_of(mm, nbytes), fd if held else None


def _tensor_of(mm: mmap.mmap, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of mapping ``mm`` as a byte tensor. The tensor holds the only
    reference to the mapping; it is unmapped when the last view of it (including a model's
    parameters) is gone."""
    with warnings.catch_warnings():
        # torch warns that it cannot mark a tensor read-only: the mapping itself is.
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]


def _identity(fd: int | None) -> tuple[int, int] | None:
    """The device and inode of the file open as ``fd`` (None: no descriptor)."""
    if fd is None:
        return None
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _free_bytes(directory: str) -> int | str:
    try:
        st = os.statvfs(directory)
    except OSError:
        return "unknown"
    return st.f_bavail * st.f_frsize


class SlotFile:
    """One slot: a mapped file of ``nbytes`` bytes, viewed as a flat uint8 tensor."""

    def __init__(
        self, path: str, nbytes: int, tensor: torch.Tensor, *, owner: bool, lock: int | None
    ) -> None:
        self.path = path
        self.nbytes = nbytes
        self.tensor = tensor
        self.owner = owner
        self._lock = lock
        self._backed = not owner
        self._identity = _identity(lock)

    def back(self) -> None:
        """Give every page of the file its memory now (once; blocking, so from a thread).

        A file in /dev/shm gets its pages as they are first written; when the file system is
        full (a container's /dev/shm is 64 MiB unless raised), that write kills the process
        with SIGBUS. Allocating up front turns it into a :class:`TransportError` instead.
        """
        if self._backed:
            return
        fallocate = getattr(os, "posix_fallocate", None)
        if fallocate is not None and self._lock is not None:
            # Through the descriptor the file was created with, never by name: the name may
            # have been removed, and another user's file or link put in its place.
            try:
                fallocate(self._lock, 0, max(self.nbytes, 1))
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    free = _free_bytes(os.path.dirname(self.path))
                    raise TransportError(
                        f"cannot allocate {self.nbytes} bytes for shared-memory slot {self.path}"
                        f" ({exc.strerror}; {free} bytes free there). In a container, raise its"
                        " shared-memory size (docker run --shm-size=...)."
                    ) from None
        self._backed = True

    @classmethod
    def create(cls, index: int, nbytes: int) -> SlotFile:
        """A new slot file under a name of its own: a token drawn for it alone, so that no
        other process can take the name first (it is created exclusively)."""
        path = str(SHM_DIR / f"aiowsync-{os.getpid()}-{secrets.token_hex(8)}-{index}")
        tensor, lock = _map(path, nbytes, os.O_CREAT | os.O_EXCL | os.O_RDWR)
        return cls(path, nbytes, tensor, owner=True, lock=lock)

    @classmethod
    def open(cls, path: str, nbytes: int, *, writable: bool = True) -> SlotFile:
        """Map another process's slot file (read only unless ``writable``)."""
        flags = os.O_RDWR if writable else os.O_RDONLY
        tensor, _ = _map(path, nbytes, flags, writable=writable)
        return cls(path, nbytes, tensor, owner=False, lock=None)

    @classmethod
    def open_descriptor(cls, path: str, fd: int, nbytes: int) -> SlotFile:
        """Map, read only, the slot file ``path`` through ``fd``, a descriptor opened on it
        before (:func:`open_slot`): this holds after the file's name was removed."""
        try:
            mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as exc:
            raise TransportError(f"cannot map shared-memory slot {path}: {exc}") from None
        return cls(path, nbytes, _tensor_of(mm, nbytes), owner=False, lock=None)

    def name_is_ours(self) -> bool:
        """Whether this slot's name still names the file this process created (not removed,
        and not replaced by another file or a link)."""
        try:
            st = os.lstat(self.path)
        except OSError:
            return False
        return self._identity is not None and (st.st_dev, st.st_ino) == self._identity

    def unlink(self) -> None:
        """Remove the name (mappings stay valid until their last view goes)."""
        if self.owner and self.name_is_ours():  # not another's file put under its name
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.release()

    def release(self) -> None:
        """Let go of the owner's lock (the file is removed, or was removed by another)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            os.close(lock)
