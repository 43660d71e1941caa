"""The sender's engine: serving the control channel, staging versions and collecting acks.

One background task (:meth:`SenderCore.serve`) reads the control channel, answers handshakes,
records acks and declares peers lost; ``send()`` stages a version through the data plane,
announces it, lets the plane deliver it and waits for the targeted workers' answers, which
that task records.
"""

from __future__ import annotations

import contextlib
import logging
import time

import anyio

from .._channel import SenderChannel
from .._config import Heartbeats, Timeouts
from .._exceptions import (
    ConnectFailedError,
    NotConnectedError,
    WeightSyncError,
    WeightSyncTimeout,
    WorkerLostError,
)
from .._planes.base import SenderPlane, WeightSource
from .._planes.digest import Digests
from .._protocol import Bye
from .._util.sched import short_slice_while
from .._util.shield import to_the_end
from .._weights.layout import Layout
from .control import ControlLoop
from .outcome import Answers, PendingSend, SendResult
from .peers import PeerTable
from .retries import AnswerRetries
from .staging import Staged, stage_and_announce
from .state import SenderState
from .workers import explain_missing, hopeless, unavailable_text

__all__ = ["PendingSend", "SendResult", "SenderCore"]

log = logging.getLogger("aiowsync.sender")

BYE_WINDOW_S = 1.0
"""How long closing spends telling connected workers goodbye, in all."""
BYE_SEND_S = 0.2
"""How long one goodbye may wait for room on its socket."""
SLOW_FRACTION = 0.1
"""A send whose answers take this part of its ack deadline warns who holds it up..."""
SLOW_AFTER_S = 1.0
"""...but never before this many seconds."""


