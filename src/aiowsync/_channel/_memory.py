"""In-process twin of the control channel, for fast single-process tests.

It keeps the real channel's contract: frames are encoded and decoded with the real codec,
invalid frames are dropped and counted, receives honour deadlines without losing messages, and
heartbeats come from a thread. :meth:`MemoryChannelFactory.inject` puts raw bytes on a sender's
queue, as a hostile peer on a socket would.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import threading
import weakref
from collections.abc import Callable

from .._exceptions import NotConnectedError, TransportError
from .._protocol import Heartbeat, Message, encode
from ._base import ChannelFactory, PeerId, ReceiverChannel, SenderChannel, timeout_error

__all__ = ["MemoryChannelFactory"]

_JOIN_WAIT = 5.0
"""Seconds ``close()`` waits for a beat thread, which wakes at once when told to stop."""

_Item = tuple[PeerId, bytes]
_CLOSED: _Item = (b"", b"")  # queued by close() to wake a pending recv; compared by identity


async def _get(queue: asyncio.Queue[_Item], timeout: float | None) -> _Item:
    try:
        return await asyncio.wait_for(queue.get(), None if timeout is None else timeout)
    except TimeoutError:
        raise timeout_error("message", timeout) from None


_factories: weakref.WeakValueDictionary[str, MemoryChannelFactory] = weakref.WeakValueDictionary()
"""This process's factories by token, for unpickling."""
_factory_ids = itertools.count(1)


def _factory(token: str) -> MemoryChannelFactory:
    # A forked child inherits the registry, but not the loop the factory's channels run on.
    factory = _factories.get(token) if token.startswith(f"{os.getpid()}-") else None
    if factory is None:
        raise TransportError(
            "a MemoryChannelFactory works within one process: this scheme was pickled in "
            "another (or its factory is gone); use ZeroMQ channels across processes"
        )
    return factory


class MemorySenderChannel(SenderChannel):
    def __init__(self, factory: MemoryChannelFactory, address: str) -> None:
        super().__init__()
        self.address = address
        self._factory = factory
        self._loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue[_Item] = asyncio.Queue()
        self.peers: dict[PeerId, MemoryReceiverChannel] = {}

    def deliver(self, peer: PeerId, frame: bytes) -> None:
        """Thread-safe: queue ``frame`` as if it came from ``peer``."""
        if not self.closed:
            self._loop.call_soon_threadsafe(self.inbox.put_nowait, (peer, frame))

    async def send_frame(self, peer: PeerId, frame: bytes, *, timeout: float | None) -> None:
        if self.closed:
            raise TransportError("channel is closed")
        target = self.peers.get(peer)
        if target is None or target.closed:
            raise TransportError(f"peer {peer.hex()} is not connected")
        target.inbox.put_nowait((b"", frame))
        await asyncio.sleep(0)

    async def recv(self, *, timeout: float | None) -> tuple[PeerId, Message]:
        deadline = asyncio.get_running_loop().time() + (math.inf if timeout is None else timeout)
        while True:
            if self.closed:
                raise TransportError("channel is closed")
            remaining = None if timeout is None else max(0.0, deadline - self._loop.time())
            item = await _get(self.inbox, remaining)
            if item is _CLOSED or self.closed:
                raise TransportError("channel is closed")
            peer, frame = item
            message = self._decode_or_drop(frame, f"peer {peer.hex()}")
            if message is not None:
                return peer, message

    def recv_nowait(self) -> tuple[PeerId, Message] | None:
        while not self.inbox.empty():
            peer, frame = self.inbox.get_nowait()
            message = self._decode_or_drop(frame, f"peer {peer.hex()}")
            if message is not None:
                return peer, message
        return None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.inbox.put_nowait(_CLOSED)
        self._factory._senders.pop(self.address, None)


