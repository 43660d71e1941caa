"""The sender's answer to a hello: a refusal that says why, or a welcome, after which the
worker is brought up to the version it was welcomed at."""

from __future__ import annotations

import contextlib
import logging
import secrets
import time

import anyio

from .. import _protocol as wire
from .._channel import PeerId
from .._exceptions import TransportError, WeightSyncError
from .._planes.base import Delivery
from .._util.pids import pid_namespace
from .._util.text import excerpt, worth_logging
from .handshake import probe_gone, refusal
from .peers import Peer
from .state import SenderState
from .workers import REFUSED

__all__ = ["Greeter"]

log = logging.getLogger("aiowsync.sender")

REFUSAL_CHARS = 60000
"""The longest refusal text sent (a layout mismatch lists its differences)."""
STRAYS_KEPT = 8
"""Out-of-range indices remembered for ``connect()``'s error."""
NOTE_CHARS = 4000
"""The longest refusal text kept for the worker table and ``connect()``'s error."""


class Greeter:
    """Answers the hellos that the control loop reads, from the sender's shared state."""

    def __init__(self, state: SenderState) -> None:
        self._state = state
        self.refusals = 0

    async def answer(
        self, routing: PeerId, hello: wire.Hello, tasks: anyio.abc.TaskGroup | None
    ) -> None:
        """Refuse ``hello`` or welcome its worker; the version it is welcomed at reaches it
        in ``tasks`` (none: the loop is not serving, and the join is given back)."""
        channel = self._state.channel
        assert channel is not None
        refused = refusal(hello, self._state.layout, self._state.model_id, self._state.num_workers)
        reason, told = refused if refused is not None else (None, None)
        if hello.problem and 0 <= hello.worker_idx < self._state.num_workers:
            reason = told = f"it could not start its receiver: {hello.problem}"
        # Where the kernel names the peer's process (a Unix socket), liveness follows that
        # pid, not the one the hello gives (a peer could name a process that never ends).
        kernel_pid = channel.peer_pid(routing)
        pid = hello.pid if kernel_pid is None else kernel_pid
        gone = None if reason is not None else self._state.plane.process_gone(pid)
        if gone is not None:
            # The plane watches its receivers' processes: their pids must be this sender's.
            foreign = kernel_pid is None and hello.pid_ns not in (0, pid_namespace())
            if foreign or gone:
                reason = told = _unseen_process(pid, hello.pid, foreign=foreign)
        if reason is None:
            old = self._state.peers.get(hello.worker_idx)
            gone = old is None or old.lost
            if not gone and old is not None:
                gone = await probe_gone(self._state.peers, channel, old, self._state.beat_for(old))
            if not gone and old is not None:
                reason = told = (
                    f"worker index {hello.worker_idx} is already connected "
                    f"(pid {old.pid}); a second claimant is refused"
                )
        if reason is not None:
            self.refusals += 1
            if worth_logging(self.refusals):  # a flood of hellos must not flood the log
                log.warning(
                    "refused worker %d: %s (%d refusal(s) so far)",
                    hello.worker_idx,
                    excerpt(reason, 2000),
                    self.refusals,
                )
            self._note_refusal(hello.worker_idx, reason)
            with contextlib.suppress(WeightSyncError):
                await channel.refuse(
                    routing,
                    wire.Refuse(reason=(told or reason)[:REFUSAL_CHARS]),
                    protocol=_answer_in(hello.protocol),
                    timeout=self._state.timeouts.control,
                )
            return
        self._state.peers.replace(hello.worker_idx)
        conn = wire.Connection(wire.Role.SENDER, hello.worker_idx)
        conn.receive(hello)
        session = secrets.token_hex(16)
        join = self._state.plane.deliver(
            self._state.version,
            [(hello.worker_idx, session)],
            time.monotonic() + self._state.timeouts.handshake,
            purpose="join",
        )
        welcome = wire.Welcome(
            model_id=self._state.model_id,
            worker_idx=hello.worker_idx,
            session=session,
            version=self._state.version,
            params=self._state.with_digest(
                self._state.version, {**self._state.plane.welcome_params(), **join.params}
            ),
            heartbeat_interval=self._state.beats.interval,
            proof=self._state.proof,
        )
        conn.send(welcome)
        peer = Peer(
            worker_idx=hello.worker_idx,
            routing=routing,
            conn=conn,
            session=session,
            pid=pid,
            welcome_version=self._state.version,
            last_seen=time.monotonic(),
            inflight={self._state.version},
            host=hello.host,
        )
        self._state.peers.add(peer)
        try:
            await channel.send(routing, welcome, timeout=self._state.timeouts.control)
        except WeightSyncError as exc:
            if isinstance(exc, TransportError):
                self._state.peers.connection_closed(peer)
            self._state.peers.mark_lost(peer, f"could not be welcomed: {exc}")
            join.abandon()
        else:
            if tasks is not None:
                tasks.start_soon(self._bring_up, peer, welcome.version, join)
            else:
                join.abandon()
        self._state.notify()

    def _note_refusal(self, worker: int, reason: str) -> None:
        """Keep why ``worker`` was refused, for the worker table and ``connect()``'s error,
        unless the index is held by a worker that takes updates (a refused second claimant
        says nothing about it)."""
        peers = self._state.peers
        if not 0 <= worker < self._state.num_workers:
            peers.strays.pop(worker, None)
            peers.strays[worker] = reason[:NOTE_CHARS]
            while len(peers.strays) > STRAYS_KEPT:
                del peers.strays[next(iter(peers.strays))]
            return
        holder = peers.get(worker)
        if holder is None or holder.lost:
            peers.notes[worker] = f"{REFUSED}{reason[:NOTE_CHARS]}"
            peers.refused_at[worker] = time.monotonic()
            self._state.notify()  # a connect() waiting for it can stop waiting

    async def _bring_up(self, peer: Peer, version: int, join: Delivery) -> None:
        """Move the welcome version to a joining worker, where the plane moves bytes."""
        try:
            await join.run(None)
        except WeightSyncError as exc:
            # The worker hears of it too (its receive fails) and its connect() raises.
            log.warning(
                "worker %d could not be brought up to version %d: %s", peer.worker_idx, version, exc
            )


def _answer_in(protocol: int) -> int:
    """The version a refusal goes back in: the hello's own, which a peer of another version
    reads, unless no frame header can carry it (a hello that names an impossible one)."""
    return protocol if 0 <= protocol <= 255 else wire.PROTOCOL_VERSION


def _unseen_process(pid: int, claimed: int, *, foreign: bool) -> str:
    """Why a worker whose process this sender cannot see is refused: its pins would follow
    another process (or none: dropped at once), and its slots be written while it reads."""
    if foreign:
        whose = f"its process (pid {pid} where it runs) is not in this sender's pid namespace"
    elif pid == 0:
        whose = "the kernel cannot name its process here"
    else:
        alias = "" if pid == claimed else f", {claimed} by its word"
        whose = f"its process (pid {pid}{alias}) does not exist here"
    return (
        f"{whose}: it runs in another pid namespace (another container) or on another host, "
        "and shared memory needs the sender and its workers on one host in one pid namespace"
    )
