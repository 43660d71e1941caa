"""The receiver's intake of updates: its background task, the inline fast path, pull mode,
and the answers it sends.

:class:`UpdateLoop` works on the :class:`ReceiverState` it is given (the link to the sender),
switches versions through its :class:`Applier`, and reads the leased versions from
``pinned``. It holds nothing of the engine that made it.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Mapping

import anyio

from .._channel import ReceiverChannel
from .._exceptions import (
    NotConnectedError,
    ProtocolError,
    TransportError,
    WeightSyncError,
    WeightSyncTimeout,
)
from .._planes.digest import DigestMismatch, forwarded_by
from .._protocol import Ack, Bye, Heartbeat, Message, Nack, ParamValue, Update
from .._util.shield import to_the_end
from .._util.text import error_text
from .apply import Applier
from .state import ReceiverState

__all__ = ["UpdateLoop"]

log = logging.getLogger("aiowsync.receiver")

NACK_ON_CANCEL_S = 0.5
"""How long an apply cancelled by shutdown spends telling the sender."""


class UpdateLoop:
    def __init__(
        self,
        state: ReceiverState,
        applier: Applier,
        pinned: Callable[[], tuple[int, ...]],
        *,
        shield: bool = False,
    ) -> None:
        """``pinned()`` gives the leased versions whose bytes the sender keeps for this
        worker (every answer carries them)."""
        self._state = state
        self._applier = applier
        self._pinned = pinned
        self.shield = shield
        """Pull mode: an update taken off the wire is applied and answered even if the
        caller's deadline fires meanwhile."""
        self._late: tuple[Update, Ack | Nack] | None = None
        """An update switched to within the channel's callback whose answer found no room
        there; :meth:`run` sends it."""

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Background task: apply every update as it comes.

        Beats and most updates are handled as they arrive, within the channel's callback
        (:meth:`_take_inline`); this task gets the rest, in order.
        """
        channel = self._state.channel
        if channel is not None:
            channel.take_inline(self._take_inline)
        task_status.started()
        try:
            while self._state.bye is None:
                try:
                    if await self._step(timeout=self._state.beats.interval) is not None:
                        continue
                except WeightSyncTimeout:
                    pass
                await self._announce_reconnection()
        finally:
            if channel is not None:
                channel.take_inline(None)

    def _take_inline(self, message: Message) -> bool:
        """Handle ``message`` on the spot if that needs no wait; False leaves it to :meth:`run`.

        Called by the channel while :meth:`run` waits for a message: on the loop, or on the
        channel's waker thread while the loop waits for events and runs nothing (see
        :mod:`aiowsync._channel._waker`). A beat, or an update that a swap-mode receiver
        without hooks can switch to right now (no reader holds the guard), is handled here,
        a loop pass and a task wake-up sooner. The outcome is the same as through
        :meth:`_handle`.
        """
        if self._state.bye is not None:
            return False
        if isinstance(message, Heartbeat):
            self._on_beat(message)
            return True
        if not isinstance(message, Update):
            return False
        if not self._from_sender(message):
            return True
        version = message.version
        try:
            switched = self._applier.switch_now(
                version, message.params, lambda: self._state.conn.receive(message)
            )
        except ProtocolError as exc:
            self._broken(exc)
            return True
        if switched is False:
            return False
        answer: Ack | Nack
        if isinstance(switched, Exception):
            answer = self._failure(version, switched, message.params)
        else:
            answer = Ack(
                worker_idx=self._state.worker_idx,
                version=version,
                leased=self._pinned(),
            )
        channel = self._state.channel
        if channel is None:
            return True
        self._state.conn.send(answer)
        try:
            if channel.send_nowait(answer):
                return True
        except WeightSyncError:
            pass  # run() tries again and meets the same error the way it always does
        self._late = (message, answer)
        return False

    async def _announce_reconnection(self) -> None:
        """After the connection to the sender was renewed, beat once on it.

        The sender gives up on a worker that stayed silent too long (a stopped process, a
        network outage) and drops its connection; the beat thread's own connection cannot
        tell it that updates reach this worker again, a beat on the main connection does.
        Renewals are counted rather than watched for as down-then-up, since a drop and a
        reconnection can both happen between two looks.
        """
        channel = self._state.channel
        if channel is None or not channel.peer_alive:
            return
        count = channel.connections
        if count == self._state.connections_seen:
            return
        try:
            await channel.send(self._state.heartbeat(self._applier.version), timeout=0)
        except WeightSyncError:
            return  # not queued: the next look tries again
        self._state.connections_seen = count

    async def receive(self, timeout: float) -> int | None:
        """Pull mode: apply the next update if one arrives within ``timeout``; its version."""
        if self._state.channel is None or self._state.bye is not None:
            self._state.check_sender(self._applier.version)
        before = self._applier.version
        activity = self._state.activity
        activity.pull = True
        activity.enter_receive()
        try:
            return await self._receive(before, timeout)
        finally:
            activity.leave_receive()

    async def _receive(self, before: int, timeout: float) -> int | None:
        with anyio.move_on_after(timeout):
            # What is queued is read before a lost connection counts: a goodbye may be there.
            while self._applier.version == before:
                await self._announce_reconnection()
                try:
                    if await self._step(timeout=self._state.beats.interval) is not None:
                        return self._applier.version
                except WeightSyncTimeout:
                    pass
                if self._state.gone(self._applier.version) is not None:
                    break
        # An update applied whose answer could not be sent still counts.
        if self._applier.version != before:
            return self._applier.version
        self._state.check_sender(self._applier.version)
        return None

    async def _step(self, timeout: float | None) -> int | None:
        channel = self._state.channel
        if channel is None:
            raise NotConnectedError("the receiver is closed")
        message = await channel.recv(timeout=timeout)
        return await self._handle(message)

    async def _handle(self, message: Message) -> int | None:
        late = self._late
        if late is not None and late[0] is message:
            # Switched to already (see _take_inline); only the answer is left to send.
            self._late = None
            channel = self._state.channel
            if channel is not None:
                await self._deliver_answer(channel, late[1])
            return message.version
        if self._state.bye is not None:
            return None  # nothing more is taken from a sender that left or broke the protocol
        if isinstance(message, Heartbeat):
            self._on_beat(message)
            return None
        if isinstance(message, Update) and not self._from_sender(message):
            return None
        try:
            self._state.conn.receive(message)
        except ProtocolError as exc:
            self._broken(exc)
            return None
        if isinstance(message, Bye):
            self._state.bye = message.reason or "sender said goodbye"
            self._state.said_bye = True
            if self._state.channel is not None:
                # Beats would only reach a sender that left, or one that never knew us.
                self._state.channel.stop_heartbeat()
            log.info(
                "worker %d: sender closed the connection (%s)",
                self._state.worker_idx,
                self._state.bye,
            )
            self._state.notify()
            return None
        if isinstance(message, Update):
            # In pull mode an update taken off the wire is answered even if the caller's
            # deadline fires meanwhile; in background mode only shutdown cancels, and then the
            # sender is told.
            if self.shield:
                await to_the_end(self.apply_and_answer(message.version, message.params))
            else:
                await self.apply_and_answer(message.version, message.params)
            return message.version
        return None

    def _on_beat(self, beat: Heartbeat) -> None:
        # Only the sender's own beat confirms the connection: the session is no secret (this
        # worker's beats carry it to whoever holds the address), the proof is.
        state, channel = self._state, self._state.channel
        if (
            beat.session == state.session
            and _proves(beat.proof, state.proof)
            and channel is not None
        ):
            state.confirmed = channel.connections

    def _from_sender(self, update: Update) -> bool:
        """Whether ``update`` carries the proof of the sender this worker joined. An update
        without it comes from another process on the sender's address (the sender died and
        something else bound it): it is refused and counted, the model keeps its version,
        and this worker takes nothing more from that address (it reports itself
        disconnected)."""
        state = self._state
        if _proves(update.proof, state.proof):
            return True
        state.impostors += 1
        if state.bye is None:
            state.bye = "an update that did not come from the sender this worker joined"
            if state.channel is not None:
                state.channel.stop_heartbeat()  # nothing more for whoever holds the address
            log.warning(
                "worker %d: refused version %d from a process that is not its sender (the "
                "sender's address is held by another process); keeping version %d",
                state.worker_idx,
                update.version,
                self._applier.version,
            )
            state.notify()
        return False

    def _broken(self, exc: ProtocolError) -> None:
        """The sender broke the protocol: stop trusting this connection, keep the weights."""
        self._state.protocol_errors += 1
        self._state.bye = f"protocol error: {exc}"
        log.warning("worker %d: %s; disconnecting", self._state.worker_idx, exc)
        self._state.notify()

    async def apply_and_answer(
        self, version: int, params: Mapping[str, ParamValue], *, must_send: bool = False
    ) -> Ack | Nack:
        """Apply ``version`` and answer the sender. An answer that cannot be sent is logged,
        unless ``must_send`` (the handshake's), when its error is raised."""
        answer: Ack | Nack
        activity = self._state.activity
        activity.applying = version
        try:
            await self._applier.apply(version, params)
            if self._applier.hooks:
                await self._applier.run_hooks(version)
            answer = Ack(
                worker_idx=self._state.worker_idx,
                version=version,
                leased=self._pinned(),
            )
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(NACK_ON_CANCEL_S):
                await self._answer(self._nack(version, "receiver shut down"))
            raise
        except Exception as exc:  # a user hook may raise anything; the sender must hear of it
            answer = self._failure(version, exc, params)
        finally:
            activity.applying = None
        await self._answer(answer, must_send=must_send)
        return answer

    def _failure(self, version: int, exc: Exception, params: Mapping[str, ParamValue]) -> Nack:
        """The nack for ``exc``, raised while applying ``version`` (of update ``params``) or
        by a hook."""
        if isinstance(exc, (WeightSyncError, OSError, RuntimeError, ValueError, TimeoutError)):
            log.warning(
                "worker %d could not apply version %d: %s", self._state.worker_idx, version, exc
            )
            upstream = forwarded_by(params, self._state.worker_idx)
            if isinstance(exc, DigestMismatch) and upstream is not None:
                # The member before it in the chain passed on bytes that are not the
                # sender's: worth another attempt, on a route without that member.
                return self._nack(version, error_text(exc), retryable=True, forwarded=upstream)
            return self._nack(version, error_text(exc), retryable=isinstance(exc, TransportError))
        return self._nack(version, error_text(exc))

    def _nack(
        self, version: int, error: str, *, retryable: bool = False, forwarded: int = -1
    ) -> Nack:
        """A nack of ``version`` that also says which version the model runs now."""
        return Nack(
            worker_idx=self._state.worker_idx,
            version=version,
            error=error,
            retryable=retryable,
            running=self._applier.version,
            leased=self._pinned(),
            forwarded_by=forwarded,
        )

    async def _answer(self, answer: Ack | Nack, *, must_send: bool = False) -> None:
        """Send ``answer``; once begun, not even cancellation stops it."""
        channel = self._state.channel
        if channel is None:
            return
        self._state.conn.send(answer)
        await self._deliver_answer(channel, answer, must_send=must_send)

    async def _deliver_answer(
        self, channel: ReceiverChannel, answer: Ack | Nack, *, must_send: bool = False
    ) -> None:
        """Put ``answer`` on the wire. One that cannot go (the sender left, or its queue stayed
        full) is logged, not raised, unless ``must_send``: the model runs what it runs either
        way, and the sender learns of it from its own deadline."""
        try:
            if channel.send_nowait(answer):
                return
            await to_the_end(channel.send(answer, timeout=self._state.timeouts.control))
        except WeightSyncError as exc:
            if must_send:
                raise
            log.info(
                "worker %d: the answer for version %d could not be sent: %s",
                self._state.worker_idx,
                answer.version,
                exc,
            )


def _proves(given: str, proof: str) -> bool:
    return bool(proof) and hmac.compare_digest(given.encode(), proof.encode())
