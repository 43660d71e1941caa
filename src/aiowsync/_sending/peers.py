"""The sender's table of receivers: who is connected, who is lost or gone, and which versions
their processes may still read."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .._channel import PeerId
from .._config import Heartbeats
from .._planes.base import SenderPlane
from .._protocol import Connection, State, Update
from .._util.text import excerpt

__all__ = ["DEAD_STATES", "LAG_IN_FLIGHT", "Peer", "PeerTable"]

log = logging.getLogger("aiowsync.sender")

DEAD_STATES = frozenset({State.ERROR, State.CLOSED})

LAG_IN_FLIGHT = 4
"""Where receivers read the sender's slots: a worker with this many versions announced and not
yet answered is announced no more; the newest version meant for it waits (one slot) until it
answers, and the versions between are skipped for it. A worker whose loop is blocked then pins
a few slots, not one per version published meanwhile."""


@dataclass(slots=True)
class Peer:
    worker_idx: int
    routing: PeerId
    conn: Connection
    session: str
    pid: int
    welcome_version: int
    last_seen: float
    ready: bool = False
    lost: bool = False
    """No update reaches it now (silent, disconnected, failed, replaced or gone)."""
    gone: bool = False
    """It can read nothing of the sender's any more (goodbye, exited, or disconnected from
    another host), so its versions need no pin."""
    inflight: set[int] = field(default_factory=set)
    """Versions announced to it and not yet answered."""
    host: str = ""
    leased: frozenset[int] = frozenset()
    """Versions its leases read in the sender's memory, as it last reported them."""
    deferred: Update | None = None
    """The newest version meant for it while it lags (see :data:`LAG_IN_FLIGHT`), announced
    once it has answered enough of those in flight; the versions between are skipped."""
    doing: str = ""
    """What its last beat said holds it up ('' when nothing does)."""
    warned_slow: bool = False
    """A send's warning named it as holding the send up, and it has not answered since."""
    announcing: bool = False
    """The deferred version is on its way to it (its socket had no room at once)."""
    failed: str = ""
    """Why it could not apply the last version it answered ('' when it applied it): told
    with its loss, which often follows (a worker that cannot apply its first one leaves)."""