class MemoryReceiverChannel(ReceiverChannel):
    def __init__(self, sender: MemorySenderChannel, peer: PeerId) -> None:
        super().__init__()
        self._sender = sender
        self._peer = peer
        self.inbox: asyncio.Queue[_Item] = asyncio.Queue()
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None
        sender.peers[peer] = self

    async def send(self, message: Message, *, timeout: float | None) -> None:
        self.send_nowait(message)
        await asyncio.sleep(0)

    def send_nowait(self, message: Message) -> bool:
        if self.closed:
            raise TransportError("channel is closed")
        if self._sender.closed:
            raise NotConnectedError("sender is gone")
        self._sender.deliver(self._peer, encode(message))
        return True

    async def recv(self, *, timeout: float | None) -> Message:
        deadline = asyncio.get_running_loop().time() + (math.inf if timeout is None else timeout)
        while True:
            if self.closed:
                raise TransportError("channel is closed")
            remaining = None
            if timeout is not None:
                remaining = max(0.0, deadline - asyncio.get_running_loop().time())
            item = await _get(self.inbox, remaining)
            if item is _CLOSED or self.closed:
                raise TransportError("channel is closed")
            _, frame = item
            message = self._decode_or_drop(frame, "sender")
            if message is not None:
                return message

    @property
    def peer_alive(self) -> bool:
        return not self.closed and not self._sender.closed

    def start_heartbeat(self, beat: Callable[[], Heartbeat], interval: float) -> None:
        beat_peer = self._peer + b"/beat"

        def run() -> None:
            while True:
                self._sender.deliver(beat_peer, encode(beat()))
                if self._beat_stop.wait(interval):
                    return

        self._beat_thread = threading.Thread(target=run, name="aiowsync-heartbeat", daemon=True)
        self._beat_thread.start()

    def stop_heartbeat(self) -> None:
        self._beat_stop.set()

    def close(self, *, flush: float = 0.0) -> None:
        del flush  # delivery is immediate: nothing is ever left queued
        if not self.closed:
            self.closed = True
            self.inbox.put_nowait(_CLOSED)
        self._beat_stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join(timeout=_JOIN_WAIT)
        self._sender.peers.pop(self._peer, None)


class MemoryChannelFactory(ChannelFactory):
    """Channels that live in this process; addresses look like ``mem://1``.

    A scheme built on one pickles (a receiver can be made from the pickled sender, as with
    the other channels), but only within this process: the pickle names the factory, whose
    channels cannot leave it, and unpickling it in another process raises
    :class:`~aiowsync.TransportError`.
    """

    def __init__(self) -> None:
        self._senders: dict[str, MemorySenderChannel] = {}
        self._ids = itertools.count(1)
        self._token = f"{os.getpid()}-{next(_factory_ids)}"
        _factories[self._token] = self

    def __reduce__(self) -> tuple[Callable[[str], MemoryChannelFactory], tuple[str]]:
        return _factory, (self._token,)

    def check_address(self, address: str, *, bind: bool) -> None:
        # A sender binds a fresh mem:// name whatever it is given (schemes default to tcp).
        if not bind and not (isinstance(address, str) and address.startswith("mem://")):
            raise ValueError(
                f"{address!r} is not an address of in-process channels: they look like mem://1"
            )

    def bind(
        self, address: str, *, heartbeat_timeout: float, max_message: int | None = None
    ) -> SenderChannel:
        if not address.startswith("mem://") or address in ("mem://", "mem://0"):
            address = f"mem://{next(self._ids)}"
        if address in self._senders:
            raise TransportError(f"{address} is already bound")
        channel = MemorySenderChannel(self, address)
        self._senders[address] = channel
        return channel

    def connect(self, address: str, *, heartbeat_timeout: float) -> ReceiverChannel:
        sender = self._senders.get(address)
        if sender is None:
            raise NotConnectedError(f"nothing is bound at {address}")
        return MemoryReceiverChannel(sender, f"peer-{next(self._ids)}".encode())

    def inject(self, address: str, frame: bytes, peer: PeerId = b"intruder") -> None:
        """Put raw bytes on the sender's queue, as an unauthenticated peer would."""
        self._senders[address].deliver(peer, frame)