class SenderCore:
    """The sender's engine; the tables it shares with the pieces it runs (its control loop,
    staging and retries) are in :attr:`state`."""

    def __init__(
        self,
        *,
        plane: SenderPlane,
        layout: Layout,
        num_workers: int,
        model_id: str,
        timeouts: Timeouts,
        heartbeats: Heartbeats,
        integrity: bool = False,
    ) -> None:
        self.state = SenderState(
            plane=plane,
            layout=layout,
            num_workers=num_workers,
            model_id=model_id,
            timeouts=timeouts,
            beats=heartbeats,
            digests=Digests(layout, plane, enabled=integrity),
        )
        # FIFO; taken without a checkpoint when free (one loop pass less per send).
        # Not a Lock: a published send's delivery, in a task of its own, gives it back.
        self._send_lock = anyio.Semaphore(1, max_value=1, fast_acquire=True)
        self._loop = ControlLoop(self.state)

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        if self.state.channel is None:
            raise RuntimeError("the sender is not started")
        return self.state.channel.address

    @property
    def channel(self) -> SenderChannel | None:
        return self.state.channel

    @property
    def plane(self) -> SenderPlane:
        return self.state.plane

    @property
    def digests(self) -> Digests:
        return self.state.digests

    @property
    def peers(self) -> PeerTable:
        return self.state.peers

    @property
    def version(self) -> int:
        """The latest version announced (or staged at start)."""
        return self.state.version

    @property
    def proof(self) -> str:
        return self.state.proof

    async def start(
        self, initial: WeightSource, channel: SenderChannel, *, first_version: int = 0
    ) -> None:
        """Create the slots, stage the first version (0 unless a relay numbers it as its
        upstream did) and serve on ``channel`` (bound by the scheme; closed, with the slots,
        if this fails)."""
        state = self.state
        plane = state.plane
        try:
            plane.setup(state.layout)
            slot = plane.reserve(set())
            await plane.stage(slot, initial)
            await state.digests.take(slot, first_version)
            plane.publish(slot, first_version)
            state.version = first_version
            await plane.seal(first_version)
        except BaseException:
            plane.close()
            channel.close()
            raise
        state.channel = channel

    async def close(self) -> None:
        state = self.state
        with anyio.CancelScope(shield=True):
            channel, state.channel = state.channel, None
            if channel is not None:
                with anyio.move_on_after(BYE_WINDOW_S):
                    for peer in state.peers.values():
                        if not peer.gone:
                            with contextlib.suppress(WeightSyncError):
                                await channel.send(
                                    peer.routing,
                                    Bye(reason="sender shutting down"),
                                    timeout=BYE_SEND_S,
                                )
                channel.close()
            state.abandon_pending()
            state.plane.close()

    # -- status -------------------------------------------------------------------------------

    def ready_workers(self) -> set[int]:
        return self.state.peers.ready_workers()

    def lost_workers(self) -> set[int]:
        return self.state.peers.lost_workers()

    def reachable_workers(self) -> set[int]:
        """Workers a version can be sent to now: ready ones, and those still joining (welcomed
        at an earlier version, which a send must not leave them on)."""
        everyone = list(range(self.state.num_workers))
        return set(everyone) - set(self.state.peers.unavailable(everyone))

    async def wait_ready(self, timeout: float) -> None:
        everyone = set(range(self.state.num_workers))
        peers = self.state.peers
        # A worker lost before the wait may be restarting: waiting for it is the point.
        lost_before = {p.worker_idx: p for p in peers.values() if p.lost}
        try:
            with anyio.fail_after(timeout):
                while missing := everyone - self.ready_workers():
                    if self.state.channel is None:
                        ids = sorted(missing)
                        raise NotConnectedError(
                            f"the sender closed while connect() waited for workers {ids}"
                        )
                    settles = hopeless(peers, missing, lost_before)
                    if settles is not None and settles <= 0:
                        # Refused or lost, each of them: the deadline would only say so later.
                        ids = sorted(missing)
                        raise ConnectFailedError(
                            f"workers {ids} cannot connect, each refused or lost:\n  "
                            + explain_missing(peers, ids),
                            {w: peers.notes.get(w) or "lost" for w in ids},
                        )
                    await self.state.changed(settles)
        except ConnectFailedError:
            raise  # a TimeoutError too, but not the deadline's
        except TimeoutError:
            exc = WeightSyncTimeout(f"workers did not connect within {timeout:g} s", missing)
            # Each missing worker's story: refused and why, never said hello, lost.
            exc.args = (f"{exc}:\n  {explain_missing(self.state.peers, sorted(missing))}",)
            raise exc from None

    async def changed(self) -> None:
        """Wait until a worker's state or version changes."""
        await self.state.changed()

    # -- background task ----------------------------------------------------------------------

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve the control channel until cancelled (see :class:`ControlLoop`)."""
        await self._loop.serve(task_status=task_status)

    @property
    def dropped(self) -> int:
        """Control messages the engine dropped (beside those its channel dropped)."""
        return self._loop.dropped

    # -- sending ------------------------------------------------------------------------------

    def check_targets(self, targets: list[int]) -> None:
        if self.state.channel is None:
            raise WeightSyncError("the sender is shut down")
        if unavailable := self.state.peers.unavailable(targets):
            raise WorkerLostError(unavailable_text(self.state.peers, unavailable), unavailable)

    async def send(
        self,
        source: WeightSource,
        targets: list[int],
        *,
        stage_limit: float,
        ack_limit: float,
        deadline: float | None,
        version: int | None = None,
    ) -> SendResult:
        """Stage ``source`` as the next version (or as ``version``, a relay's upstream's
        number, above the latest) and deliver it to ``targets``.

        Staging (and delivery) must end within ``stage_limit`` seconds; the acks are awaited
        until ``deadline`` (monotonic) if given, else for ``ack_limit`` seconds after delivery.
        """
        started = time.perf_counter()
        staged = await self._stage_in_turn(source, targets, stage_limit, version)
        return await self._complete(staged, ack_limit, deadline, started)

    async def publish(
        self,
        source: WeightSource,
        targets: list[int],
        *,
        stage_limit: float,
        ack_limit: float,
        deadline: float | None,
        tasks: anyio.abc.TaskGroup,
    ) -> PendingSend:
        """As :meth:`send`, but return once the version is staged and announced and the
        source will never be read again; the rest runs in ``tasks`` and the returned
        :class:`PendingSend` gives its outcome."""
        started = time.perf_counter()
        staged = await self._stage_in_turn(source, targets, stage_limit)
        pending = PendingSend(staged.version)
        try:
            # Planes that copy out of the source while they deliver (the distributed one
            # packs bucket by bucket) copy the rest now: the caller may change it next.
            await to_the_end(self.state.plane.seal(staged.version))
        finally:
            tasks.start_soon(pending.run, self._complete(staged, ack_limit, deadline, started))
        return pending

    async def _stage_in_turn(
        self,
        source: WeightSource,
        targets: list[int],
        stage_limit: float,
        version: int | None = None,
    ) -> Staged:
        """Wait for the send before (by ``stage_limit``), then stage and announce; returns
        holding the send lock, which :meth:`_complete` releases."""
        self.check_targets(targets)
        move_by = time.monotonic() + stage_limit
        late = WeightSyncTimeout(f"send did not stage within {stage_limit:g} s", targets)
        if self._send_lock.value == 0:
            # Only the wait for an earlier send can be cut short: a copy runs to its end, and
            # its deadline is checked once it has (see stage_and_announce).
            try:
                with anyio.fail_after(stage_limit):
                    await self._send_lock.acquire()
            except TimeoutError:
                raise late from None
        else:
            # Free: taken without a checkpoint, so a small send never suspends before its
            # announcements go out.
            await self._send_lock.acquire()
        try:
            self.check_targets(targets)
            return await stage_and_announce(self.state, source, targets, move_by, version)
        except TimeoutError:
            self._send_lock.release()
            raise late from None
        except BaseException:
            self._send_lock.release()
            raise

    async def _await_answers(self, pending: Answers, wait: float) -> None:
        """Wait up to ``wait`` s for every answer to ``pending``; once a tenth of it has
        passed (at least :data:`SLOW_AFTER_S`), warn naming who holds the send up and what
        each said it was doing (once for each worker until it answers again)."""
        # The loop thread, which staged the version, is woken by the last ack: with a
        # short slice it need not wait for a busy CPU's running thread to finish its slice.
        with short_slice_while():
            await self._await_answers_or_warn(pending, wait)

    async def _await_answers_or_warn(self, pending: Answers, wait: float) -> None:
        first = max(SLOW_AFTER_S, SLOW_FRACTION * wait)
        if first >= wait:
            await pending.done.wait(wait)
            return
        if await pending.done.wait(first):
            return
        peers = self.state.peers
        held = []
        for worker in sorted(pending.waiting):
            peer = peers.get(worker)
            if peer is None or peer.warned_slow:
                continue
            peer.warned_slow = True
            heard = time.monotonic() - peer.last_seen
            held.append(
                f"worker {worker}: {peer.doing or 'says nothing of itself'}"
                f" (last heard {heard:.1f} s ago)"
            )
        if held:
            log.warning(
                "version %d waits on %d worker(s) after %.1f s of its %.1f s: %s",
                pending.version,
                len(held),
                first,
                wait,
                "; ".join(held),
            )
        await pending.done.wait(wait - first)

    async def _complete(
        self, staged: Staged, ack_limit: float, deadline: float | None, started: float
    ) -> SendResult:
        """Deliver a staged version (then release the send lock) and wait for its answers."""
        version, pending = staged.version, staged.pending
        try:
            try:
                # Still under the lock: a retry must be announced before the next version.
                await staged.delivery.run(AnswerRetries(self.state, pending, staged.members))
            except WeightSyncError as exc:
                # The members that failed say so themselves, or their deadline names them.
                log.warning("version %d: %s", version, exc)
            finally:
                try:
                    # However this ended (even cancelled), the version is read from the
                    # caller's weights now, never after send() stopped waiting.
                    await staged.delivery.finish()
                finally:
                    self._send_lock.release()
            wait = ack_limit if deadline is None else max(0.0, deadline - time.monotonic())
            await self._await_answers(pending, wait)
        finally:
            self.state.pending.pop(version, None)
            if suspects := pending.suspects:
                log.warning(
                    "version %d: workers %s passed on bytes that failed the next member's digest "
                    "check; later chains put them last",
                    version,
                    sorted(suspects),
                )
                self.state.plane.distrust(suspects)
        return pending.result(staged.nbytes, time.perf_counter() - started, staged.seconds)
