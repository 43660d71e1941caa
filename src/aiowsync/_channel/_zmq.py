"""The ZeroMQ control channel: a ROUTER bound by the sender, one DEALER per receiver.

The waiting is :mod:`._fdwait`'s (nothing read while waiting, so no deadline loses a
message); a receiver's connection monitor and heartbeats are :mod:`._monitor`'s.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import logging
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import zmq

from .._auth import CurveKeys, CurveServer, SameUserServer, check_server_keys, client_options
from .._exceptions import TransportError
from .._libc import libc
from .._protocol import MAX_FRAME, Heartbeat, Message, encode
from .._signal import Signal
from ._address import (
    LOCAL_BIND,
    check_zmq_address,
    claim_socket_dir,
    is_loopback_address,
    remove_owned_socket_dir,
    resolve_local,
)
from ._base import ChannelFactory, PeerId, ReceiverChannel, SenderChannel, timeout_error
from ._fdwait import POLLIN, ZmqEnd, deadline_after
from ._monitor import ConnectionWatch

__all__ = ["LOCAL_BIND", "ZmqChannelFactory", "is_loopback_address", "resolve_local"]

log = logging.getLogger("aiowsync.channel")

_PEER_CREDENTIALS = sys.platform.startswith("linux")
"""Whether libzmq reports a Unix-socket peer's uid to the ZAP handler here (from
``SO_PEERCRED``; the format elsewhere is not relied on)."""

_DROPS_PER_TURN = 64
"""Malformed messages read in a row before the event loop gets a turn."""

_PINGS_PER_TIMEOUT = 3
"""ZMTP pings sent within one heartbeat timeout, so that one late ping does not lose a peer."""

_BEATS_QUEUED = 8
"""Beats a beat socket queues while the sender reads none; more would only be stale news."""

_PIDS_KEPT = 4096
"""Routing ids whose kernel-given pid the sender remembers (the newest)."""

_QUEUED_PER_PEER = 64
"""Messages one connection may have waiting at the sender (libzmq's default: 1000)."""

_HANDSHAKE_MS = 5000
"""How long a connection may take over ZeroMQ's handshake (libzmq's default: 30 s)."""


def _terminate(ctx: zmq.Context[zmq.Socket[bytes]], *, wait: bool) -> None:
    """Terminate ``ctx``. ``ctx.term()`` waits until every socket of the context is closed;
    when a thread of ours that holds one did not stop (``wait`` False), that could be for
    ever, so the context is terminated by a daemon thread instead, once that socket closes."""
    if wait:
        ctx.term()
        return
    log.warning("a channel thread did not stop; its ZeroMQ context ends when it does")
    threading.Thread(target=ctx.term, name="aiowsync-term", daemon=True).start()


def _raise_open_files_limit() -> None:
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


def _unpredictable_generated_ids() -> None:
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


def _own_routing_id() -> bytes:
    """A routing id for a receiver's socket: ``0x01`` + 15 random bytes, never the ``0x00``
    form a ROUTER makes up for peers that bring none."""
    return b"\x01" + secrets.token_bytes(15)


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _base_options(sock: zmq.Socket[Any], heartbeat_timeout: float) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(heartbeat_timeout / _PINGS_PER_TIMEOUT))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(heartbeat_timeout))
    sock.setsockopt(zmq.HEARTBEAT_TTL, _ms(heartbeat_timeout))


