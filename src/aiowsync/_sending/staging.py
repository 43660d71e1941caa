"""Staging one version and announcing it: the first half of a send, run under the engine's
send lock (its second half, delivery and answers, is the engine's)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from .._exceptions import WeightSyncError
from .._planes.base import Delivery, WeightSource
from .._planes.slot_table import SlotsFull
from .._protocol import Update
from .._util.shield import to_the_end
from .outcome import Answers
from .peers import Peer, PeerTable
from .state import SenderState

__all__ = ["Staged", "stage_and_announce"]


@dataclass(slots=True)
class Staged:
    """A version staged and announced, whose delivery and answers are still to come."""

    version: int
    pending: Answers
    seconds: float
    delivery: Delivery
    members: list[Peer]


def _slots_full(peers: PeerTable, exc: SlotsFull) -> WeightSyncError:
    """No slot is left: the error, naming the workers whose leases keep slots."""
    leases = peers.leases_text()
    if not leases:
        return exc
    return WeightSyncError(
        f"{exc}; {leases}: a leased version keeps its slot until its last lease ends"
    )


async def stage_and_announce(
    state: SenderState,
    source: WeightSource,
    targets: list[int],
    move_by: float,
    at: int | None = None,
) -> Staged:
    """Stage ``source`` as the next version (or as ``at``, above the latest) and announce it
    to ``targets``, whose answers are then collected in ``state.pending``; a version staged
    after ``move_by`` (monotonic) raises :class:`TimeoutError` and is never announced."""
    if at is not None and at <= state.version:
        raise ValueError(f"version {at} does not follow the latest, {state.version}")
    version = state.version + 1 if at is None else at
    plane = state.plane
    try:
        slot = plane.reserve(state.peers.pinned_versions(state.version))
    except SlotsFull as exc:
        raise _slots_full(state.peers, exc) from None
    t0 = time.perf_counter()
    try:
        # The source checks the weights against the layout before any byte is written.
        await plane.stage(slot, source)
        await state.digests.take(slot, version)
        if time.monotonic() >= move_by:
            # A copy cannot be interrupted, so its deadline is checked here: a version
            # staged too late is never announced.
            raise TimeoutError
    except BaseException as exc:
        plane.release(slot)
        if isinstance(exc, SlotsFull):  # a plane that takes its slots when staging
            raise _slots_full(state.peers, exc) from None
        raise
    stage_s = time.perf_counter() - t0
    channel = state.channel
    if channel is None:
        raise WeightSyncError("the sender shut down while this version was being staged")
    # From here on the version exists: announce it to every target even if cancelled.
    # Nothing below suspends unless a socket cannot take an update at once, and those
    # announcements are shielded.
    plane.publish(slot, version)
    state.version = version
    pending = Answers(version, set(targets))
    state.pending[version] = pending
    delivery: Delivery | None = None
    try:
        peers = state.peers.by_index
        members = [peers[w] for w in targets if not peers[w].lost]
        since = min((p.conn.acked_version for p in members), default=-1)
        delivery = plane.deliver(
            version,
            [(p.worker_idx, p.session) for p in members],
            move_by,
            since=since if since >= 0 else None,
        )
        update = Update(
            version=version,
            params=state.with_digest(version, delivery.params),
            proof=state.proof,
        )
        blocked: list[Peer] = []
        for worker in targets:
            peer = peers[worker]
            if peer.lost:
                pending.lost.add(worker)
                pending.settle(worker)
            elif not state.announcer.nowait(channel, peer, update):
                blocked.append(peer)
        if blocked:
            await to_the_end(state.announcer.all(channel, blocked, update, queued=True))
        if not targets:
            pending.done.set()
    except BaseException:
        # Cancelled or failed after the version was taken: nobody will wait for it. A
        # delivery that will never run is given back, and the version is read from the
        # caller's weights now, never after send() returned.
        state.pending.pop(version, None)
        if delivery is None:
            await to_the_end(plane.seal(version))
        else:
            delivery.abandon()
            await delivery.finish()
        raise
    return Staged(version, pending, stage_s, delivery, members)
