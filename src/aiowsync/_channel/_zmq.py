"""The ZeroMQ control channel: a ROUTER bound by the sender, one DEALER per receiver.

Receiving never uses a pending ``recv`` future: the socket is polled for readability (which
consumes nothing) and then read without blocking. A poll cancelled by a deadline therefore
cannot swallow a message, which a cancelled ``recv_multipart`` future can.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import ipaddress
import logging
import math
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import zmq
from zmq.utils.monitor import parse_monitor_message

from .._auth import CurveKeys, CurveServer, SameUserServer, check_server_keys, client_options
from .._exceptions import TransportError, WeightSyncTimeout
from .._protocol import MAX_FRAME, Heartbeat, Message, encode
from .._signal import Signal
from ._base import ChannelFactory, PeerId, ReceiverChannel, SenderChannel, timeout_error

__all__ = ["LOCAL_BIND", "ZmqChannelFactory", "is_loopback_address", "resolve_local"]

log = logging.getLogger("aiowsync.channel")

# Plain ints: zmq's enum flags cost more than the system calls on this hot path.
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_DOWN_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


_MONITOR_PERIOD = 1.0
"""Seconds between two reads of a receiver's connection monitor, at most. libzmq queues an
event per reconnection attempt (ten a second) and stalls once a few thousand are unread."""


LOCAL_BIND = "ipc://@*"
"""Bind a fresh, uniquely named socket that only this host can reach: on Linux an abstract Unix
socket (reachable from this network namespace, no file to clean up, gone when closed), a
loopback TCP port elsewhere."""


_PEER_CREDENTIALS = sys.platform.startswith("linux")
"""Whether libzmq reports a Unix-socket peer's uid to the ZAP handler here (from
``SO_PEERCRED``; the format elsewhere is not relied on)."""


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


def _unpredictable_generated_ids() -> None:
    """Seed the C library's ``rand()`` from the OS before a ROUTER is made.

    A ROUTER names a peer that brings no routing id of its own ``0x00`` + a counter, which
    libzmq starts at ``rand()``; nobody seeds ``rand()``, so the counter starts at the same
    value in every process. A peer that picks the next such name as its own routing id makes
    the ROUTER meet it twice, and libzmq aborts the whole process on that (an assertion). From
    an unpredictable start, that name cannot be guessed.
    """
    global _libc_srand
    if _libc_srand is None:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc_srand = libc.srand
            _libc_srand.argtypes = [ctypes.c_uint]
            _libc_srand.restype = None
        except (OSError, AttributeError):
            _libc_srand = False
    if _libc_srand:
        _libc_srand(secrets.randbits(32))


_libc_srand: Any = None


def _own_routing_id() -> bytes:
    """A routing id for a receiver's socket: ``0x01`` + 15 random bytes, never the ``0x00``
    form a ROUTER makes up for peers that bring none."""
    return b"\x01" + secrets.token_bytes(15)


_DROPS_PER_TURN = 64
"""Malformed messages read in a row before the event loop gets a turn."""


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _base_options(sock: zmq.Socket[Any], heartbeat_timeout: float) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(heartbeat_timeout / 3))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(heartbeat_timeout))
    sock.setsockopt(zmq.HEARTBEAT_TTL, _ms(heartbeat_timeout))


class _ZmqEnd:
    """Wait-then-read helpers over one plain zmq socket driven by the running event loop.

    The socket's file descriptor is registered with the loop once. It only signals that the
    socket's state *may* have changed. A receive therefore first reads the socket's state
    (``zmq.EVENTS``), which also drains its pending commands so that the descriptor is quiet
    until something new happens, and reads without blocking only when a message is there.
    Every send and receive wakes the other waiters to re-check, since it may have consumed the
    signal they needed.
    Nothing is read while waiting, so a wait cancelled by a deadline loses no message.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> None:
        self._ctx = ctx
        self._sock: zmq.Socket[bytes] = ctx.socket(kind)
        self._fd = int(self._sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = Signal()
        # One deadline timer for all waiters, armed for the earliest deadline not yet passed
        # (a timer per wait cost more than the wait on this path).
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def _wake(self) -> None:
        self._changed.notify()

    def _notify_waiters(self) -> None:
        """Wake every waiter, whatever it waits for (a deadline passed, the socket closed)."""
        self._changed.notify()

    def _someone_waits(self) -> bool:
        return self._changed.waiting

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self._notify_waiters()

    def _ready(self, event: int) -> bool:
        """Whether the socket can do ``event`` now (reading its state also resets the
        descriptor's signal, like a read that finds nothing)."""
        if self._sock.closed:
            raise TransportError("channel is closed")
        return bool(self._sock.getsockopt(_EVENTS) & event)  # type: ignore[operator]

    async def _wait(self, event: int, deadline: float) -> None:
        while not self._ready(event):
            await self._signalled(deadline)

    async def _signalled(self, deadline: float, signal: Signal | None = None) -> None:
        """Wait until the descriptor fires, another operation ran, or ``deadline`` passed
        (``signal``: what the wait listens to, by default what :meth:`_wake` notifies).

        May also return early (another waiter's deadline): callers check and wait again.
        """
        loop = asyncio.get_running_loop()
        if self._loop is None:
            loop.add_reader(self._fd, self._wake)
            self._loop = loop
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        if deadline < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer, self._timer_at = loop.call_later(remaining, self._on_timer), deadline
        await (self._changed if signal is None else signal).wait()

    def _try_send(self, *frames: bytes) -> bool:
        """Queue one message of ``frames`` if the socket takes it now; False if it has no room.

        Plain calls, since ``send_multipart`` builds flag enums for every frame. A ROUTER
        refuses a message at its first frame or not at all, so False never leaves half of one.
        """
        if self._sock.closed:
            raise TransportError("channel is closed")
        try:
            for frame in frames[:-1]:
                self._sock.send(frame, _NOBLOCK | _SNDMORE)
            self._sock.send(frames[-1], _NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise TransportError(f"send failed: {exc}") from None
        finally:
            self._after_io()
        return True

    async def _send_frames(self, frames: list[bytes], timeout: float | None) -> None:
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
        while not self._try_send(*frames):
            if self._ready(_POLLOUT):
                # The socket has room but this peer's queue is full (a ROUTER queues per peer):
                # that peer has stopped reading, and no event will say when it resumes.
                raise WeightSyncTimeout("the peer is not reading its messages")
            try:
                await self._wait(_POLLOUT, deadline)
            except TimeoutError:
                raise timeout_error("room to send", timeout) from None

    async def _recv_frames(self, timeout: float | None) -> list[bytes]:
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
        while True:
            # Look before reading: a read that finds nothing costs an exception, and most
            # wake-ups of the descriptor (say, after our own send) bring nothing to read.
            if self._ready(_POLLIN):
                frames = self._recv_frames_nowait()
                if frames is not None:
                    return frames
            try:
                await self._signalled(deadline)
            except TimeoutError:
                raise timeout_error("message", timeout) from None

    def _recv_frames_nowait(self) -> list[bytes] | None:
        if self._sock.closed:
            raise TransportError("channel is closed")
        try:
            # With nothing to read, zmq processes the socket's pending commands before it
            # gives up, which also resets the descriptor that _signalled() waits on.
            return self._sock.recv_multipart(_NOBLOCK)
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            raise TransportError(f"receive failed: {exc}") from None
        finally:
            self._after_io()

    def _after_io(self) -> None:
        # An operation may consume the fd's edge that another waiter needed: let them re-check.
        if self._loop is not None and self._someone_waits():
            self._loop.call_soon(self._wake)

    def _close_socket(self, linger_ms: int = 0) -> None:
        if self._sock.closed:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self._fd)
        self._sock.close(linger=linger_ms)
        # Waiters wake, look at the socket again, and raise TransportError: it is closed.
        self._notify_waiters()


class ZmqSenderChannel(_ZmqEnd, SenderChannel):
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        heartbeat_timeout: float,
        curve: CurveKeys | None = None,
        *,
        other_users: bool = False,
    ) -> None:
        address = resolve_local(address)
        self._auth: CurveServer | SameUserServer | None = None
        try:
            if curve is not None:
                self._auth = CurveServer(ctx, curve)
            elif urlsplit(address).scheme == "ipc" and not other_users and _PEER_CREDENTIALS:
                self._auth = SameUserServer(ctx)
        except BaseException:
            ctx.term()
            raise
        _unpredictable_generated_ids()
        _ZmqEnd.__init__(self, ctx, zmq.ROUTER)
        SenderChannel.__init__(self)
        try:
            _base_options(self._sock, heartbeat_timeout)
            if self._auth is not None:
                self._auth.apply(self._sock)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Receivers keep their routing id across reconnections (see the receiver channel);
            # the newest connection under an id takes it over.
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME + 1024)
            if urlsplit(address).scheme == "tcp" and urlsplit(address).port in (None, 0):
                host = address.rsplit(":", 1)[0] if address.count(":") > 1 else address
                self._sock.bind(f"{host}:*")
            else:
                self._sock.bind(address)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot bind {address}: {exc}") from None
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def send(self, peer: PeerId, message: Message, *, timeout: float | None) -> None:
        await self._send_frames([peer, encode(message)], timeout)

    def send_nowait(self, peer: PeerId, message: Message) -> bool:
        return self._try_send(peer, encode(message))

    async def recv(self, *, timeout: float | None) -> tuple[PeerId, Message]:
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
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
            if not self._ready(_POLLIN) or (frames := self._recv_frames_nowait()) is None:
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
        return None if message is None else (frames[0], message)

    def close(self) -> None:
        self.closed = True
        self._close_socket()
        if self._auth is not None:
            self._auth.close()
        self._ctx.term()


