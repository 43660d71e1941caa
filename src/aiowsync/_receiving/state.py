"""What the receiver's engine shares with its update loop: the link to the sender.

:class:`ReceiverState` holds the connection, what the welcome said, whether the sender is
still there and what was refused from it. The engine creates it and hands it to the
:class:`~aiowsync._receiving.updates.UpdateLoop`, so the loop never holds the engine and can
be built in a test from a state, an applier and a lease count alone.

The version the model runs is the applier's; the methods that report it take it as an
argument rather than keeping a second copy here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .._channel import ReceiverChannel
from .._config import Heartbeats, Timeouts
from .._exceptions import NotConnectedError, SenderGoneError
from .._protocol import Connection, Heartbeat, Role
from .._util.signal import Signal
from .activity import Activity

__all__ = ["ReceiverState"]


@dataclass(slots=True, eq=False)
class ReceiverState:
    """One receiver's link to its sender; the engine sets ``channel``, ``session`` and
    ``proof``, the update loop records what the sender does afterwards."""

    worker_idx: int
    address: str
    timeouts: Timeouts
    beats: Heartbeats
    conn: Connection = field(init=False)
    """The protocol's state machine: every message sent or received passes it."""
    channel: ReceiverChannel | None = None
    """Set by ``connect()``, cleared when the receiver closes."""
    session: str = ""
    proof: str = ""
    """The sender's secret from the welcome: updates and beats must carry it."""
    bye: str | None = None
    """Why this receiver takes nothing more from its sender (its goodbye, a broken protocol,
    an impostor); None while it does."""
    said_bye: bool = False
    """The sender ended it with a goodbye (rather than breaking the protocol)."""
    confirmed: int = -1
    """The count of connections to the sender when it last showed that it knows this
    worker's session (see :meth:`gone`)."""
    connections_seen: int = 0
    """The count of connections when the update loop last announced itself on one."""
    protocol_errors: int = 0
    impostors: int = 0
    """Updates refused for not carrying ``proof``."""
    _unsure_since: float | None = field(init=False, default=None)
    """Since when the connection is down or renewed without the sender's confirmation
    (None while it is confirmed)."""
    activity: Activity = field(init=False, default_factory=Activity)
    """What the worker is busy with, for its beats."""
    _changed: Signal = field(init=False, default_factory=Signal)

    def __post_init__(self) -> None:
        self.conn = Connection(Role.RECEIVER, self.worker_idx)

    def notify(self) -> None:
        """Wake whoever waits for the version or the sender's state to change."""
        self._changed.notify()

    async def changed(self) -> None:
        """Wait for the next :meth:`notify`."""
        await self._changed.wait()

    @property
    def dropped(self) -> int:
        """Messages from the sender's address that were not taken."""
        channel = self.channel
        dropped = self.protocol_errors + self.impostors
        return dropped + (0 if channel is None else channel.dropped)

    def heartbeat(
        self, version: int, leased: tuple[int, ...] | None = None, doing: str = ""
    ) -> Heartbeat:
        """This worker's beat, saying that it runs ``version`` (and what it is doing)."""
        return Heartbeat(
            worker_idx=self.worker_idx,
            session=self.session,
            version=max(version, 0),
            leased=leased,
            doing=doing[:200],
        )

    def gone(self, version: int) -> SenderGoneError | None:
        """Why this worker's sender is gone (said goodbye, or lost), or None while it is not;
        the error says that the model keeps ``version``.

        Lost means the connection was not confirmed for the heartbeat timeout: down all that
        time, or renewed by the transport without the sender's beat naming this worker's
        session (a sender restarted on the same address never sends one). Shorter gaps, as
        a renewal whose confirming beat is on its way, do not count, as on the sender's side
        a worker is lost only after that much silence.
        """
        keeps = max(version, 0)
        if self.bye is not None:
            return SenderGoneError(self.worker_idx, keeps, self.bye, closed=self.said_bye)
        channel = self.channel
        if channel is None:
            return None
        alive = channel.peer_alive
        if alive and channel.connections == self.confirmed:
            self._unsure_since = None
            return None
        now = time.monotonic()
        if self._unsure_since is None:
            # From when the connection dropped (or was renewed), where the transport knows:
            # a receiver first asked long after its sender died is not given the time again.
            self._unsure_since = min(now, channel.changed_at or now)
        timeout = self.beats.timeout
        if now - self._unsure_since <= timeout:
            return None
        why = (
            f"the connection to {self.address} came back, but the sender has not recognised "
            f"this worker for {timeout:g} s"
            if alive
            else f"no connection to {self.address} for {timeout:g} s"
        )
        return SenderGoneError(self.worker_idx, keeps, why, closed=False)

    def check_sender(self, version: int) -> None:
        """Raise :class:`SenderGoneError` if the sender is gone, :class:`NotConnectedError`
        if this receiver is closed."""
        if self.channel is None:
            raise NotConnectedError(f"worker {self.worker_idx}: this receiver is closed")
        if (why := self.gone(version)) is not None:
            raise why
