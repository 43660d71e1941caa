"""Control-channel addresses: the host-local default, and which addresses stay on this host."""

from __future__ import annotations

import ipaddress
import os
import secrets
import sys
from urllib.parse import urlsplit

__all__ = ["LOCAL_BIND", "is_loopback_address", "resolve_local"]

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
