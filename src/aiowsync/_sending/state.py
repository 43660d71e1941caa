"""What the sender's engine shares with the pieces it runs: its control loop, its staging
and its retries.

:class:`SenderState` holds the tables they all work on (the peers, the pending sends, the
latest version, the channel once it serves). The engine creates it and hands it to the pieces,
so none of them holds the engine, and each can be built in a test from a plane, a layout and a
config alone.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from .._channel import SenderChannel
from .._config import Heartbeats, Timeouts
from .._planes.base import Params, SenderPlane
from .._planes.digest import Digests
from .._protocol import SENDER_INDEX, Heartbeat
from .._util.signal import Signal
from .._weights.layout import Layout
from .announce import Announcer
from .outcome import Answers
from .peers import Peer, PeerTable

__all__ = ["SenderState"]


@dataclass(slots=True, eq=False)
class SenderState:
    """The sender's shared tables; only the engine moves ``version`` and ``channel``."""

    plane: SenderPlane
    layout: Layout
    num_workers: int
    model_id: str
    timeouts: Timeouts
    beats: Heartbeats
    digests: Digests
    """Every update carries a digest of its version's bytes, which receivers check."""
    channel: SenderChannel | None = None
    """Set once the engine serves, cleared when it closes."""
    version: int = 0
    """The latest version announced (or staged at start)."""
    pending: dict[int, Answers] = field(default_factory=dict)
    """Sends still waiting for answers, by version."""
    proof: str = field(default_factory=lambda: secrets.token_hex(16))
    """Given to receivers in the welcome; every update and beat carries it."""
    peers: PeerTable = field(init=False)
    announcer: Announcer = field(init=False)
    _changed: Signal = field(init=False, default_factory=Signal)

    def __post_init__(self) -> None:
        self.peers = PeerTable(self.plane, self.beats, self._on_lost)
        self.announcer = Announcer(self.peers, self.timeouts)

    def notify(self) -> None:
        """Wake whoever waits for a worker's state or version to change."""
        self._changed.notify()

    async def changed(self, timeout: float | None = None) -> None:
        """Wait until a worker's state, version or leases change (at most ``timeout`` s)."""
        await self._changed.wait(timeout)

    def with_digest(self, version: int, params: Params) -> Params:
        """``params`` for an update of ``version``, with its digest when there is one."""
        return self.digests.add_to(version, params)

    def beat_for(self, peer: Peer) -> Heartbeat:
        """The sender's beat to ``peer``: its session, the latest version and the proof."""
        return Heartbeat(
            worker_idx=SENDER_INDEX, session=peer.session, version=self.version, proof=self.proof
        )

    def abandon_pending(self) -> None:
        """Settle every send still waiting: its silent workers count as lost (on close)."""
        for pending in self.pending.values():
            pending.lost |= set(pending.waiting)
            pending.waiting.clear()
            pending.done.set()
            pending.changed.notify()
        self.notify()  # and a connect() that waits for workers

    def _on_lost(self, peer: Peer) -> None:
        for pending in self.pending.values():
            if peer.worker_idx in pending.waiting:
                pending.lost.add(peer.worker_idx)
                pending.settle(peer.worker_idx)
        self.notify()
