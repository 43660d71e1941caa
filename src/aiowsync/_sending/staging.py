"""Staging one version and announcing it: the first half of a send, run under the engine's
send lock (its second half, delivery and answers, is the engine's)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .._exceptions import SlotsFull, WeightSyncError
from .._planes.base import Delivery, InPlace, WeightSource
from .._protocol import Update
from .._util.shield import to_the_end
from .outcome import Answers
from .peers import LAG_IN_FLIGHT, Peer, PeerTable
from .state import SenderState

__all__ = ["Staged", "stage_and_announce"]

log = logging.getLogger("aiowsync.sender")


@dataclass(slots=True)
class Staged:
    """A version staged and announced, whose delivery and answers are still to come."""

    version: int
    pending: Answers
    seconds: float
    nbytes: int
    """Bytes of the models it moved (a partial send leaves the others as they were)."""
    delivery: Delivery
    members: list[Peer]


def _slots_full(peers: PeerTable, exc: SlotsFull, waited: float | None) -> SlotsFull:
    """No slot is left: the error, naming the workers whose leases keep slots, and how long
    the send waited for one."""
    text = str(exc)
    if leases := peers.leases_text():
        text = f"{text}; {leases}: a leased version keeps its slot until its last lease ends"
    if waited is not None:
        text = f"{text} (waited {waited:.1f} s for one to be released)"
    return SlotsFull(text)


SLOT_LOOK_S = 0.25
"""While no slot is free, how often the pins are counted again beside the wake-ups of answers
(a worker's process may end without one)."""


async def _wait_for_a_slot(
    state: SenderState,
    full: SlotsFull,
    version: int,
    move_by: float,
    since: float | None,
) -> float:
    """Every slot holds a version still in use: wait until the next look (an answer, a lease
    ended, or :data:`SLOT_LOOK_S`); raise once ``move_by`` has passed, or at once when no
    worker is answering or leasing (only sends move workers off the versions they run).
    Warns once per version, naming who holds the oldest version in use; returns when the
    wait began."""
    now = time.monotonic()
    if now >= move_by or not state.peers.releasing():
        raise _slots_full(state.peers, full, None if since is None else now - since) from None
    if since is None:
        since = now
        pinned = state.peers.pinned_versions(state.version)
        oldest = min(pinned)
        log.warning(
            "no slot is free for version %d: every slot holds a version still in use %s; "
            "waiting up to %.1f s for the oldest, %d, to be released (%s)",
            version,
            sorted(pinned),
            move_by - now,
            oldest,
            state.peers.holders_text(oldest),
        )
    await state.changed(min(SLOT_LOOK_S, move_by - now))
    return since


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
    waiting_since: float | None = None
    while True:
        slot: int | None = None
        try:
            slot = plane.reserve(state.peers.pinned_versions(state.version))
            t0 = time.perf_counter()
            # The source checks the weights against the layout before any byte is written;
            # a plane that takes its slots when staging does so before it reads the source.
            await plane.stage(slot, source)
            break
        except SlotsFull as exc:
            if slot is not None:
                plane.release(slot)
            waiting_since = await _wait_for_a_slot(state, exc, version, move_by, waiting_since)
        except BaseException:
            if slot is not None:
                plane.release(slot)
            raise
    try:
        await state.digests.take(slot, version)
        if time.monotonic() >= move_by:
            # A copy cannot be interrupted, so its deadline is checked here: a version
            # staged too late is never announced.
            raise TimeoutError
    except BaseException:
        plane.release(slot)
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
        # Where receivers read the sender's slots, a lagging worker is sent the newest version
        # once it catches up rather than each one (see LAG_IN_FLIGHT); elsewhere every
        # member takes part in the delivery.
        in_place = isinstance(delivery, InPlace)
        for worker in targets:
            peer = peers[worker]
            if peer.lost:
                pending.lost.add(worker)
                pending.settle(worker)
            elif in_place and (peer.deferred is not None or len(peer.inflight) >= LAG_IN_FLIGHT):
                peer.deferred = update  # the version deferred before, if any, is skipped
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
    nbytes = state.layout.bytes_without(source.carry)
    return Staged(version, pending, stage_s, nbytes, delivery, members)
