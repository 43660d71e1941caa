"""A Unix socket file at a path the user chose (``bind="ipc:///run/trainer.sock"``).

ZeroMQ removes whatever file is at the path before it binds, and leaves the socket file
behind when it closes. So a second trainer bound to the path of a live one would take its
workers without a word, and a regular file there would be deleted. Before binding, the path
is checked: free, or a socket nobody listens on any more (a trainer that died). After
closing, the file is removed if it is still the one this sender bound (not a successor's).
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat

__all__ = ["BoundFile", "check_free", "socket_file"]

_PROBE_S = 1.0
"""How long the probe of a live socket may take to connect."""


def socket_file(address: str) -> str | None:
    """The path of the socket file a file-system ``ipc://`` address names (None for other
    addresses, abstract names and ``ipc://*``)."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://") :]
    return None if not path or path.startswith("@") or path == "*" else path


def check_free(path: str) -> None:
    """``OSError`` unless a sender may bind ``path``: nothing there, or a socket that no
    process listens on."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket (binding would delete it)")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(_PROBE_S)
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return  # left by a sender that ended
    except OSError as exc:
        raise OSError(exc.errno, f"{path} is a socket this process cannot probe: {exc}") from None
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"{path} is the socket of a live process (another sender?)")


class BoundFile:
    """The socket file a sender bound, known by its inode."""

    def __init__(self, path: str) -> None:
        self.path = path
        info = os.stat(path)
        self._identity = (info.st_dev, info.st_ino)

    def remove(self) -> None:
        """Remove the file if it is still the one bound (another sender may have bound the
        path since)."""
        with contextlib.suppress(OSError):
            info = os.stat(self.path)
            if (info.st_dev, info.st_ino) == self._identity:
                os.unlink(self.path)
