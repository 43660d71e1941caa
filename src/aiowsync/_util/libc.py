"""The C library, loaded once, for the few calls that torch and the standard library lack."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

__all__ = ["libc"]


@functools.cache
def libc() -> ctypes.CDLL | None:
    """glibc (or the platform's C library) with ``errno`` kept, or None off Linux or when it
    cannot be loaded. Callers set the ``argtypes`` of what they call on their own handle."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