class ZmqSenderChannel(ZmqEnd, SenderChannel):
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        heartbeat_timeout: float,
        curve: CurveKeys | None = None,
        *,
        other_users: bool = False,
        max_message: int | None = None,
    ) -> None:
        address = resolve_local(address)
        self._pids: collections.OrderedDict[PeerId, int] = collections.OrderedDict()
        """By routing id, the pid the kernel gave for the peer's process (Unix sockets)."""
        try:
            self._socket_dir = claim_socket_dir(address)
            """The private directory of the socket, removed with it (see LOCAL_BIND)."""
        except OSError as exc:
            ctx.term()
            raise TransportError(f"cannot bind {address}: {exc}") from None
        _raise_open_files_limit()
        self._auth: CurveServer | SameUserServer | None = None
        try:
            if curve is not None:
                self._auth = CurveServer(ctx, curve)
            elif urlsplit(address).scheme == "ipc" and not other_users and _PEER_CREDENTIALS:
                self._auth = SameUserServer(ctx)
                self.user_ids = True  # the handler names each peer's process (its pid)
        except BaseException:
            ctx.term()
            raise
        _unpredictable_generated_ids()
        ZmqEnd.__init__(self, ctx, zmq.ROUTER)
        SenderChannel.__init__(self)
        try:
            _base_options(self._sock, heartbeat_timeout)
            if self._auth is not None:
                self._auth.apply(self._sock)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Receivers keep their routing id across reconnections (see the receiver channel);
            # the newest connection under an id takes it over.
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # A peer that sends more than the sender's receivers ever need to is cut off
            # before its message is read, and none may queue more than a few messages.
            limit = MAX_FRAME if max_message is None else min(max_message, MAX_FRAME)
            self._sock.setsockopt(zmq.MAXMSGSIZE, limit + 1024)
            self._sock.setsockopt(zmq.RCVHWM, _QUEUED_PER_PEER)
            # A connection that does not finish ZeroMQ's handshake (a peer that connects and
            # says nothing) is dropped after this long, giving back its descriptor.
            self._sock.setsockopt(zmq.HANDSHAKE_IVL, _HANDSHAKE_MS)
            if urlsplit(address).scheme == "tcp" and urlsplit(address).port in (None, 0):
                host = address.rsplit(":", 1)[0] if address.count(":") > 1 else address
                self._sock.bind(f"{host}:*")
            else:
                self._sock.bind(address)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot bind {address}: {exc}") from None
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def send_frame(self, peer: PeerId, frame: bytes, *, timeout: float | None) -> None:
        await self._send_frames([peer, frame], timeout)

    def send_nowait(self, peer: PeerId, message: Message) -> bool:
        return self._try_send(peer, encode(message))

    async def recv(self, *, timeout: float | None) -> tuple[PeerId, Message]:
        deadline = deadline_after(timeout)
        dropped = 0
        while True:
            remaining = None if timeout is None else max(0.0, deadline - time.monotonic())
            got = self._accept(await self._recv_frames(remaining))
            if got is not None:
                return got
            dropped += 1
            if dropped % _DROPS_PER_TURN == 0:
                # A peer sending junk as fast as it can must not keep the loop to itself,
                # nor this call past its deadline.
                await asyncio.sleep(0)
                if time.monotonic() >= deadline:
                    raise timeout_error("message", timeout)

    def recv_nowait(self) -> tuple[PeerId, Message] | None:
        for _ in range(_DROPS_PER_TURN):
            if not self._ready(POLLIN) or (frames := self._recv_frames_nowait()) is None:
                return None
            got = self._accept(frames)
            if got is not None:
                return got
        return None  # only junk so far: the rest waits for the next call

    def _accept(self, frames: list[bytes]) -> tuple[PeerId, Message] | None:
        if len(frames) != 2:
            self._count_drop("a message of %d frames", len(frames))
            return None
        message = self._decode_or_drop(frames[1], f"peer {frames[0].hex()}")
        if message is None:
            return None
        if self.user_ids:
            self._remember_pid(frames[0])
        return frames[0], message

    def _remember_pid(self, peer: PeerId) -> None:
        user = self.user_id or ""
        if user.startswith("pid:") and user[4:].isdigit():
            self._pids[peer] = int(user[4:])
            self._pids.move_to_end(peer)
            while len(self._pids) > _PIDS_KEPT:
                self._pids.popitem(last=False)

    def peer_pid(self, peer: PeerId) -> int | None:
        return self._pids.get(peer)

    def close(self) -> None:
        self.closed = True
        self._close_socket()
        stuck = False
        if self._auth is not None:
            self._auth.close()
            stuck = self._auth.stuck
        _terminate(self._ctx, wait=not stuck)
        if self._socket_dir is not None:
            remove_owned_socket_dir(self._socket_dir)
            self._socket_dir = None


