"""Control-channel addresses: the host-local default, and which addresses stay on this host."""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import sys
from urllib.parse import urlsplit

__all__ = ["LOCAL_BIND", "check_zmq_address", "is_loopback_address", "resolve_local"]

LOCAL_BIND = "ipc://@*"
"""Bind a fresh, uniquely named socket that only this host can reach: on Linux an abstract Unix
socket (reachable from this network namespace, no file to clean up, gone when closed), a
loopback TCP port elsewhere."""


def resolve_local(address: str) -> str:
    """``address``, with :data:`LOCAL_BIND` replaced by a concrete address to bind."""
    if address != LOCAL_BIND:
        return address
    if sys.platform.startswith("linux"):
        return f"ipc://@aiowsync-{os.getpid()}-{secrets.token_hex(8)}"
    return "tcp://127.0.0.1:0"


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
    "ipc:///path/to/socket, ipc://@abstract-name (Linux), or ipc://@* to bind a fresh one"
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
        if rest == "@*" and not bind:
            return "ipc://@* is for binding; connect to the address the sender reports"
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
