"""The private directories that hold the senders' Unix sockets (``bind="ipc://*"``).

Each sender makes a directory of mode 0700 for its socket and removes it on close; senders
that died without closing leave theirs, and the next sender of the same user sweeps them.
The name carries the owner's pid, but a pid says nothing across pid namespaces (a container
sharing the temporary directory sees another namespace's live sender as dead). So the owner
also holds an exclusive ``flock`` on a lock file inside for as long as it lives, which the
kernel releases when it dies, whatever its namespace: the sweep removes a directory only when
that lock can be taken.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import stat
import tempfile

from .._util.pids import pid_alive

__all__ = [
    "claim_socket_dir",
    "missing_socket",
    "new_socket_dir",
    "owned_socket_dir",
    "remove_owned_socket_dir",
    "remove_stale_socket_dirs",
]

log = logging.getLogger("aiowsync.channel")

_DIR_NAME = re.compile(r"aiowsync-(\d+)-[0-9a-f]{16}")
_SWEPT_NAME = re.compile(r"(\.?)aiowsync-(\d+)-[0-9a-f]{16}(\.new)?")
"""What a sweep considers: directories in use, and those of a sender that died making one."""
_SOCKET = "control"
_LOCK = "owner.lock"
_MAX_SOCKET_PATH = 100
"""Unix socket paths are limited to 107 bytes (108 with the terminating NUL)."""

_held: dict[str, int] = {}
"""By directory, the descriptor on which this process holds the owner's lock."""


def _socket_base() -> str:
    """Where private socket directories go: the user's runtime directory if there is one,
    else the temporary directory, else /tmp (the first that keeps the path short enough)."""
    candidates = [os.environ.get("XDG_RUNTIME_DIR", ""), tempfile.gettempdir(), "/tmp"]
    for base in candidates:
        if not base or len(base) > _MAX_SOCKET_PATH - 40:
            continue
        with contextlib.suppress(OSError):
            st = os.stat(base)
            if stat.S_ISDIR(st.st_mode) and os.access(base, os.W_OK | os.X_OK):
                return base
    return "/tmp"


def new_socket_dir() -> str:
    """A socket address in a directory name of this process's, not made yet (see
    :func:`claim_socket_dir`); dead senders' directories are swept first."""
    base = _socket_base()
    remove_stale_socket_dirs(base)
    directory = os.path.join(base, f"aiowsync-{os.getpid()}-{secrets.token_hex(8)}")
    return f"ipc://{directory}/{_SOCKET}"


def owned_socket_dir(address: str) -> str | None:
    """The private directory :func:`new_socket_dir` named for ``address`` in this process, if
    it is one (its owner removes it once the socket is closed)."""
    if not address.startswith("ipc:///"):
        return None
    path = address[len("ipc://") :]
    directory, name = os.path.split(path)
    m = _DIR_NAME.fullmatch(os.path.basename(directory))
    if name != _SOCKET or m is None or int(m.group(1)) != os.getpid():
        return None
    return directory


def claim_socket_dir(address: str) -> str | None:
    """Make the private directory of ``address`` if it names one of this process's (see
    :func:`new_socket_dir`), holding its owner's lock; the directory, or None for any other
    address. Only this user may enter it: another user's ``connect()`` to the socket in it
    fails in the kernel. The directory is made under a name of its own and renamed once its
    lock is held, so that a sweep never finds it in use without one."""
    directory = owned_socket_dir(address)
    if directory is None:
        return None
    parent, name = os.path.split(directory)
    making = os.path.join(parent, f".{name}.new")
    os.mkdir(making, 0o700)
    fd = -1
    try:
        fd = os.open(
            os.path.join(making, _LOCK),
            os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(making, directory)  # an empty directory of that name would be replaced
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(making, _LOCK))
        with contextlib.suppress(OSError):
            os.rmdir(making)
        raise
    _held[directory] = fd
    return directory


def remove_owned_socket_dir(directory: str) -> None:
    """Remove ``directory``, its socket and its lock file, and let go of the lock if this
    process holds it."""
    for name in (_SOCKET, _LOCK):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(directory, name))
    with contextlib.suppress(OSError):
        os.rmdir(directory)
    fd = _held.pop(directory, None)
    if fd is not None:
        os.close(fd)


def missing_socket(address: str) -> str | None:
    """The socket file ``address`` names, if it is a file-system Unix socket that does not
    exist (None otherwise)."""
    if not address.startswith("ipc:///"):
        return None
    path = address[len("ipc://") :]
    return None if os.path.exists(path) else path


def _owner_lives(directory: str, pid: int) -> bool:
    """Whether the sender that made ``directory`` may still live: its pid exists here, or
    its lock is held (by a process this pid namespace cannot see)."""
    if pid_alive(pid):
        return True
    try:
        fd = os.open(os.path.join(directory, _LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # made by a version without the lock: the pid is all there is
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it the lock, if this call took it
    return False


def remove_stale_socket_dirs(base: str | None = None) -> list[str]:
    """Remove the private socket directories of this user's senders that died without
    removing them; returns their paths. Another user's directory is never touched, nor one
    whose owner's lock is held, and a name that only looks like ours is left alone."""
    base = base or _socket_base()
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        m = _SWEPT_NAME.fullmatch(name)
        if m is None or bool(m.group(1)) != bool(m.group(3)):
            continue
        directory = os.path.join(base, name)
        with contextlib.suppress(OSError):
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            if _owner_lives(directory, int(m.group(2))):
                continue
            remove_owned_socket_dir(directory)
            if not os.path.exists(directory):
                removed.append(directory)
    if removed:
        log.info("removed %d socket director(y/ies) left by dead senders", len(removed))
    return removed
