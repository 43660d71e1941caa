"""ZeroMQ socket settings and process-wide measures shared by the control channels."""

from __future__ import annotations

import ctypes
import logging
import secrets
import sys
import threading
from typing import Any

import zmq

from .._util.libc import libc

__all__ = [
    "BEATS_QUEUED",
    "DROPS_PER_TURN",
    "HANDSHAKE_MS",
    "PEER_CREDENTIALS",
    "PIDS_KEPT",
    "QUEUED_PER_PEER",
    "OPEN_ABSTRACT_SOCKET_FILES",
    "base_options",
    "check_open_abstract_socket",
    "ms",
    "own_routing_id",
    "raise_open_files_limit",
    "terminate",
    "unpredictable_generated_ids",
]

log = logging.getLogger("aiowsync.channel")

PEER_CREDENTIALS = sys.platform.startswith("linux")
"""Whether libzmq reports a Unix-socket peer's uid to the ZAP handler here (from
``SO_PEERCRED``; the format elsewhere is not relied on)."""

DROPS_PER_TURN = 64
"""Malformed messages read in a row before the event loop gets a turn."""

PINGS_PER_TIMEOUT = 3
"""ZMTP pings sent within one heartbeat timeout, so that one late ping does not lose a peer."""

BEATS_QUEUED = 8
"""Beats a beat socket queues while the sender reads none; more would only be stale news."""

PIDS_KEPT = 4096
"""Routing ids whose kernel-given pid the sender remembers (the newest)."""

QUEUED_PER_PEER = 64
"""Messages one connection may have waiting at the sender (libzmq's default: 1000)."""

HANDSHAKE_MS = 5000
"""How long a connection may take over ZeroMQ's handshake (libzmq's default: 30 s)."""


def terminate(ctx: zmq.Context[zmq.Socket[bytes]], *, wait: bool) -> None:
    """Terminate ``ctx``. ``ctx.term()`` waits until every socket of the context is closed;
    when a thread of ours that holds one did not stop (``wait`` False), that could be for
    ever, so the context is terminated by a daemon thread instead, once that socket closes."""
    if wait:
        ctx.term()
        return
    log.warning("a channel thread did not stop; its ZeroMQ context ends when it does")
    threading.Thread(target=ctx.term, name="aiowsync-term", daemon=True).start()


def raise_open_files_limit() -> None:
    """Raise the soft limit on open files to the hard one, where it is lower: each peer
    connection costs the sender a descriptor, and libzmq aborts the process when it runs out
    (see ``aiowsync doctor``). Never lowered; a failure only leaves it as it was."""
    try:
        import resource
    except ImportError:  # not a Unix system
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):
            return
        log.debug("raised the open-files limit from %d to %d", soft, wanted)


OPEN_ABSTRACT_SOCKET_FILES = 1 << 16
"""The open-files limit below which an abstract socket open to other users is refused."""


def check_open_abstract_socket(address: str) -> None:
    """Refuse to bind an abstract Unix socket that admits other users' processes
    (``allow_other_users`` or CURVE keys) while this process may open fewer than
    :data:`OPEN_ABSTRACT_SOCKET_FILES` files.

    An abstract socket has no file permissions: any process of the network namespace can
    connect. libzmq aborts the whole process when accepting a Unix-socket connection finds
    no descriptor left (over TCP it drops the connection and goes on), and when other users
    are admitted nothing turns their connections away before the handshake, so another
    user's silent connections could use the descriptors up. (A socket file that only its
    user can write is safe: the kernel refuses other users' ``connect()``. One that others
    may write carries the same risk; this check cannot see its permissions.)"""
    try:
        import resource
    except ImportError:  # not a Unix system
        return
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft >= OPEN_ABSTRACT_SOCKET_FILES:
        return
    raise ValueError(
        f"{address} is an abstract socket open to other users' processes, and this process "
        f"may open only {soft} files: another user holding that many connections to it "
        "would make libzmq abort the process. Raise the hard open-files limit to at least "
        f"{OPEN_ABSTRACT_SOCKET_FILES} (ulimit -Hn, LimitNOFILE=, docker --ulimit nofile=), "
        "bind tcp:// with CURVE keys instead, or admit only this user (no "
        "allow_other_users, no CURVE keys)"
    )


def unpredictable_generated_ids() -> None:
    """Seed the C library's ``rand()`` from the OS before a ROUTER is made.

    A ROUTER names a peer that brings no routing id of its own ``0x00`` + a counter, which
    libzmq starts at ``rand()``; nobody seeds ``rand()``, so the counter starts at the same
    value in every process. A peer that picks the next such name as its own routing id makes
    the ROUTER meet it twice, and libzmq aborts the whole process on that (an assertion). From
    an unpredictable start, that name cannot be guessed.
    """
    c = libc()
    if c is not None:
        srand = c.srand
        srand.argtypes = [ctypes.c_uint]
        srand.restype = None
        srand(secrets.randbits(32))


def own_routing_id() -> bytes:
    """A routing id for a receiver's socket: ``0x01`` + 15 random bytes, never the ``0x00``
    form a ROUTER makes up for peers that bring none."""
    return b"\x01" + secrets.token_bytes(15)


def ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def ip_version_for(sock: zmq.Socket[Any], address: str) -> None:
    """Let ``sock`` use IPv6 where ``address`` names an IPv6 host (``tcp://[::1]:5555``).
    Only there: a socket with IPv6 on reports an IPv4 endpoint as ``[::ffff:a.b.c.d]``."""
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)


def base_options(sock: zmq.Socket[Any], heartbeat_timeout: float) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, ms(heartbeat_timeout / PINGS_PER_TIMEOUT))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms(heartbeat_timeout))
    sock.setsockopt(zmq.HEARTBEAT_TTL, ms(heartbeat_timeout))
