"""Whether a process lives, for numbers that come from peers and file names."""

from __future__ import annotations

import os

__all__ = ["PID_MAX", "pid_alive", "pid_namespace"]

PID_MAX = 2**31 - 1
"""The largest pid a process can have (Linux's limit is lower; ``kill`` takes a C int)."""


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists. A number that no process can have (0, negative, or
    above :data:`PID_MAX`, as a hostile peer or file name may give) names none: ``kill``
    would signal a process group, or overflow."""
    if not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_namespace() -> int:
    """The identity of this process's pid namespace (the inode of ``/proc/self/ns/pid``); 0
    where the system does not say."""
    try:
        inode = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0
    return inode if inode < 2**63 else 0