class ZmqReceiverChannel(ZmqEnd, ReceiverChannel):
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        heartbeat_timeout: float,
        curve_options: dict[int, bytes] | None = None,
    ) -> None:
        ZmqEnd.__init__(self, ctx, zmq.DEALER)
        ReceiverChannel.__init__(self)
        self._curve_options = curve_options or {}
        self._set_curve(self._sock)
        # A fixed, unguessable routing id: after a reconnection (say the process was stopped
        # long enough for the connection to time out) the sender still reaches this receiver.
        self._sock.setsockopt(zmq.ROUTING_ID, _own_routing_id())
        _base_options(self._sock, heartbeat_timeout)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME + 1024)
        self._address = address
        self._heartbeat_timeout = heartbeat_timeout
        self._watch = ConnectionWatch(self._sock, self._beat_socket)
        # Messages arriving while a recv() waits may be handled right in the descriptor's
        # callback (take_inline); the waiting recv() then listens to a signal of its own.
        self._incoming = Signal()
        self._handler: Callable[[Message], bool] | None = None
        self._receiving = False
        self._handing = False
        self._held: collections.deque[Message] = collections.deque()
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot connect to {address}: {exc}") from None
        self._watch.start()

    def _set_curve(self, sock: zmq.Socket[bytes]) -> None:
        for option, value in self._curve_options.items():
            sock.setsockopt(option, value)

    async def send(self, message: Message, *, timeout: float | None) -> None:
        await self._send_frames([encode(message)], timeout)

    def send_nowait(self, message: Message) -> bool:
        return self._try_send(encode(message))

    async def recv(self, *, timeout: float | None) -> Message:
        deadline = deadline_after(timeout)
        self._receiving = True
        try:
            while True:
                # A message the handler left for us came before anything still in the socket.
                if self._held:
                    return self._held.popleft()
                if self._ready(POLLIN):
                    frames = self._recv_frames_nowait()
                    if frames is not None:
                        message = self._accept(frames)
                        if message is not None:
                            return message
                        continue
                try:
                    await self._signalled(deadline, self._incoming)
                except TimeoutError:
                    raise timeout_error("message", timeout) from None
        finally:
            self._receiving = False

    def take_inline(self, handler: Callable[[Message], bool] | None) -> None:
        self._handler = handler

    def _wake(self) -> None:
        handler = self._handler
        # The waiting recv() wakes unless every message went to the handler.
        if handler is None or not self._receiving or self._held or not self._hand_over(handler):
            self._incoming.notify()
        self._changed.notify()

    def _hand_over(self, handler: Callable[[Message], bool]) -> bool:
        """Give the messages waiting in the socket to ``handler``; False once one is held
        back for the waiting ``recv()``."""
        self._handing = True
        try:
            for _ in range(_DROPS_PER_TURN):
                if not self._ready(POLLIN):
                    return True
                frames = self._recv_frames_nowait()
                if frames is None:
                    return True
                message = self._accept(frames)
                if message is None:
                    continue
                try:
                    taken = handler(message)
                except Exception:
                    log.exception("the inline handler failed; the message goes to recv()")
                    taken = False
                if not taken:
                    self._held.append(message)
                    return False
        finally:
            self._handing = False
        # More is queued than one turn takes: the rest on the loop's next pass.
        if self._loop is not None:
            self._loop.call_soon(self._wake)
        return True

    def _notify_waiters(self) -> None:
        self._incoming.notify()
        self._changed.notify()

    def _someone_waits(self) -> bool:
        # While messages are handed over, the last look at the socket comes after the last
        # operation on it: nobody else needs waking for those.
        return not self._handing and (self._changed.waiting or self._incoming.waiting)

    def _accept(self, frames: list[bytes]) -> Message | None:
        if len(frames) != 1:
            self.dropped += 1
            return None
        return self._decode_or_drop(frames[0], "sender")

    @property
    def peer_alive(self) -> bool:
        return not self.closed and self._watch.alive

    @property
    def connections(self) -> int:
        return self._watch.connections

    def start_heartbeat(self, beat: Callable[[], Heartbeat], interval: float) -> None:
        self._watch.start_heartbeat(beat, interval)

    def stop_heartbeat(self) -> None:
        self._watch.stop_heartbeat()

    def _beat_socket(self) -> zmq.Socket[bytes]:
        """A socket for the watch thread's beats, under an id of its own (the main socket's
        would take its place at the sender)."""
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.ROUTING_ID, _own_routing_id())
            _base_options(sock, self._heartbeat_timeout)
            self._set_curve(sock)
            sock.setsockopt(zmq.SNDHWM, _BEATS_QUEUED)
            # A beat is news only while it is fresh: with no live connection it is dropped,
            # not queued for whichever sender binds the address next.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.connect(self._address)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def close(self, *, flush: float = 0.0) -> None:
        if self.closed:
            return
        self.closed = True
        ended = self._watch.close()
        # Terminating the context waits for the socket's linger: the goodbye leaves first.
        self._close_socket(_ms(flush) if flush > 0 else 0)
        _terminate(self._ctx, wait=ended)


