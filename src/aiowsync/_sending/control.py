"""The sender's background task: reading the control channel, beating, answers (hellos go to
:class:`Greeter`).

:class:`ControlLoop` works on the engine's shared tables (a :class:`SenderState`: the peers,
the pending sends, the version) and never sends a version itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import anyio

from .. import _protocol as wire
from .._channel import PeerId, SenderChannel
from .._exceptions import ProtocolError, TransportError, WeightSyncError, WeightSyncTimeout
from .._util.text import excerpt, worth_logging
from .peers import DEAD_STATES, LAG_IN_FLIGHT, Peer, PeerTable
from .state import SenderState
from .welcome import Greeter

__all__ = ["ControlLoop"]

log = logging.getLogger("aiowsync.sender")

DISOWNED_KEPT = 256
"""Routing ids :meth:`ControlLoop._disown` remembers having told."""
MESSAGES_PER_TURN = 8
"""Messages handled before the event loop gets a turn (see :meth:`ControlLoop._turn`)."""
QUEUED_PER_BEAT = 256
"""Queued messages read before each round of beats, at most (a flood must not delay them)."""


class ControlLoop:
    def __init__(self, state: SenderState) -> None:
        self._state = state
        self._tasks: anyio.abc.TaskGroup | None = None
        self._greeter = Greeter(state)
        self._disowned: dict[PeerId, None] = {}
        """Routing ids lately told that their session is not one of ours, oldest first."""
        self.dropped = 0
        self.handled = 0

    @property
    def refusals(self) -> int:
        """Hellos refused so far."""
        return self._greeter.refusals

    # -- background task ----------------------------------------------------------------------

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        channel = self._state.channel
        assert channel is not None
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            task_status.started()
            next_beat = time.monotonic()
            while True:
                try:
                    peer_id, message = await channel.recv(timeout=self._state.beats.interval)
                except WeightSyncTimeout:
                    pass
                else:
                    await self._dispatch(peer_id, message)
                    await self._turn()
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self._state.beats.interval
                    # Read what is queued first: a goodbye waiting there must not be taken
                    # for a lost connection when the beat finds the worker's socket gone.
                    for _ in range(QUEUED_PER_BEAT):
                        if (got := channel.recv_nowait()) is None:
                            self._state.peers.check_liveness()
                            break
                        await self._dispatch(*got)
                        await self._turn()
                    # else: more is queued than one round reads; beats may be among it, so
                    # nobody is judged silent until the queue has been read through.
                    await self._beat(channel)
                    channel.keep_bound()

    async def _turn(self) -> None:
        """Give the event loop a turn every few messages, whatever they are: a receive that
        finds a message waiting does not suspend, so a flood of valid messages would
        otherwise keep the trainer's loop for as long as it lasts."""
        self.handled += 1
        if self.handled % MESSAGES_PER_TURN == 0:
            await asyncio.sleep(0)

    async def _beat(self, channel: SenderChannel) -> None:
        for peer in self._state.peers.values():
            if peer.lost or peer.conn.state is wire.State.ERROR:
                continue
            try:
                # A beat that cannot be queued at once is skipped, never waited for.
                await channel.send(peer.routing, self._state.beat_for(peer), timeout=0)
            except TransportError:
                self._state.peers.connection_closed(peer)
                self._state.peers.mark_lost(peer, "its connection is closed")
            except WeightSyncError:
                pass

    def _routable(self, peer: Peer) -> bool:
        """Whether a beat to ``peer``'s main connection is taken at once.

        A ROUTER refuses a message for a connection it does not have, so a beat taken means
        that connection exists: never dropped (the worker's event loop and beat thread were
        stalled while its ZeroMQ thread kept the connection up) or renewed since.
        """
        channel = self._state.channel
        if channel is None:
            return False
        try:
            return channel.send_nowait(peer.routing, self._state.beat_for(peer))
        except WeightSyncError:
            return False

    # -- incoming messages --------------------------------------------------------------------

    def _drop(self, why: str) -> None:
        self.dropped += 1
        if worth_logging(self.dropped):
            log.warning(
                "dropped a control message: %s (%d dropped so far)", excerpt(why), self.dropped
            )

    def _disown(self, routing: PeerId) -> None:
        """Say goodbye to a peer that beats for a session this sender never gave out.

        That is a worker of an earlier sender on this address (its socket reconnected by
        itself when this one bound) or a worker that another process replaced under its index.
        Told, it stops its background task and its beats and reports that it is not
        connected. Once per routing id among the last few hundred told (a worker has two: its
        updates' and its beats', which never reads), and never waited for: junk cannot make
        this sender answer more than once per message it reads.
        """
        if routing in self._disowned:
            return
        self._disowned[routing] = None
        if len(self._disowned) > DISOWNED_KEPT:
            del self._disowned[next(iter(self._disowned))]
        channel = self._state.channel
        if channel is None:
            return
        bye = wire.Bye(reason="this sender never welcomed this session (restarted on its address?)")
        with contextlib.suppress(WeightSyncError):
            channel.send_nowait(routing, bye)

    async def _dispatch(self, routing: PeerId, message: wire.Message) -> None:
        if isinstance(message, wire.Hello):
            await self._greeter.answer(routing, message, self._tasks)
            return
        if isinstance(message, wire.Heartbeat):
            self._on_beat(routing, message)
            return
        peer = self._state.peers.by_routing.get(routing)
        if peer is None:
            self._drop(f"{type(message).__name__} from a peer that did not say hello")
            return
        try:
            peer.conn.receive(message)
        except ProtocolError as exc:
            self._drop(f"worker {peer.worker_idx}: {exc}")
            self._state.peers.mark_lost(peer, f"protocol error: {exc}")
            return
        peer.last_seen = time.monotonic()
        if isinstance(message, (wire.Ack, wire.Nack)):
            # Before the answer is counted: the answer may unpin what a lease still reads.
            peer.leased = frozenset(message.leased)
        if isinstance(message, wire.Ack):
            self._on_answer(peer, message.version, None)
        elif isinstance(message, wire.Nack):
            self._on_answer(
                peer,
                message.version,
                message.error,
                retryable=message.retryable,
                running=message.running,
                forwarded_by=message.forwarded_by,
            )
        elif isinstance(message, wire.Bye):
            self._state.peers.said_goodbye(peer, message.reason)

    def _on_beat(self, routing: PeerId, message: wire.Heartbeat) -> None:
        peer = self._state.peers.get(message.worker_idx)
        if peer is None or not message.session or peer.session != message.session:
            self._drop(f"heartbeat for an unknown session from worker {message.worker_idx}")
            if message.session:
                self._disown(routing)
            return
        peer.last_seen = time.monotonic()
        self._send_deferred(peer)
        if message.leased is None:  # the beat thread's, which says what holds it up
            peer.doing = message.doing
        if message.leased is not None and routing == peer.routing:
            leased = frozenset(message.leased)
            if leased != peer.leased:
                peer.leased = leased
                self._state.notify()  # a version may be free for a new one
        # Beats from the receiver's beat thread keep it fresh and show that its process runs;
        # updates reach it again only if its main connection is there too: a beat on that
        # connection shows it, and so does a probe on it that the socket routes.
        revivable = not peer.gone and peer.conn.state not in DEAD_STATES
        if peer.lost and revivable and (routing == peer.routing or self._routable(peer)):
            log.info("worker %d is back", peer.worker_idx)
            peer.lost = False
            self._state.notify()

    def _skipped(self, peer: Peer, version: int, error: str | None) -> None:
        """Settle the earlier sends that ``peer`` skipped on its way to ``version`` (it lagged,
        and was sent the newest version meant for it): superseded, or failed with it."""
        worker = peer.worker_idx
        for pending in self._state.pending.values():
            if pending.version >= version or worker not in pending.waiting:
                continue
            if pending.version in peer.inflight:
                continue  # announced to it, and answered in its turn
            if error is None:
                pending.superseded.add(worker)
            else:
                pending.nacks[worker] = f"skipped for version {version}, which failed: {error}"
            pending.settle(worker)

    def _send_deferred(self, peer: Peer) -> None:
        """Announce the version deferred for ``peer`` once it lags no more (see
        :data:`LAG_IN_FLIGHT`); where the socket has no room at once, a task of the loop's
        waits for it, and nothing else is announced to ``peer`` meanwhile."""
        update = peer.deferred
        channel = self._state.channel
        if (
            update is None
            or channel is None
            or peer.lost
            or peer.announcing
            or len(peer.inflight) >= LAG_IN_FLIGHT
        ):
            return
        if self._state.announcer.offer(channel, peer, update):
            peer.deferred = None
        elif self._tasks is not None:
            peer.announcing = True
            self._tasks.start_soon(self._announce_deferred, channel, peer, update)

    async def _announce_deferred(
        self, channel: SenderChannel, peer: Peer, update: wire.Update
    ) -> None:
        try:
            await self._state.announcer.all(channel, [peer], update)
        finally:
            peer.announcing = False
        if peer.deferred is update:
            peer.deferred = None
        else:  # a newer version was meant for it meanwhile
            self._send_deferred(peer)

    def _on_answer(
        self,
        peer: Peer,
        version: int,
        error: str | None,
        *,
        retryable: bool = False,
        running: int = -1,
        forwarded_by: int = -1,
    ) -> None:
        PeerTable.answered(peer, version, ok=error is None, running=running)
        peer.warned_slow = False
        peer.failed = (
            "" if error is None else f"it could not apply version {version}: {excerpt(error)}"
        )
        if retryable:
            self._state.plane.receive_failed(peer.worker_idx)
        self._state.notify()  # its version, its pins, and perhaps its readiness changed
        self._skipped(peer, version, error)
        pending = self._state.pending.get(version)
        if pending is not None and peer.worker_idx in pending.waiting:
            if error is None:
                pending.acked.add(peer.worker_idx)
            else:
                pending.nacks[peer.worker_idx] = error
                if retryable:
                    pending.retryable.add(peer.worker_idx)
                if forwarded_by >= 0:
                    pending.forwarded_by[peer.worker_idx] = forwarded_by
            pending.settle(peer.worker_idx)
        if error is not None:
            log.warning(
                "worker %d could not apply version %d: %s",
                peer.worker_idx,
                version,
                excerpt(error),
            )
        self._send_deferred(peer)
