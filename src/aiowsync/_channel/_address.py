"""Control-channel addresses: the host-local default, and which addresses stay on this host."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import secrets
import sys
from urllib.parse import urlsplit

from ._socket_dir import new_socket_dir

__all__ = [
    "FRESH_ABSTRACT",
    "LOCAL_BIND",
    "check_zmq_address",
    "is_loopback_address",
    "reachable",
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


def resolve_local(address: str) -> str:
    """``address``, with :data:`LOCAL_BIND` or :data:`FRESH_ABSTRACT` replaced by a concrete
    address to bind (for :data:`LOCAL_BIND`, a new private directory is made for it)."""
    if address == FRESH_ABSTRACT and sys.platform.startswith("linux"):
        return f"ipc://@aiowsync-{os.getpid()}-{secrets.token_hex(8)}"
    if address == LOCAL_BIND and os.name == "posix":
        return new_socket_dir()  # the directory is made when it is bound
    if address in (LOCAL_BIND, FRESH_ABSTRACT):
        return "tcp://127.0.0.1:0"
    return address


def transport(address: str) -> str:
    """The transport of a ZeroMQ address (``tcp``, ``ipc``...): what precedes ``://``. Not
    urllib's parse, which fails on an ipc name holding ``[``."""
    return address.partition("://")[0]


def is_loopback_address(address: str) -> bool:
    """True for ``ipc://``/``inproc://`` and for tcp hosts in 127.0.0.0/8, ::1 or localhost."""
    if transport(address) != "tcp":
        return transport(address) in ("ipc", "inproc")
    try:
        host = (urlsplit(address).hostname or "").strip("[]")
    except ValueError:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def reachable(address: str, host: str | None) -> str:
    """The address a receiver connects to, for a sender bound to ``address``: one bound on
    every interface (``tcp://0.0.0.0:PORT``, ``tcp://[::]:PORT``) is reached at ``host``
    (the sender's data host, where it has one), or on this host's loopback."""
    if transport(address) != "tcp":
        return address
    bound, _, port = address[len("tcp://") :].rpartition(":")
    try:
        wildcard = bound == "*" or ipaddress.ip_address(bound.strip("[]")).is_unspecified
    except ValueError:
        return address
    if not wildcard:
        return address
    if host is None:
        host = "::1" if ":" in bound else "127.0.0.1"
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


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
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        return f"bad port {port!r}"
    if int(port) == 0 and not bind:
        return "port 0 is for binding; connect to the port the sender reports"
    return None
