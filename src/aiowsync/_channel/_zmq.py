"""The ZeroMQ control channel: one DEALER per receiver (the sender's ROUTER is
:mod:`._zmq_sender`'s), and the factory of both.

The waiting is :mod:`._fdwait`'s (nothing read while waiting, so no deadline loses a
message); a receiver's connection monitor and heartbeats are :mod:`._monitor`'s.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

import zmq

from .._exceptions import TransportError
from .._protocol import MAX_FRAME, Heartbeat, Message, encode
from .._util.sched import zmq_io_threads
from .._util.signal import Signal
from ._address import (
    LOCAL_BIND,
    check_zmq_address,
    is_loopback_address,
    resolve_local,
    transport,
)
from ._auth import CurveKeys, check_server_keys, client_options
from ._base import ChannelFactory, ReceiverChannel, SenderChannel, timeout_error
from ._fdwait import POLLIN, ZmqEnd, deadline_after
from ._monitor import ConnectionWatch
from ._waker import Waker, wakers_enabled
from ._zmq_options import (
    BEATS_QUEUED,
    DROPS_PER_TURN,
    base_options,
    ip_version_for,
    ms,
    own_routing_id,
    terminate,
)
from ._zmq_sender import ZmqSenderChannel

__all__ = ["LOCAL_BIND", "ZmqChannelFactory", "is_loopback_address", "resolve_local"]

log = logging.getLogger("aiowsync.channel")

_base_options = base_options
"""The settings every socket of ours gets (a module attribute: tests may wrap it)."""


class ZmqReceiverChannel(ZmqEnd, ReceiverChannel):
    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        address: str,
        heartbeat_timeout: float,
        curve_options: dict[int, bytes] | None = None,
    ) -> None:
        self._io_before = zmq_io_threads()
        ZmqEnd.__init__(self, ctx, zmq.DEALER)
        ReceiverChannel.__init__(self)
        self._curve_options = curve_options or {}
        self._set_curve(self._sock)
        # A fixed, unguessable routing id: after a reconnection (say the process was stopped
        # long enough for the connection to time out) the sender still reaches this receiver.
        self._sock.setsockopt(zmq.ROUTING_ID, own_routing_id())
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
        self._waker: Waker | None = None
        try:
            ip_version_for(self._sock, address)
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self.close()
            raise TransportError(f"cannot connect to {address}: {exc}") from None
        self._watch.start()

    def _attached(self, loop: asyncio.AbstractEventLoop) -> None:
        super()._attached(loop)
        # Messages are handled by a thread of the channel's own while the loop waits for
        # events, and by the loop when it is busy (see ._waker). The waker watches the
        # descriptor instead of the loop: the loop is woken only for what a message leaves
        # it, and not at all for an update switched to inline.
        if self._waker is None and not self.closed and wakers_enabled(loop):
            loop.remove_reader(self._fd)
            self._waker = Waker(
                loop, self._fd, self._wake_from_thread, "aiowsync-waker", self._waker_failed
            )

    def _waker_failed(self) -> None:
        """The waker ended on an error: the loop watches the descriptor again."""
        if not self.closed and not self._sock.closed and self._loop is not None:
            self._loop.add_reader(self._fd, self._wake)
            self._wake()

    def _wake_from_thread(self) -> None:
        """What the loop's reader callback did, after taking the descriptor's signal (else
        it would fire again at once). Runs on the waker holding the loop's gate, or on the
        loop itself when it was busy."""
        if self._sock.closed:
            return
        try:
            self._ready(POLLIN)
            self._wake()
        except Exception:
            # The loop's waiters look at the socket again and meet the error themselves.
            self._notify_waiters()
            raise

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
            for _ in range(DROPS_PER_TURN):
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

    @property
    def changed_at(self) -> float | None:
        return self._watch.changed_at

    def start_heartbeat(self, beat: Callable[[], Heartbeat], interval: float) -> None:
        self._watch.start_heartbeat(beat, interval)

    def stop_heartbeat(self) -> None:
        self._watch.stop_heartbeat()

    def _beat_socket(self) -> zmq.Socket[bytes]:
        """A socket for the watch thread's beats, under an id of its own (the main socket's
        would take its place at the sender)."""
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.ROUTING_ID, own_routing_id())
            _base_options(sock, self._heartbeat_timeout)
            self._set_curve(sock)
            sock.setsockopt(zmq.SNDHWM, BEATS_QUEUED)
            # A beat is news only while it is fresh: with no live connection it is dropped,
            # not queued for whichever sender binds the address next.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            ip_version_for(sock, self._address)
            sock.connect(self._address)
        except BaseException:
            sock.close(linger=0)
            raise
        return sock

    def close(self, *, flush: float = 0.0) -> None:
        if self.closed:
            return
        self.closed = True
        if self._waker is not None:
            self._waker.stop()  # before the socket closes: it waits on its descriptor
        ended = self._watch.close()
        # Terminating the context waits for the socket's linger: the goodbye leaves first.
        self._close_socket(ms(flush) if flush > 0 else 0)
        terminate(self._ctx, wait=ended)


class ZmqChannelFactory(ChannelFactory):
    """Control channels over ZeroMQ (tcp or ipc), authenticated with CURVE on every tcp bind.

    A sender bound to a ``tcp://`` address, loopback included, is a CURVE server: it admits
    only the client public keys in ``curve.allowed_clients``, and every receiver socket is a
    CURVE client presenting ``curve``'s client key pair; traffic is then also encrypted.
    Without ``curve``, the factory makes keys of its own at its first tcp bind (``curve``
    then holds them), so that another local user who finds the port cannot join. Pickling the
    factory, or a scheme holding it, carries the keys a receiver needs and drops the server
    secret; a receiver built from a tcp address alone must be given the sender's keys, or
    :meth:`connect` raises ``ValueError`` naming them.

    ``allow_insecure_bind=True`` is the opt-out: no keys are made and tcp binds take every
    peer that reaches the port (receivers of such a sender pass it too). Keys given as
    ``curve`` are used on every address, ``ipc://`` included. Without them, a sender bound to
    a Unix socket (``ipc://``, the shared-memory scheme's default) admits only processes that
    run as its own user or as root: the kernel tells it who connects (Linux). See
    docs/security.md.

    Args:
        curve: the CURVE keys, see :class:`CurveKeys`; ``None`` (default): keys of the
            factory's own on tcp, none on Unix sockets.
        allow_insecure_bind: no authentication on tcp: any process that reaches the port
            can join (and receivers connect without keys). Only for a network you trust.
        allow_other_users: without ``curve``, let processes of any user connect to a sender
            bound to a Unix socket: an abstract one (``ipc://@name``), or a path in a
            directory they may enter. The default ``ipc://*`` lies in a directory of mode
            ``0700``, which keeps them out all the same.
    """

    _own_keys = False
    """``curve`` was made by this factory (or the one it was pickled from) for tcp binds."""

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

    def receiver_keys(self, address: str) -> CurveKeys | None:
        """The keys a receiver presents to the sender at ``address`` (None: it presents none).

        Raises:
            ValueError: ``address`` is a tcp sender's and this factory holds no keys (a
                receiver built from the address alone), naming what it must be given.
        """
        if self.curve is not None and not self._own_keys:
            return self.curve
        if not _is_tcp(address) or self.allow_insecure_bind:
            return None
        if self.curve is None:
            raise ValueError(
                f"the sender at {address} admits only workers holding its CURVE keys (every "
                "tcp:// sender does unless it opts out): give this receiver the sender's keys, "
                "either as the scheme the trainer pickled (it carries them) or as "
                "channels=ZmqChannelFactory(curve=keys) with keys = the trainer's "
                "scheme.channels.curve.for_receiver(); a sender built with "
                "ZmqChannelFactory(allow_insecure_bind=True) takes receivers built with it too"
            )
        return self.curve

    def check_receiver(self, address: str) -> None:
        keys = self.receiver_keys(address)
        if keys is not None:
            client_options(keys)  # keys given without a client key pair: refused here too

    def _sender_keys(self, address: str) -> CurveKeys | None:
        """The keys a sender bound to ``address`` serves with, made on the first tcp bind."""
        if self.curve is not None and not self._own_keys:
            check_server_keys(self.curve)
            return self.curve
        if not _is_tcp(address) or self.allow_insecure_bind:
            return None
        if self.curve is None:
            self.curve = CurveKeys.generate()
            self._own_keys = True
        if self.curve.server_secret is None:
            raise ValueError(
                "this ZmqChannelFactory came pickled from a sender: the keys it carries let "
                "its receivers in but cannot serve (pickling drops the server secret); give a "
                "scheme that binds here a ZmqChannelFactory() of its own"
            )
        return self.curve

    def bind(
        self, address: str, *, heartbeat_timeout: float, max_message: int | None = None
    ) -> SenderChannel:
        keys = self._sender_keys(address)  # before the context: a refusal leaves nothing open
        return ZmqSenderChannel(
            zmq.Context(),
            address,
            heartbeat_timeout,
            keys,
            other_users=self.allow_other_users,
            max_message=max_message,
        )

    def connect(self, address: str, *, heartbeat_timeout: float) -> ReceiverChannel:
        keys = self.receiver_keys(address)
        options = None if keys is None else client_options(keys)
        return ZmqReceiverChannel(zmq.Context(), address, heartbeat_timeout, options)


def _is_tcp(address: str) -> bool:
    return transport(address) == "tcp"
