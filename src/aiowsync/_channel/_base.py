"""The control-channel interface the schemes are written against.

A :class:`ChannelFactory` binds one :class:`SenderChannel` (many peers, addressed by opaque peer
ids) and connects :class:`ReceiverChannel` objects to it. Frames are encoded and decoded inside
the channel; invalid frames are dropped, counted in ``dropped`` and logged, never raised to the
caller. Every blocking call takes its own ``timeout`` in seconds (``None`` waits until
cancelled, for background loops whose task group owns the deadline).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable

from .._exceptions import ProtocolError, WeightSyncTimeout
from .._protocol import Heartbeat, Message, Refuse, decode, encode
from .._util.text import worth_logging

__all__ = ["ChannelFactory", "PeerId", "ReceiverChannel", "SenderChannel"]

log = logging.getLogger("aiowsync.channel")

PeerId = bytes


class _Counting:
    """Decoding with the drop-and-count policy shared by every channel."""

    def __init__(self) -> None:
        self.dropped = 0
        self.closed = False

    def _decode_or_drop(self, frame: bytes, origin: str) -> Message | None:
        try:
            return decode(frame)
        except ProtocolError as exc:
            self._count_drop("a frame from %s: %s", origin, exc)
            return None

    def _count_drop(self, what: str, *args: object) -> None:
        self.dropped += 1
        if worth_logging(self.dropped):
            log.warning("dropped " + what + " (%d dropped so far)", *args, self.dropped)


class SenderChannel(_Counting, abc.ABC):
    """The sender's end: one bound socket, many receivers."""

    address: str

    async def send(self, peer: PeerId, message: Message, *, timeout: float | None) -> None:
        """Send to one peer; raises :class:`TransportError` if the peer is gone."""
        await self.send_frame(peer, encode(message), timeout=timeout)

    async def refuse(
        self, peer: PeerId, refusal: Refuse, *, protocol: int, timeout: float | None
    ) -> None:
        """Send ``refusal`` in the peer's own protocol version, which a peer of another
        version can still read (see :mod:`aiowsync._protocol._codec`)."""
        await self.send_frame(peer, encode(refusal, protocol=protocol), timeout=timeout)

    @abc.abstractmethod
    async def send_frame(self, peer: PeerId, frame: bytes, *, timeout: float | None) -> None:
        """Send one encoded frame to one peer; raises :class:`TransportError` if the peer is
        gone."""

    def peer_pid(self, peer: PeerId) -> int | None:
        """The pid of ``peer``'s process as the kernel gave it when it connected (Unix
        sockets, where the channel checks peers' users); None where the channel cannot tell."""
        del peer
        return None

    def keep_bound(self) -> None:
        """Called on every heartbeat period: a channel whose listening socket can be
        removed from under it (a file) binds it again."""

    def send_nowait(self, peer: PeerId, message: Message) -> bool:
        """Queue ``message`` only if that needs no wait; False when :meth:`send` must be used.

        Raises :class:`TransportError` if the peer is gone.
        """
        return False

    @abc.abstractmethod
    async def recv(self, *, timeout: float | None) -> tuple[PeerId, Message]:
        """Next valid message and its peer id; raises :class:`WeightSyncTimeout` at the deadline.

        A call cancelled (or timed out) while waiting loses no message.
        """

    @abc.abstractmethod
    def recv_nowait(self) -> tuple[PeerId, Message] | None:
        """A valid message already waiting, or ``None``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close at once, discarding anything in flight. Idempotent."""


class ReceiverChannel(_Counting, abc.ABC):
    """A receiver's end, connected to one sender."""

    @abc.abstractmethod
    async def send(self, message: Message, *, timeout: float | None) -> None: ...

    def send_nowait(self, message: Message) -> bool:
        """Queue ``message`` only if that needs no wait; False when :meth:`send` must be used."""
        return False

    @abc.abstractmethod
    async def recv(self, *, timeout: float | None) -> Message:
        """Next valid message; raises :class:`WeightSyncTimeout` at the deadline, losing nothing."""

    def take_inline(self, handler: Callable[[Message], bool] | None) -> None:
        """While a :meth:`recv` waits, hand each arriving message to ``handler`` on the loop.

        This saves the waiting task a wake-up per message. ``handler`` returns False for a
        message it leaves to that task: the waiting ``recv`` returns it, before anything that
        came later, and nothing more is handed over until then. ``None`` stops it. Channels
        may ignore the handler (this default does); every message then comes through
        ``recv``.
        """
        del handler

    @abc.abstractmethod
    def start_heartbeat(self, beat: Callable[[], Heartbeat], interval: float) -> None:
        """Send ``beat()`` every ``interval`` seconds from a thread, independent of the loop."""

    @abc.abstractmethod
    def stop_heartbeat(self) -> None:
        """Send no more beats (the sender said goodbye); everything else stays as it is."""

    @property
    @abc.abstractmethod
    def peer_alive(self) -> bool:
        """False once the transport saw the sender go away (process death, missed pings)."""

    @property
    def connections(self) -> int:
        """How many times the transport connection to the sender came up so far.

        A drop and a reconnection can both happen between two looks at :attr:`peer_alive`;
        a change of this count still shows that the connection was renewed.
        """
        return 1 if self.peer_alive else 0

    @property
    def changed_at(self) -> float | None:
        """When (``time.monotonic()``) the connection entered its present state, if the
        transport knows (None: it does not, and a receiver counts from when it first sees
        the state)."""
        return None

    @abc.abstractmethod
    def close(self, *, flush: float = 0.0) -> None:
        """Close. Idempotent. With ``flush``, messages already queued (a goodbye) get up to
        that many seconds to leave first; the call blocks that long at most."""


class ChannelFactory(abc.ABC):
    """Creates the two ends of a control channel for one transport."""

    def check_address(self, address: str, *, bind: bool) -> None:
        """Raise ``ValueError`` listing the accepted forms unless ``address`` is one this
        transport can ``bind`` (True) or connect to (False). Schemes call it when they are
        built, so that a typo fails there rather than at ``connect()``."""
        del address, bind

    def check_receiver(self, address: str) -> None:
        """Raise ``ValueError``, naming what is missing, unless a receiver of this factory
        holds what joining the sender at ``address`` takes (its CURVE keys, say).
        ``init_on_receiver`` calls it, so that a receiver without them fails there."""
        del address

    @abc.abstractmethod
    def bind(
        self, address: str, *, heartbeat_timeout: float, max_message: int | None = None
    ) -> SenderChannel:
        """The sender's end, bound to ``address`` (port 0: any free port; see ``.address``).

        Schemes resolve :data:`~aiowsync._channel.LOCAL_BIND` (``"ipc://*"``) and
        ``"ipc://@*"`` to a concrete address before they call this. ``max_message``: the
        largest message a peer may send, in bytes (the sender knows what its receivers need
        to say); a channel may refuse larger ones before reading them."""

    @abc.abstractmethod
    def connect(self, address: str, *, heartbeat_timeout: float) -> ReceiverChannel:
        """A receiver's end, connecting to a sender's ``address``."""


def timeout_error(what: str, timeout: float | None) -> WeightSyncTimeout:
    return WeightSyncTimeout(f"no {what} within {timeout:.3g} s" if timeout else f"no {what}")
