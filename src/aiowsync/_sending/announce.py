"""Putting a version's announcement on the control channel, peer by peer."""

from __future__ import annotations

from collections.abc import Sequence

from .._channel import SenderChannel
from .._config import Timeouts
from .._exceptions import TransportError, WeightSyncError
from .._protocol import Update
from .peers import Peer, PeerTable

__all__ = ["Announcer"]


class Announcer:
    """Announces updates to peers; a peer whose socket cannot take one is declared lost."""

    def __init__(self, peers: PeerTable, timeouts: Timeouts) -> None:
        self._peers = peers
        self._timeouts = timeouts

    async def all(
        self, channel: SenderChannel, peers: Sequence[Peer], update: Update, *, queued: bool = False
    ) -> None:
        """Announce ``update`` to ``peers``; ``queued``: already recorded by :meth:`nowait`,
        which found no room."""
        for peer in peers:
            if queued or not self.nowait(channel, peer, update):
                await self._rest(channel, peer, update)

    def nowait(self, channel: SenderChannel, peer: Peer, update: Update) -> bool:
        """Record ``update`` as sent to ``peer`` and queue it; False if the socket has no room
        right now (then :meth:`all` with ``queued`` must finish the job)."""
        try:
            peer.conn.send(update)
            peer.inflight.add(update.version)
            return channel.send_nowait(peer.routing, update)
        except WeightSyncError as exc:
            self._failed(peer, exc)
            return True

    def offer(self, channel: SenderChannel, peer: Peer, update: Update) -> bool:
        """Queue ``update`` to ``peer`` if its socket has room now, and only then record it as
        sent: False leaves nothing done, to be offered again later."""
        try:
            if not channel.send_nowait(peer.routing, update):
                return False
            peer.conn.send(update)
            peer.inflight.add(update.version)
        except WeightSyncError as exc:
            self._failed(peer, exc)
        return True

    async def _rest(self, channel: SenderChannel, peer: Peer, update: Update) -> None:
        try:
            await channel.send(peer.routing, update, timeout=self._timeouts.control)
        except WeightSyncError as exc:
            self._failed(peer, exc)

    def _failed(self, peer: Peer, exc: WeightSyncError) -> None:
        if isinstance(exc, TransportError):
            self._peers.connection_closed(peer)
        self._peers.mark_lost(peer, f"update could not be sent: {exc}")