class ZmqReceiverChannel(_ZmqEnd, ReceiverChannel):
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        heartbeat_timeout: float,
        curve_options: dict[int, bytes] | None = None,
    ) -> None:
        _ZmqEnd.__init__(self, ctx, zmq.DEALER)
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
        # The sender counts as reached once the ZMTP handshake (and the CURVE check) passed.
        events = zmq.EVENT_HANDSHAKE_SUCCEEDED | _DOWN_EVENTS
        # Keep the owning socket: if it were only referenced by self._sock, disable_monitor()
        # would drop it unclosed (ResourceWarning, and a second close of the same handle).
        self._monitor_owner = self._sock.get_monitor_socket(events)
        self._monitor: zmq.Socket[bytes] = self._monitor_owner
        # The monitor must be read all the time, not only when the loop asks: libzmq's thread
        # blocks, holding a lock that closing the socket needs, once a few thousand events are
        # unread, and a receiver that outlives its sender gets one per reconnection attempt
        # (ten a second). The loop and the beat thread both read it, one at a time.
        self._monitor_lock = threading.Lock()
        # Messages arriving while a recv() waits may be handled right in the descriptor's
        # callback (take_inline); the waiting recv() then listens to a signal of its own.
        self._incoming = Signal()
        self._handler: Callable[[Message], bool] | None = None
        self._receiving = False
        self._handing = False
        self._held: collections.deque[Message] = collections.deque()
        self._alive = False
        self._connections = 0
        self._beat: tuple[Callable[[], Heartbeat], float] | None = None
        self._watch_stop = False
        self._watch_wake = threading.Event()
        self._watch_thread: threading.Thread | None = None
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot connect to {address}: {exc}") from None
        # From now on, connection attempts queue monitor events, the handshake not yet done.
        self._watch_thread = threading.Thread(
            target=self._watch, name="aiowsync-heartbeat", daemon=True
        )
        self._watch_thread.start()

    def _set_curve(self, sock: zmq.Socket[bytes]) -> None:
        for option, value in self._curve_options.items():
            sock.setsockopt(option, value)

    async def send(self, message: Message, *, timeout: float | None) -> None:
        await self._send_frames([encode(message)], timeout)

    def send_nowait(self, message: Message) -> bool:
        return self._try_send(encode(message))

    async def recv(self, *, timeout: float | None) -> Message:
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
        self._receiving = True
        try:
            while True:
                # A message the handler left for us came before anything still in the socket.
                if self._held:
                    return self._held.popleft()
                if self._ready(_POLLIN):
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
                if not self._ready(_POLLIN):
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
        if self.closed:
            return False
        self._read_monitor()
        return self._alive

    @property
    def connections(self) -> int:
        if not self.closed:
            self._read_monitor()
        return self._connections

    def _read_monitor(self) -> None:
        with self._monitor_lock:
            self._drain_monitor()

    def _drain_monitor(self) -> None:
        """Take in every queued event; the caller holds ``_monitor_lock``."""
        while not self._monitor.closed:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except (zmq.Again, zmq.ZMQError):
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._alive = True
                self._connections += 1
            elif event["event"] & _DOWN_EVENTS:
                self._alive = False

    def start_heartbeat(self, beat: Callable[[], Heartbeat], interval: float) -> None:
        if self._beat is not None:
            raise RuntimeError("heartbeat already running")
        self._beat = (beat, interval)
        self._watch_wake.set()

    def stop_heartbeat(self) -> None:
        self._beat = None  # read by the watch thread before each beat
        self._watch_wake.set()

    def _watch(self) -> None:
        """Thread: reads the monitor every :data:`_MONITOR_PERIOD` at most, from the channel's
        creation to its close, and sends the beats once :meth:`start_heartbeat` was called.

        Beats go out on a socket of their own (zmq sockets are not thread-safe, and the event
        loop may be busy), under an id of their own (the main socket's would take its place).
        A failure to beat is logged and ends the beats, never the monitor's reading.
        """
        sock: zmq.Socket[bytes] | None = None
        next_beat = 0.0
        try:
            while not self._watch_stop:
                self._read_monitor()
                wait = _MONITOR_PERIOD
                beating = self._beat  # once: stop_heartbeat() may clear it meanwhile
                if beating is not None:
                    beat, interval = beating
                    now = time.monotonic()
                    try:
                        if now >= next_beat:
                            if sock is None:
                                sock = self._beat_socket()
                            with contextlib.suppress(zmq.Again):
                                # Sender unreachable right now: the next beat tries again.
                                sock.send(encode(beat()), zmq.NOBLOCK)
                            next_beat = now + interval
                        wait = min(wait, max(0.0, next_beat - time.monotonic()))
                    except Exception as exc:
                        if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.ETERM:
                            return
                        log.warning("heartbeats stopped: %s", exc)
                        self._beat = None
                self._watch_wake.wait(wait)
                self._watch_wake.clear()
        finally:
            if sock is not None:
                sock.close(linger=0)

    def _beat_socket(self) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.ROUTING_ID, _own_routing_id())
            _base_options(sock, self._heartbeat_timeout)
            self._set_curve(sock)
            sock.setsockopt(zmq.SNDHWM, 8)
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
        self._watch_stop = True
        self._watch_wake.set()
        if self._watch_thread is not None:
            self._watch_thread.join(timeout=5)
        with self._monitor_lock:
            # Read what is queued first: libzmq's thread may be waiting for room to queue one
            # more event, holding the lock that disable_monitor() takes.
            self._drain_monitor()
            self._sock.disable_monitor()
            self._monitor_owner.close(linger=0)
        # Terminating the context waits for the socket's linger: the goodbye leaves first.
        self._close_socket(_ms(flush) if flush > 0 else 0)
        self._ctx.term()


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

    def bind(self, address: str, *, heartbeat_timeout: float) -> SenderChannel:
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
        )

    def connect(self, address: str, *, heartbeat_timeout: float) -> ReceiverChannel:
        options = None if self.curve is None else client_options(self.curve)
        return ZmqReceiverChannel(zmq.Context(), address, heartbeat_timeout, options)