class PeerTable:
    """Receivers by index and by routing id, with the rules of liveness.

    ``on_lost(peer)`` is called each time a peer is marked lost (the engine settles its waits).
    """

    def __init__(
        self, plane: SenderPlane, beats: Heartbeats, on_lost: Callable[[Peer], None]
    ) -> None:
        self._plane = plane
        self._beats = beats
        self._on_lost = on_lost
        self.by_index: dict[int, Peer] = {}
        self.by_routing: dict[PeerId, Peer] = {}
        self._retired: list[Peer] = []
        """Replaced peers whose process may still read the version it ran."""
        self.refused_at: dict[int, float] = {}
        """By worker index, when its last hello was refused (monotonic)."""
        self.notes: dict[int, str] = {}
        """By worker index, the last thing known that explains its state (a refusal, a
        loss, a goodbye), for the worker table and the sender's errors."""
        self.strays: dict[int, str] = {}
        """Indices out of the sender's range that hellos named (the latest few), with why
        they were refused: a worker numbered from 1 is often why another never came."""

    def get(self, worker: int) -> Peer | None:
        return self.by_index.get(worker)

    def values(self) -> list[Peer]:
        return list(self.by_index.values())

    def ready_workers(self) -> set[int]:
        return {w for w, p in self.by_index.items() if p.ready and not p.lost}

    def lost_workers(self) -> set[int]:
        return {w for w, p in self.by_index.items() if p.lost}

    def unavailable(self, targets: list[int]) -> list[int]:
        """Those of ``targets`` that an update cannot reach now."""
        peers = self.by_index
        return [
            w
            for w in targets
            if w not in peers or peers[w].lost or peers[w].conn.state in DEAD_STATES
        ]

    # -- joining and leaving ------------------------------------------------------------------

    def add(self, peer: Peer) -> None:
        self.notes.pop(peer.worker_idx, None)
        self.by_index[peer.worker_idx] = peer
        self.by_routing[peer.routing] = peer

    def replace(self, worker: int) -> None:
        """A new connection takes index ``worker``: its old holder is lost, and keeps its pins
        while its process may still read its version (see :meth:`_reads_still`)."""
        old = self.by_index.pop(worker, None)
        if old is None:
            return
        self.by_routing.pop(old.routing, None)
        self.mark_lost(old, "replaced by a new connection under the same index")
        if self.sees_processes(old) and not self.gone(old):
            self._retired.append(old)

    def _retirees(self) -> list[Peer]:
        """The replaced peers whose process may still read their versions."""
        self._retired = [p for p in self._retired if self._reads_still(p)]
        return self._retired

    def _reads_still(self, old: Peer) -> bool:
        """Whether a replaced peer's process may still read the versions it held: until the
        process ends, or, when the new connection is the same process joining again (a
        receiver that lost this sender for a while), until its model ran a version of the
        new connection (its leases of the old one were copied before it joined)."""
        if self.gone(old):
            return False
        new = self.by_index.get(old.worker_idx)
        return new is None or new.pid != old.pid or new.conn.acked_version < 0

    def said_goodbye(self, peer: Peer, reason: str) -> None:
        peer.gone = True
        self.by_routing.pop(peer.routing, None)
        self.mark_lost(peer, f"said goodbye ({reason or 'no reason'})", level=logging.INFO)

    # -- liveness -----------------------------------------------------------------------------

    def mark_lost(self, peer: Peer, why: str, *, level: int = logging.WARNING) -> None:
        if not peer.lost:
            log.log(level, "worker %d lost: %s", peer.worker_idx, excerpt(why))
            if self.by_index.get(peer.worker_idx) is peer:
                self.notes[peer.worker_idx] = why + (
                    f", after {peer.failed}" if peer.failed else ""
                )
        peer.lost = True
        peer.deferred = None
        self._plane.forget(peer.worker_idx)
        self._on_lost(peer)

    def check_liveness(self) -> None:
        for peer in self.values():
            if not peer.lost and self.is_late(peer):
                self.mark_lost(peer, f"no heartbeat for {self._beats.timeout:g} s")

    def is_late(self, peer: Peer) -> bool:
        return time.monotonic() - peer.last_seen > self._beats.timeout

    def connection_closed(self, peer: Peer) -> None:
        # Where the plane sees receiver processes, a closed connection proves nothing (a
        # stopped process loses its connection but still maps its slot); only the process's
        # exit or its goodbye does. Elsewhere the connection is all there is.
        if not self.sees_processes(peer):
            peer.gone = True

    def sees_processes(self, peer: Peer) -> bool:
        """Whether the plane can tell if ``peer``'s process still runs (same host)."""
        return self._plane.process_gone(peer.pid) is not None

    def gone(self, peer: Peer) -> bool:
        """True once ``peer`` can no longer read any slot, so its versions need no pin."""
        if not peer.gone and peer.pid and self._plane.process_gone(peer.pid):
            peer.gone = True
        return peer.gone

    def pinned_versions(self, current: int) -> set[int]:
        """``current`` and every version a receiver's process may still read."""
        pinned = {current}
        for peer in [*self.by_index.values(), *self._retirees()]:
            acked = peer.conn.acked_version
            if (
                acked in pinned
                and peer.inflight <= pinned
                and peer.leased <= pinned
                and (peer.deferred is None or peer.deferred.version in pinned)
            ):
                continue  # pins nothing more: no need to ask whether its process lives
            if self.gone(peer):
                continue
            pinned.add(acked)
            pinned |= peer.inflight
            pinned |= peer.leased
            if peer.deferred is not None:
                pinned.add(peer.deferred.version)
        return pinned

    def leases_text(self) -> str:
        """Who holds leases in the sender's memory, oldest lease first ('' if nobody)."""
        held = [
            (min(p.leased), p.worker_idx, sorted(p.leased))
            for p in [*self.by_index.values(), *self._retirees()]
            if p.leased and not self.gone(p)
        ]
        return "; ".join(
            f"worker {worker} holds a lease on version {oldest}"
            + (f" (its oldest; it leases versions {versions})" if len(versions) > 1 else "")
            for oldest, worker, versions in sorted(held)
        )

    def releasing(self) -> bool:
        """Some live receiver has versions still to answer or leases: a version in use may
        be released without a send."""
        return any(
            (p.inflight or p.leased or p.deferred) and not self.gone(p)
            for p in [*self.by_index.values(), *self._retirees()]
        )

    def holders_text(self, version: int) -> str:
        """Who keeps ``version`` in use, and how: runs it, has not answered it, leases it."""
        held = []
        everyone = [*self.by_index.values(), *self._retirees()]
        for peer in sorted(everyone, key=lambda p: p.worker_idx):
            if self.gone(peer):
                continue
            how = [
                what
                for what, holds in (
                    ("runs it", peer.conn.acked_version == version),
                    ("has not answered it yet", version in peer.inflight),
                    (
                        "will be sent it once it answers",
                        peer.deferred is not None and peer.deferred.version == version,
                    ),
                    ("holds a lease on it", version in peer.leased),
                )
                if holds
            ]
            if how:
                held.append(f"worker {peer.worker_idx} {' and '.join(how)}")
        return "; ".join(held) or "the latest version"

    @staticmethod
    def answered(peer: Peer, version: int, *, ok: bool, running: int = -1) -> None:
        """Record ``peer``'s answer for ``version`` in its pins, and that it is ready once it
        holds the version it was welcomed with."""
        if ok:
            peer.inflight = {v for v in peer.inflight if v > version}
            if version >= peer.welcome_version:
                peer.ready = True
        elif running >= 0:
            # The worker answers in order and runs one version: ``running`` (this one, if it
            # switched before a hook failed, else an earlier one). Versions up to this one that
            # it does not run are done with; a worker that keeps failing must not pin a slot
            # per failed version until none is left for anyone. A nack that does not say what
            # runs keeps its version pinned: the worker may have switched to it.
            peer.inflight = {v for v in peer.inflight if v > version or v == running}
