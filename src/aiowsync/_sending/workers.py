"""The sender's view of its workers: a live, read-only table of typed statuses."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from .peers import Peer, PeerTable

__all__ = [
    "WorkerState",
    "WorkerStatus",
    "WorkerTable",
    "explain_missing",
    "hopeless",
    "unavailable_text",
]

WorkerState = Literal["never connected", "connecting", "ready", "lost", "gone"]
"""Where a worker stands, seen from the sender:

- ``"never connected"``: no hello of it was accepted in this session (``note`` says why, when
  it was refused or reported that it could not start);
- ``"connecting"``: welcomed, not yet holding the version it was welcomed with;
- ``"ready"``: holds a version and takes updates;
- ``"lost"``: no update reaches it now (silent, disconnected, replaced, or it failed); it may
  come back by itself;
- ``"gone"``: it said goodbye or its process ended; a restarted worker joins anew.
"""


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker as the sender knows it at the moment of the look."""

    worker_idx: int
    state: WorkerState
    version: int | None
    """The newest version it acknowledged (None before its first)."""
    in_flight: int | None
    """The newest version announced to it and not answered yet (None when none is)."""
    last_heard: float | None
    """Seconds since the sender last heard from it (None if never)."""
    pid: int | None
    """Its process id, as its hello said (None before a hello was accepted)."""
    host: str | None
    """Its host name, as its hello said."""
    note: str | None
    """The last thing known that explains its state: why it was refused, lost or gone."""
    leased: tuple[int, ...] = ()
    """The versions its leases read in the sender's memory (the sender keeps their slots)."""


class WorkerTable(Mapping[int, WorkerStatus]):
    """``scheme.workers``: worker index to :class:`WorkerStatus`, read live at each look
    (hold on to a status, not to the table, to keep a moment's picture)."""

    def __init__(self, peers: Callable[[], PeerTable | None], num_workers: int) -> None:
        self._peers = peers
        self._num_workers = num_workers

    def __getitem__(self, worker: int) -> WorkerStatus:
        if not isinstance(worker, int) or not 0 <= worker < self._num_workers:
            raise KeyError(worker)
        peers = self._peers()
        if peers is None:  # not serving (yet, or any more)
            return WorkerStatus(worker, "never connected", None, None, None, None, None, None)
        return status_of(peers, worker)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._num_workers))

    def __len__(self) -> int:
        return self._num_workers

    def __repr__(self) -> str:
        rows = ", ".join(f"{w}: {s.state} v{s.version}" for w, s in self.items())
        return f"WorkerTable({{{rows}}})"


def status_of(peers: PeerTable, worker: int) -> WorkerStatus:
    peer = peers.get(worker)
    note = peers.notes.get(worker)
    if peer is None:
        return WorkerStatus(worker, "never connected", None, None, None, None, None, note)
    acked = peer.conn.acked_version
    # One read of the set: the engine may replace it meanwhile (a scrape runs in a thread).
    inflight = max(peer.inflight, default=None)
    return WorkerStatus(
        worker_idx=worker,
        state=_state(peers, peer),
        version=acked if acked >= 0 else None,
        in_flight=inflight if inflight is not None and inflight > acked else None,
        last_heard=max(0.0, time.monotonic() - peer.last_seen),
        pid=peer.pid or None,
        host=peer.host or None,
        note=note,
        leased=tuple(sorted(peer.leased)),
    )


def _state(peers: PeerTable, peer: Peer) -> WorkerState:
    if peer.gone or (peer.lost and peers.gone(peer)):
        return "gone"
    if peer.lost:
        return "lost"
    return "ready" if peer.ready else "connecting"


def explain_missing(peers: PeerTable, workers: list[int]) -> str:
    """One line per worker of ``workers`` saying the last thing known about it."""
    lines = []
    for worker in workers:
        s = status_of(peers, worker)
        if s.state == "never connected":
            what = s.note or "never said hello"
        elif s.state == "connecting":
            what = f"said hello (pid {s.pid}) and does not hold its first version yet"
        else:
            what = f"{s.state}: {s.note or 'no reason known'}"
        lines.append(f"worker {worker}: {what}".replace("\n", "\n  "))
    for stray, why in peers.strays.items():
        lines.append(f"also refused: a worker that named index {stray} ({why})")
    return "\n  ".join(lines)


REFUSED = "refused: "
"""How a refusal's note begins (see the greeter)."""


def refused(peers: PeerTable, worker: int) -> bool:
    """``worker`` holds no live connection and its last hello was refused."""
    peer = peers.get(worker)
    return (peer is None or peer.lost) and peers.notes.get(worker, "").startswith(REFUSED)


REFUSAL_SETTLES_S = 1.0
"""A refused index counts as hopeless once this long has passed without a new hello for it
(another process may claim it right after a refusal, e.g. the fixed worker after a stray
one)."""


def hopeless(peers: PeerTable, workers: set[int], lost_before: Mapping[int, Peer]) -> float | None:
    """Whether waiting longer for ``workers`` (not empty) to hold a version is hopeless: each
    was refused, or was lost since the wait began (``lost_before``: the peers lost then, whose
    restart may be what the caller waits for). 0.0: hopeless now; a positive number: hopeless
    after that many seconds unless something changes (a refusal still settling); None: not
    hopeless."""
    if not workers:
        return None
    now = time.monotonic()
    settles = 0.0
    for worker in workers:
        peer = peers.get(worker)
        if peer is not None and peer.lost and lost_before.get(worker) is not peer:
            continue  # lost during the wait
        if not refused(peers, worker):
            return None
        age = now - peers.refused_at.get(worker, 0.0)
        settles = max(settles, REFUSAL_SETTLES_S - age)
    return settles


def unavailable_text(peers: PeerTable, workers: list[int]) -> str:
    """Why a send cannot reach ``workers``, with what to do (the error names them after)."""
    turned = [w for w in workers if refused(peers, w)]
    never = [w for w in workers if peers.get(w) is None and w not in turned]
    lost = [w for w in workers if w not in never and w not in turned]
    parts = []
    if turned:
        why = "; ".join(f"worker {w}: {peers.notes[w]}" for w in turned)
        parts.append(
            f"workers {turned} were refused when they said hello ({why}); fix what the "
            "refusal names in those workers and start them again, or leave them out with "
            "worker_ids="
        )
    if never:
        parts.append(
            f"workers {never} have not connected yet: call `await scheme.connect()` first, "
            "which waits until every worker holds version 0"
        )
    if lost:
        why = "; ".join(f"worker {w}: {peers.notes.get(w) or 'lost'}" for w in lost)
        parts.append(
            f"workers {lost} are lost ({why}); leave them out with worker_ids= until they rejoin"
        )
    return "cannot send: " + "; ".join(parts)
