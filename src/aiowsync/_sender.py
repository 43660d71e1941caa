"""The sender's engine: handshakes, liveness, staging and acknowledged updates.

One background task (:meth:`SenderCore.serve`) reads the control channel, answers handshakes,
records acks and declares peers lost; ``send()`` stages a version through the data plane and
waits for the targeted workers' answers, which that task delivers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import anyio

from ._channel import PeerId, SenderChannel
from ._config import Heartbeats, Timeouts
from ._exceptions import (
    LostDuringSendError,
    ProtocolError,
    RemoteApplyError,
    TransportError,
    WeightSyncError,
    WeightSyncTimeout,
    WorkerLostError,
)
from ._layout import Layout
from ._planes import SenderPlane, Source
from ._protocol import (
    PROTOCOL_VERSION,
    SENDER_INDEX,
    Ack,
    Bye,
    Connection,
    Heartbeat,
    Hello,
    Message,
    Nack,
    Refuse,
    Role,
    State,
    Update,
    Welcome,
)
from ._shield import to_the_end
from ._shm_slots import pid_alive
from ._signal import Flag, Signal

__all__ = ["SendResult", "SenderCore"]

log = logging.getLogger("aiowsync.sender")


_DEAD_STATES = frozenset({State.ERROR, State.CLOSED})
INLINE_COPY_BYTES = 2 * 1024 * 1024
"""Models up to this size are staged on the event loop (a copy of ~0.1 ms)."""


@dataclass(frozen=True, slots=True)
class SendResult:
    """What a successful ``send()`` did."""

    version: int
    """The version now live on every targeted worker."""
    worker_ids: tuple[int, ...]
    """The workers that acknowledged it."""
    nbytes: int
    """Bytes staged."""
    seconds: float
    """Wall time of the whole call."""
    stage_seconds: float
    """Time spent copying the weights into the data plane."""


@dataclass(slots=True)
class _Peer:
    worker_idx: int
    routing: PeerId
    conn: Connection
    session: str
    pid: int
    welcome_version: int
    last_seen: float
    ready: bool = False
    lost: bool = False
    gone: bool = False
    inflight: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Pending:
    version: int
    waiting: set[int]
    done: Flag = field(default_factory=Flag)
    acked: set[int] = field(default_factory=set)
    nacks: dict[int, str] = field(default_factory=dict)
    retryable: set[int] = field(default_factory=set)
    lost: set[int] = field(default_factory=set)
    changed: Signal = field(default_factory=Signal)

    def settle(self, worker: int) -> None:
        self.waiting.discard(worker)
        if not self.waiting:
            self.done.set()
        self.changed.notify()

    def reopen(self, workers: list[int]) -> None:
        """``workers`` get another attempt: their failed answers no longer count."""
        for worker in workers:
            self.nacks.pop(worker, None)
            self.retryable.discard(worker)
            self.waiting.add(worker)
        if self.waiting:
            self.done.clear()


class SenderCore:
    def __init__(
        self,
        *,
        plane: SenderPlane,
        layout: Layout,
        num_workers: int,
        model_id: str,
        timeouts: Timeouts,
        heartbeats: Heartbeats,
        same_host: bool,
    ) -> None:
        self._plane = plane
        self.layout = layout
        # Small copies are staged on the loop: cheaper than the hop to a worker thread, and too
        # short to stall it. Planes with transfers only take note of the source there.
        self._stages_inline = layout.total_bytes <= INLINE_COPY_BYTES or plane.transfers
        self.num_workers = num_workers
        self.model_id = model_id
        self._timeouts = timeouts
        self._beats = heartbeats
        self._same_host = same_host
        self._channel: SenderChannel | None = None
        self._peers: dict[int, _Peer] = {}
        self._retired: list[_Peer] = []
        self._by_routing: dict[PeerId, _Peer] = {}
        self._disowned: dict[PeerId, None] = {}
        """Routing ids lately told that their session is not one of ours, oldest first."""
        self._pending: dict[int, _Pending] = {}
        # FIFO; taken without a checkpoint when free (one loop pass less per send).
        self._send_lock = anyio.Lock(fast_acquire=True)
        self._tasks: anyio.abc.TaskGroup | None = None
        # Transfers of successive versions run one after another, even past a cancelled send.
        self._last_transfer = threading.Event()
        self._last_transfer.set()
        self._changed = Signal()
        # Copies into slots: one at a time (sends stage under the lock), in a thread of this
        # sender's own, which an asyncio future can wait for without an anyio hop.
        self._stager: ThreadPoolExecutor | None = None
        self.version = 0
        self.dropped = 0

    # -- life cycle ---------------------------------------------------------------------------

    @property
    def address(self) -> str:
        if self._channel is None:
            raise RuntimeError("the sender is not started")
        return self._channel.address

    async def start(self, initial: Source, channel: SenderChannel) -> None:
        """Create the slots, stage version 0 and serve on ``channel`` (bound by the scheme;
        closed, with the slots, if this fails)."""
        try:
            self._plane.setup(self.layout)
            slot = self._plane.reserve(set())
            await anyio.to_thread.run_sync(self._plane.write, slot, initial)
            self._plane.publish(slot, 0)
            await anyio.to_thread.run_sync(self._plane.seal, 0)
        except BaseException:
            self._plane.close()
            channel.close()
            raise
        self._channel = channel

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            channel, self._channel = self._channel, None
            if channel is not None:
                with anyio.move_on_after(1.0):
                    for peer in self._peers.values():
                        if not peer.gone:
                            with contextlib.suppress(WeightSyncError):
                                await channel.send(
                                    peer.routing, Bye(reason="sender shutting down"), timeout=0.2
                                )
                channel.close()
            if self._stager is not None:
                # A copy still running holds its slot's thread; it ends on its own.
                self._stager.shutdown(wait=False)
            for pending in self._pending.values():
                pending.lost |= set(pending.waiting)
                pending.waiting.clear()
                pending.done.set()
                pending.changed.notify()
            self._plane.close()

    # -- status -------------------------------------------------------------------------------

    def ready_workers(self) -> set[int]:
        return {w for w, p in self._peers.items() if p.ready and not p.lost}

    def lost_workers(self) -> set[int]:
        return {w for w, p in self._peers.items() if p.lost}

    async def wait_ready(self, timeout: float) -> None:
        everyone = set(range(self.num_workers))
        try:
            with anyio.fail_after(timeout):
                while missing := everyone - self.ready_workers():
                    await self._changed.wait()
        except TimeoutError:
            raise WeightSyncTimeout(
                f"workers did not connect within {timeout:g} s", sorted(missing)
            ) from None

    def _notify(self) -> None:
        self._changed.notify()

    # -- background task ----------------------------------------------------------------------

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        channel = self._channel
        assert channel is not None
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            task_status.started()
            next_beat = time.monotonic()
            while True:
                try:
                    peer_id, message = await channel.recv(timeout=self._beats.interval)
                except WeightSyncTimeout:
                    pass
                else:
                    await self._dispatch(peer_id, message)
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self._beats.interval
                    # Read what is queued first: a goodbye waiting there must not be taken
                    # for a lost connection when the beat finds the worker's socket gone.
                    for _ in range(_QUEUED_PER_BEAT):
                        if (got := channel.recv_nowait()) is None:
                            self._check_liveness()
                            break
                        await self._dispatch(*got)
                    # else: more is queued than one round reads; beats may be among it, so
                    # nobody is judged silent until the queue has been read through.
                    await self._beat(channel)

    def _check_liveness(self) -> None:
        for peer in list(self._peers.values()):
            if not peer.lost and self._is_late(peer):
                self._mark_lost(peer, f"no heartbeat for {self._beats.timeout:g} s")

    def _is_late(self, peer: _Peer) -> bool:
        return time.monotonic() - peer.last_seen > self._beats.timeout

    async def _beat(self, channel: SenderChannel) -> None:
        for peer in list(self._peers.values()):
            if peer.lost or peer.conn.state is State.ERROR:
                continue
            beat = Heartbeat(worker_idx=SENDER_INDEX, session=peer.session, version=self.version)
            try:
                # A beat that cannot be queued at once is skipped, never waited for.
                await channel.send(peer.routing, beat, timeout=0)
            except TransportError:
                self._connection_closed(peer)
                self._mark_lost(peer, "its connection is closed")
            except WeightSyncError:
                pass

    def _routable(self, peer: _Peer) -> bool:
        """Whether a beat to ``peer``'s main connection is taken at once.

        A ROUTER refuses a message for a connection it does not have, so a beat taken means
        that connection exists: never dropped (the worker's event loop and beat thread were
        stalled while its ZeroMQ thread kept the connection up) or renewed since.
        """
        channel = self._channel
        if channel is None:
            return False
        beat = Heartbeat(worker_idx=SENDER_INDEX, session=peer.session, version=self.version)
        try:
            return channel.send_nowait(peer.routing, beat)
        except WeightSyncError:
            return False

    def _mark_lost(self, peer: _Peer, why: str, *, level: int = logging.WARNING) -> None:
        if not peer.lost:
            log.log(level, "worker %d lost: %s", peer.worker_idx, _excerpt(why))
        peer.lost = True
        self._plane.forget(peer.worker_idx)
        for pending in self._pending.values():
            if peer.worker_idx in pending.waiting:
                pending.lost.add(peer.worker_idx)
                pending.settle(peer.worker_idx)
        self._notify()

    def _connection_closed(self, peer: _Peer) -> None:
        # On one host a closed connection proves nothing (a stopped process loses its
        # connection but still maps its slot); only the process's exit or its goodbye does.
        if not self._same_host:
            peer.gone = True

    def _peer_gone(self, peer: _Peer) -> bool:
        """True once ``peer`` can no longer read any slot, so its versions need no pin."""
        if not peer.gone and self._same_host and peer.pid and not pid_alive(peer.pid):
            peer.gone = True
        return peer.gone

    # -- incoming messages --------------------------------------------------------------------

    def _drop(self, why: str) -> None:
        self.dropped += 1
        # The 1st, 10th, 100th...: a peer sending junk must not flood the log.
        if str(self.dropped).rstrip("0") == "1":
            log.warning(
                "dropped a control message: %s (%d dropped so far)", _excerpt(why), self.dropped
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
        if len(self._disowned) > _DISOWNED_KEPT:
            del self._disowned[next(iter(self._disowned))]
        channel = self._channel
        if channel is None:
            return
        bye = Bye(reason="this sender never welcomed this session (restarted on its address?)")
        with contextlib.suppress(WeightSyncError):
            channel.send_nowait(routing, bye)

    async def _dispatch(self, routing: PeerId, message: Message) -> None:
        if isinstance(message, Hello):
            await self._on_hello(routing, message)
            return
        if isinstance(message, Heartbeat):
            peer = self._peers.get(message.worker_idx)
            if peer is None or not message.session or peer.session != message.session:
                self._drop(f"heartbeat for an unknown session from worker {message.worker_idx}")
                if message.session:
                    self._disown(routing)
                return
            peer.last_seen = time.monotonic()
            # Beats from the receiver's beat thread keep it fresh and show that its process
            # runs; updates reach it again only if its main connection is there too: a beat
            # on that connection shows it, and so does a probe on it that the socket routes.
            revivable = not peer.gone and peer.conn.state not in _DEAD_STATES
            if peer.lost and revivable and (routing == peer.routing or self._routable(peer)):
                log.info("worker %d is back", peer.worker_idx)
                peer.lost = False
                self._notify()
            return
        peer = self._by_routing.get(routing)
        if peer is None:
            self._drop(f"{type(message).__name__} from a peer that did not say hello")
            return
        try:
            peer.conn.receive(message)
        except ProtocolError as exc:
            self._drop(f"worker {peer.worker_idx}: {exc}")
            self._mark_lost(peer, f"protocol error: {exc}")
            return
        peer.last_seen = time.monotonic()
        if isinstance(message, Ack):
            self._on_answer(peer, message.version, None)
        elif isinstance(message, Nack):
            self._on_answer(
                peer,
                message.version,
                message.error,
                retryable=message.retryable,
                running=message.running,
            )
        elif isinstance(message, Bye):
            peer.gone = True
            self._by_routing.pop(routing, None)
            self._mark_lost(
                peer, f"said goodbye ({message.reason or 'no reason'})", level=logging.INFO
            )

    def _on_answer(
        self,
        peer: _Peer,
        version: int,
        error: str | None,
        *,
        retryable: bool = False,
        running: int = -1,
    ) -> None:
        if error is None:
            peer.inflight = {v for v in peer.inflight if v > version}
            if version >= peer.welcome_version and not peer.ready:
                peer.ready = True
                self._notify()
        elif running >= 0:
            # The worker answers in order and runs one version: ``running`` (this one, if it
            # switched before a hook failed, else an earlier one). Versions up to this one that
            # it does not run are done with; a worker that keeps failing must not pin a slot
            # per failed version until none is left for anyone. A nack that does not say what
            # runs keeps its version pinned: the worker may have switched to it.
            peer.inflight = {v for v in peer.inflight if v > version or v == running}
        pending = self._pending.get(version)
        if pending is not None and peer.worker_idx in pending.waiting:
            if error is None:
                pending.acked.add(peer.worker_idx)
            else:
                pending.nacks[peer.worker_idx] = error
                if retryable:
                    pending.retryable.add(peer.worker_idx)
            pending.settle(peer.worker_idx)
        if error is not None:
            log.warning(
                "worker %d could not apply version %d: %s",
                peer.worker_idx,
                version,
                _excerpt(error),
            )

    async def _on_hello(self, routing: PeerId, hello: Hello) -> None:
        try:
            reason = self._refusal(hello)
        except Exception as exc:  # whatever a strange hello trips, it is refused, never fatal
            reason = f"the hello could not be checked: {_excerpt(repr(exc))}"
        if reason is None:
            old = self._peers.get(hello.worker_idx)
            if old is not None and not old.lost and not await self._probe_gone(old):
                reason = (
                    f"worker index {hello.worker_idx} is already connected "
                    f"(pid {old.pid}); a second claimant is refused"
                )
        channel = self._channel
        assert channel is not None
        if reason is not None:
            log.warning("refused worker %d: %s", hello.worker_idx, _excerpt(reason, 2000))
            with contextlib.suppress(WeightSyncError):
                await channel.send(
                    routing, Refuse(reason=reason[:60000]), timeout=self._timeouts.control
                )
            return
        old = self._peers.pop(hello.worker_idx, None)
        if old is not None:
            self._by_routing.pop(old.routing, None)
            self._mark_lost(old, "replaced by a new connection under the same index")
            # Its process may still map the slot it ran; keep that pinned until it exits. (A
            # plane whose receivers pin nothing would never look at it again.)
            pins = self._plane.pins_receivers
            if pins and not self._peer_gone(old) and old.pid != hello.pid:
                self._retired.append(old)
        conn = Connection(Role.SENDER, hello.worker_idx)
        conn.receive(hello)
        session = secrets.token_hex(16)
        params = {**self._plane.welcome_params(), **self._plane.params_for(self.version)}
        join_route = None
        if self._plane.transfers:
            join_route = self._plane.route(
                [(hello.worker_idx, session)], self.version, purpose="join"
            )
            params.update(self._plane.route_params(join_route, self._timeouts.handshake))
        welcome = Welcome(
            model_id=self.model_id,
            worker_idx=hello.worker_idx,
            session=session,
            version=self.version,
            params=params,
            heartbeat_interval=self._beats.interval,
            missed_beats=self._beats.missed,
        )
        conn.send(welcome)
        peer = _Peer(
            worker_idx=hello.worker_idx,
            routing=routing,
            conn=conn,
            session=welcome.session,
            pid=hello.pid,
            welcome_version=self.version,
            last_seen=time.monotonic(),
            inflight={self.version},
        )
        self._peers[hello.worker_idx] = peer
        self._by_routing[routing] = peer
        try:
            await channel.send(routing, welcome, timeout=self._timeouts.control)
        except WeightSyncError as exc:
            if isinstance(exc, TransportError):
                self._connection_closed(peer)
            self._mark_lost(peer, f"could not be welcomed: {exc}")
            if join_route is not None:
                self._release(welcome.version, join_route)
        else:
            if join_route is not None and self._tasks is not None:
                deadline = time.monotonic() + self._timeouts.handshake
                self._tasks.start_soon(self._bring_up, peer, welcome.version, join_route, deadline)
        self._notify()

    async def _bring_up(self, peer: _Peer, version: int, route: Any, deadline: float) -> None:
        """Move the welcome version to a joining worker (planes with transfers)."""
        try:
            await _in_thread(self._plane.transfer, version, route, deadline)
        except _NotStarted as exc:
            self._release(version, route)
            log.warning("worker %d: no thread to bring it up: %s", peer.worker_idx, exc)
        except WeightSyncError as exc:
            # The worker hears of it too (its receive fails) and its connect() raises.
            log.warning(
                "worker %d could not be brought up to version %d: %s", peer.worker_idx, version, exc
            )

    def _release(self, version: int, route: Any) -> None:
        """Give back a route whose transfer will never run (a transfer past its deadline
        returns at once, dropping the group and the route's hold on the slot)."""
        with contextlib.suppress(WeightSyncError):
            self._plane.transfer(version, route, 0.0)

    def _refusal(self, hello: Hello) -> str | None:
        if hello.protocol != PROTOCOL_VERSION:
            return f"protocol {hello.protocol} is not supported (sender speaks {PROTOCOL_VERSION})"
        if hello.model_id != self.model_id:
            return f"this sender serves model {self.model_id!r}, not {hello.model_id!r}"
        if not 0 <= hello.worker_idx < self.num_workers:
            return f"worker index {hello.worker_idx} is out of range(0, {self.num_workers})"
        if hello.fingerprint != self.layout.fingerprint:
            ours, theirs_count = len(self.layout.specs), len(hello.layout)
            if theirs_count > 2 * ours + 64:
                # Not worth a layout of its own (and a hostile hello can name a million).
                return f"the receiver's model has {theirs_count} tensors, the sender's {ours}"
            try:
                theirs = Layout.from_descs(hello.layout)
            except (WeightSyncError, ValueError, TypeError, OverflowError) as exc:
                return f"the receiver's model layout is invalid: {_excerpt(str(exc))}"
            # Every difference is counted: the count of keys was bounded above.
            lines = self.layout.differences(theirs) or ["layouts differ (alignment or order)"]
            shown = "\n  ".join(lines[:_SHOWN])
            more = f"\n  ... and {len(lines) - _SHOWN} more" if len(lines) > _SHOWN else ""
            return f"the receiver's model does not match the sender's:\n  {shown}{more}"
        return None

    async def _probe_gone(self, peer: _Peer) -> bool:
        """True when the old holder of an index is demonstrably gone."""
        if self._same_host:
            return self._peer_gone(peer)
        channel = self._channel
        assert channel is not None
        beat = Heartbeat(worker_idx=SENDER_INDEX, session=peer.session, version=self.version)
        try:
            await channel.send(peer.routing, beat, timeout=0)
        except TransportError:
            return True
        except WeightSyncError:
            return False
        return False

    # -- sending ------------------------------------------------------------------------------

    def check_targets(self, targets: list[int]) -> None:
        if self._channel is None:
            raise WeightSyncError("the sender is shut down")
        unavailable = [
            w
            for w in targets
            if w not in self._peers
            or self._peers[w].lost
            or self._peers[w].conn.state in _DEAD_STATES
        ]
        if unavailable:
            raise WorkerLostError(
                "cannot send: targeted workers are lost or not connected", unavailable
            )

    def _pinned_versions(self) -> set[int]:
        pinned = {self.version}
        if not self._plane.pins_receivers:
            return pinned
        self._retired = [p for p in self._retired if not self._peer_gone(p)]
        for peer in [*self._peers.values(), *self._retired]:
            acked = peer.conn.acked_version
            if acked in pinned and peer.inflight <= pinned:
                continue  # pins nothing more: no need to ask whether its process lives
            if self._peer_gone(peer):
                continue
            pinned.add(acked)
            pinned |= peer.inflight
        return pinned

    async def send(
        self,
        source: Callable[[], Source],
        targets: list[int],
        timeout: float | None,
        hint: Hashable = None,
    ) -> SendResult:
        """Stage ``source()`` as the next version and deliver it to ``targets``. ``hint``
        names where the weights come from (see :meth:`SenderPlane.write_checked`)."""
        started = time.perf_counter()
        self.check_targets(targets)
        deadline = None if timeout is None else time.monotonic() + timeout
        stage_limit = self._timeouts.transfer if timeout is None else timeout
        move_by = time.monotonic() + stage_limit
        # Only waiting for the lock or for a staging thread can overrun the deadline; a small
        # send that finds the lock free never suspends before its announcements go out.
        may_wait = self._send_lock.locked() or not self._stages_inline
        try:
            with anyio.fail_after(stage_limit) if may_wait else contextlib.nullcontext():
                await self._send_lock.acquire()
                try:
                    self.check_targets(targets)
                    version, pending, stage_s, route = await self._stage_and_announce(
                        source, targets, move_by, hint
                    )
                except BaseException:
                    self._send_lock.release()
                    raise
        except TimeoutError:
            raise WeightSyncTimeout(
                f"send did not stage within {stage_limit:g} s", targets
            ) from None
        try:
            try:
                if route is not None:
                    # Still under the lock: a retry must be announced before the next version.
                    await self._deliver(version, pending, route, move_by)
            finally:
                try:
                    if self._plane.transfers:
                        # However this ended (even cancelled), the version is read from the
                        # caller's weights now, never after send() stopped waiting.
                        await to_the_end(anyio.to_thread.run_sync(self._plane.seal, version))
                finally:
                    self._send_lock.release()
            wait = self._timeouts.ack if deadline is None else max(0.0, deadline - time.monotonic())
            await pending.done.wait(wait)
        finally:
            self._pending.pop(version, None)
        elapsed = time.perf_counter() - started
        missing = sorted(pending.waiting)
        if missing:
            raise _with_outcome(
                WeightSyncTimeout(f"version {version} was not acknowledged in time", missing),
                version,
                pending,
            )
        if pending.lost:
            raise _with_outcome(
                LostDuringSendError(
                    f"workers were lost during the send of version {version}", pending.lost
                ),
                version,
                pending,
            )
        if pending.nacks:
            raise _with_outcome(RemoteApplyError(version, pending.nacks), version, pending)
        return SendResult(
            version, tuple(sorted(pending.acked)), self.layout.total_bytes, elapsed, stage_s
        )

    async def _stage_and_announce(
        self, source: Callable[[], Source], targets: list[int], move_by: float, hint: Hashable
    ) -> tuple[int, _Pending, float, Any]:
        slot = self._plane.reserve(self._pinned_versions())
        t0 = time.perf_counter()
        try:
            if self._stages_inline:
                # ``source()`` checks the weights against the layout before any byte is written.
                self._plane.write(slot, source())
            else:
                await self._stage_off_loop(slot, source, hint)
                if time.monotonic() >= move_by:
                    # The copy cannot be interrupted, so its deadline is checked here: a version
                    # staged too late is never announced.
                    raise TimeoutError
        except BaseException:
            self._plane.release(slot)
            raise
        stage_s = time.perf_counter() - t0
        channel = self._channel
        if channel is None:
            raise WeightSyncError("the sender shut down while this version was being staged")
        # From here on the version exists: announce it to every target even if cancelled.
        # Nothing below suspends unless a socket cannot take an update at once, and those
        # announcements are shielded.
        version = self.version + 1
        params = self._plane.publish(slot, version)
        self.version = version
        pending = _Pending(version, set(targets))
        self._pending[version] = pending
        route = None
        try:
            members = [self._peers[w] for w in targets if not self._peers[w].lost]
            if self._plane.transfers and members:
                route = self._plane.route([(p.worker_idx, p.session) for p in members], version)
                left = max(0.001, move_by - time.monotonic())
                params = {**params, **self._plane.route_params(route, left)}
            update = Update(version=version, params=params)
            blocked: list[_Peer] = []
            for worker in targets:
                peer = self._peers[worker]
                if peer.lost:
                    pending.lost.add(worker)
                    pending.settle(worker)
                elif not self._announce_nowait(channel, peer, update):
                    blocked.append(peer)
            if blocked:
                await to_the_end(self._announce_all(channel, blocked, update, queued=True))
            if not targets:
                pending.done.set()
        except BaseException:
            # Cancelled or failed after the version was taken: nobody will wait for it. A route
            # that will never carry it is given back (its group dropped, so receivers waiting on
            # it fail instead of taking a later version's bytes for this one), and the version
            # is read from the caller's weights now, never after send() returned.
            self._pending.pop(version, None)
            if route is not None:
                self._release(version, route)
            if self._plane.transfers:
                await to_the_end(anyio.to_thread.run_sync(self._plane.seal, version))
            raise
        return version, pending, stage_s, route

    async def _stage_off_loop(
        self, slot: int, source: Callable[[], Source], hint: Hashable = None
    ) -> None:
        """Check ``source`` and copy it into ``slot`` in this sender's staging thread.

        The slot goes back only once its copy has ended, however the send is cancelled: a copy
        still running would write into the next send's version.
        """
        if self._stager is None:
            self._stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aiowsync-stage")

        def stage() -> None:
            # ``source()`` checks the weights against the layout; the plane may start copying
            # an earlier send's tensors meanwhile, and keeps that copy only if they are the
            # same tensors (see SenderPlane.write_checked).
            self._plane.write_checked(slot, source, hint)

        await to_the_end(asyncio.get_running_loop().run_in_executor(self._stager, stage))

    async def _announce_all(
        self, channel: SenderChannel, peers: list[_Peer], update: Update, *, queued: bool = False
    ) -> None:
        """Announce ``update`` to ``peers``; ``queued``: already recorded by
        :meth:`_announce_nowait`, which found no room."""
        for peer in peers:
            if queued or not self._announce_nowait(channel, peer, update):
                await self._announce_rest(channel, peer, update)

    def _announce_nowait(self, channel: SenderChannel, peer: _Peer, update: Update) -> bool:
        """Record ``update`` as sent to ``peer`` and queue it; False if the socket has no room
        right now (then :meth:`_announce_rest` must finish the job)."""
        try:
            peer.conn.send(update)
            peer.inflight.add(update.version)
            return channel.send_nowait(peer.routing, update)
        except WeightSyncError as exc:
            self._announce_failed(peer, exc)
            return True

    async def _announce_rest(self, channel: SenderChannel, peer: _Peer, update: Update) -> None:
        try:
            await channel.send(peer.routing, update, timeout=self._timeouts.control)
        except WeightSyncError as exc:
            self._announce_failed(peer, exc)

    def _announce_failed(self, peer: _Peer, exc: WeightSyncError) -> None:
        if isinstance(exc, TransportError):
            self._connection_closed(peer)
        self._mark_lost(peer, f"update could not be sent: {exc}")

    async def _deliver(self, version: int, pending: _Pending, route: Any, move_by: float) -> None:
        """Move ``version`` to its targets; retry those whose transfer failed.

        When a collective fails its group is torn down, so every member still alive fails fast
        and nacks as retryable; those are sent the same version again, with a higher attempt
        number, on a fresh group. A member that stays silent is dead or stalled: the deadline
        (or its heartbeats) names it. Returns once every target answered, or at the deadline.
        """
        members = [self._peers[w] for w in sorted(pending.waiting) if w in self._peers]
        attempt, failed = 0, False
        while True:
            if route is not None:
                try:
                    await self._chained(version, route, move_by)
                except WeightSyncError as exc:
                    log.warning("version %d, attempt %d: %s", version, attempt, exc)
                    failed = True
                else:
                    if not failed:
                        return
                    route = None  # a retry went through; others may still report failures
                if route is not None:
                    # Give this attempt's members a moment to report their failed receive.
                    grace = min(RETRY_GRACE, max(0.0, move_by - time.monotonic()))
                    with anyio.move_on_after(grace):
                        while any(p.worker_idx in pending.waiting for p in members):
                            await pending.changed.wait()
            retry = [
                p
                for p in members
                if p.worker_idx in pending.retryable
                and not p.lost
                and self._peers.get(p.worker_idx) is p
            ]
            left = move_by - time.monotonic()
            channel = self._channel
            if left <= 0 or channel is None or (not retry and pending.done.is_set()):
                return
            if not retry:
                # Someone is still silent; a late report of a failed receive is retried too.
                route = None
                with anyio.move_on_after(left):
                    await pending.changed.wait()
                continue
            if attempt >= MAX_ATTEMPTS:
                log.warning("version %d: giving up after %d attempts", version, attempt + 1)
                return
            attempt += 1
            route = self._plane.route([(p.worker_idx, p.session) for p in retry], version)
            update = Update(
                version=version, attempt=attempt, params=self._plane.route_params(route, left)
            )
            pending.reopen([p.worker_idx for p in retry])
            try:
                await to_the_end(self._announce_all(channel, retry, update))
            except BaseException:
                self._release(version, route)  # it will never carry this version
                raise

    async def _chained(self, version: int, route: Any, move_by: float) -> None:
        """Transfer in a thread, once the previous chained transfer has finished."""
        previous, mine = self._last_transfer, threading.Event()
        self._last_transfer = mine

        def run() -> None:
            try:
                self._plane.transfer(version, route, move_by, after=previous)
            finally:
                if previous.is_set():
                    mine.set()
                else:
                    # This one gave up waiting for the previous transfer, which still runs: the
                    # next must wait for both, but this send need not wait any longer.
                    threading.Thread(
                        target=_set_after,
                        args=(previous, mine, self._timeouts.transfer),
                        name="aiowsync-chain",
                        daemon=True,
                    ).start()

        try:
            await _in_thread(run)
        except _NotStarted as exc:
            mine.set()  # never ran: the next transfer must not wait for it
            self._release(version, route)
            raise TransportError(f"could not start a transfer thread: {exc}") from None


MAX_ATTEMPTS = 4
"""Retries of one version within one send (the wire allows far more)."""

_SHOWN = 50
"""Differences a refusal lists."""


def _set_after(previous: threading.Event, mine: threading.Event, limit: float) -> None:
    previous.wait(limit)
    mine.set()


_DISOWNED_KEPT = 256
"""Routing ids :meth:`SenderCore._disown` remembers having told."""

_QUEUED_PER_BEAT = 256
"""Queued messages read before each round of beats, at most (a flood must not delay them)."""


def _excerpt(text: str, limit: int = 500) -> str:
    """``text`` cut to ``limit`` characters, as one line (text from a peer goes into logs)."""
    text = text.replace("\n", " ").replace("\r", " ")
    return text if len(text) <= limit else text[:limit] + "..."


RETRY_GRACE = 0.5
"""After a failed transfer, how long the sender waits for the members' answers before it
retries those that reported a failed receive."""


async def _in_thread(fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn`` in a new thread, started before this returns to the loop.

    Cancelling the caller abandons the wait, not the work: a transfer that started always
    runs to its end (each of its waits has a deadline), so collectives never go half-done.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def run() -> None:
        error: BaseException | None = None
        try:
            fn(*args)
        except BaseException as exc:  # handed to the waiting task
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, error)

    try:
        threading.Thread(target=run, name="aiowsync-transfer", daemon=True).start()
    except RuntimeError as exc:  # no thread could be started
        raise _NotStarted(str(exc)) from None
    await future


class _NotStarted(RuntimeError):
    pass


def _with_outcome(exc: WeightSyncError, version: int, pending: _Pending) -> WeightSyncError:
    exc.version = version
    exc.acked = tuple(sorted(pending.acked))
    return exc
