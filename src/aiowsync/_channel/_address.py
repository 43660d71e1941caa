"""Control-channel addresses: the host-local default, and which addresses stay on this host."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import secrets
import stat
import sys
import tempfile
from urllib.parse import urlsplit

from .._util.pids import pid_alive

__all__ = [
    "FRESH_ABSTRACT",
    "LOCAL_BIND",
    "check_zmq_address",
    "claim_socket_dir",
    "is_loopback_address",
    "owned_socket_dir",
    "remove_owned_socket_dir",
    "remove_stale_socket_dirs",
    "resolve_local",
]

log = logging.getLogger("aiowsync.channel")

LOCAL_BIND = "ipc://*"
"""Bind a fresh socket that only this host, and only this user, can reach: on Linux and other
Unix systems a socket file in a new directory of mode 0700 (the kernel refuses other users at
``connect()``, before the sender spends anything on them), a loopback TCP port elsewhere."""
FRESH_ABSTRACT = "ipc://@*"
"""Bind a fresh abstract Unix socket (Linux): reachable from this network namespace whatever
the file system, with no file permissions (the same-user check runs after ZeroMQ's
handshake; see docs/security.md)."""

_DIR_NAME = re.compile(r"aiowsync-(\d+)-[0-9a-f]{16}")
_SOCKET = "control"
_MAX_SOCKET_PATH = 100
"""Unix socket paths are limited to 107 bytes (108 with the terminating NUL)."""


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


def resolve_local(address: str) -> str:
    """``address``, with :data:`LOCAL_BIND` or :data:`FRESH_ABSTRACT` replaced by a concrete
    address to bind (for :data:`LOCAL_BIND`, a new private directory is made for it)."""
    if address == FRESH_ABSTRACT and sys.platform.startswith("linux"):
        return f"ipc://@aiowsync-{os.getpid()}-{secrets.token_hex(8)}"
    if address == LOCAL_BIND and os.name == "posix":
        base = _socket_base()
        remove_stale_socket_dirs(base)
        directory = os.path.join(base, f"aiowsync-{os.getpid()}-{secrets.token_hex(8)}")
        return f"ipc://{directory}/{_SOCKET}"  # the directory is made when it is bound
    if address in (LOCAL_BIND, FRESH_ABSTRACT):
        return "tcp://127.0.0.1:0"
    return address


def owned_socket_dir(address: str) -> str | None:
    """The private directory :func:`resolve_local` made for ``address`` in this process, if
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
    :func:`resolve_local`); the directory, or None for any other address. The directory is
    new (``mkdir`` fails on a name taken first) and only this user may enter it: another
    user's ``connect()`` to the socket in it fails in the kernel."""
    directory = owned_socket_dir(address)
    if directory is not None:
        os.mkdir(directory, 0o700)
    return directory


def remove_owned_socket_dir(directory: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(directory, _SOCKET))
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def remove_stale_socket_dirs(base: str | None = None) -> list[str]:
    """Remove the private socket directories of this user's senders that died without
    removing them; returns their paths. Another user's directory is never touched, and a
    name that only looks like ours is left alone."""
    base = base or _socket_base()
    removed: list[str] = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        m = _DIR_NAME.fullmatch(name)
        if m is None:
            continue
        directory = os.path.join(base, name)
        with contextlib.suppress(OSError):
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            if pid_alive(int(m.group(1))):
                continue
            remove_owned_socket_dir(directory)
            if not os.path.exists(directory):
                removed.append(directory)
    if removed:
        log.info("removed %d socket director(y/ies) left by dead senders", len(removed))
    return removed


def is_loopback_address(address: str) -> bool:
    """True for ``ipc://``/``inproc://`` and for tcp hosts in 127.0.0.0/8, ::1 or localhost."""
    parts = urlsplit(address)
    if parts.scheme in ("ipc", "inproc"):
        return True
    host = (parts.hostname or "").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


ACCEPTED = (
    "tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555, tcp://[::1]:5555; port 0 binds a free one), "
    "ipc:///path/to/socket, ipc://@abstract-name (Linux), ipc://* to bind a fresh socket in a "
    "private directory, or ipc://@* a fresh abstract one"
)
_HOST = re.compile(r"^(\*|[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\])$")


def check_zmq_address(address: str, *, bind: bool) -> None:
    """``ValueError`` listing the accepted forms unless ZeroMQ can bind (or connect to)
    ``address`` the way schemes use it."""
    if not isinstance(address, str):
        raise ValueError(f"an address is a string, got {type(address).__name__}; use {ACCEPTED}")
    problem = _problem(address, bind=bind)
    if problem is not None:
        raise ValueError(f"{address!r} is not a control address ({problem}); use {ACCEPTED}")


def _problem(address: str, *, bind: bool) -> str | None:
    scheme, sep, rest = address.partition("://")
    if not sep:
        return "no transport: it must start with tcp:// or ipc://"
    if scheme == "ipc":
        if not rest:
            return "no socket path or name"
        if rest in ("@*", "*") and not bind:
            return f"ipc://{rest} is for binding; connect to the address the sender reports"
        return None
    if scheme == "inproc":
        return None if rest else "no name"
    if scheme != "tcp":
        return f"unknown transport {scheme!r}"
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        return "tcp needs HOST:PORT"
    if not _HOST.match(host) or (host == "*" and not bind):
        return f"bad host {host!r}"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        return f"bad port {port!r}"
    if int(port) == 0 and not bind:
        return "port 0 is for binding; connect to the port the sender reports"
    return None