class ZmqChannelFactory(ChannelFactory):
    """Control channels over ZeroMQ (tcp or ipc), optionally authenticated with CURVE.

    With ``curve`` set, the sender's socket is a CURVE server that admits only the client
    public keys in ``curve.allowed_clients``, and every receiver socket is a CURVE client
    presenting ``curve``'s client key pair; traffic is then also encrypted. The sender needs
    the keys with their server secret, a receiver only the server public key and a client key
    pair (pickling the factory, or a scheme holding it, drops the server secret).

    Binding an address that is not loopback requires ``curve``, or the explicit opt-out
    ``allow_insecure_bind=True``: anyone who can reach the port could otherwise join.
    Without ``curve``, a sender bound to a Unix socket (``ipc://``, the shared-memory
    scheme's default) admits only processes that run as its own user or as root: the kernel
    tells it who connects (Linux). See docs/security.md.

    Args:
        curve: the CURVE keys, see :class:`CurveKeys`; ``None`` leaves the channel
            unauthenticated (loopback only, unless ``allow_insecure_bind``).
        allow_insecure_bind: allow binding a non-loopback address without authentication.
        allow_other_users: without ``curve``, let processes of any user connect to a sender
            bound to a Unix socket.
    """

    def __init__(
        self,
        *,
        curve: CurveKeys | None = None,
        allow_insecure_bind: bool = False,
        allow_other_users: bool = False,
    ) -> None:
        if curve is not None and not isinstance(curve, CurveKeys):
            raise TypeError(f"curve must be CurveKeys or None, got {type(curve).__name__}")
        self.curve = curve
        self.allow_insecure_bind = allow_insecure_bind
        self.allow_other_users = allow_other_users

    def check_address(self, address: str, *, bind: bool) -> None:
        check_zmq_address(address, bind=bind)

    def bind(
        self, address: str, *, heartbeat_timeout: float, max_message: int | None = None
    ) -> SenderChannel:
        if self.curve is None:
            if not is_loopback_address(address) and not self.allow_insecure_bind:
                raise ValueError(
                    f"refusing to bind {address!r}: it is not a loopback address and no "
                    "authentication is configured; pass curve=CurveKeys.generate() to require "
                    "CURVE keys, or allow_insecure_bind=True to accept the risk"
                )
        else:
            check_server_keys(self.curve)
        return ZmqSenderChannel(
            zmq.Context(),
            address,
            heartbeat_timeout,
            self.curve,
            other_users=self.allow_other_users,
            max_message=max_message,
        )

    def connect(self, address: str, *, heartbeat_timeout: float) -> ReceiverChannel:
        options = None if self.curve is None else client_options(self.curve)
        return ZmqReceiverChannel(zmq.Context(), address, heartbeat_timeout, options)
