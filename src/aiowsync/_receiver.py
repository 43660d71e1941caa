"""The receiver's engine: handshake, applying versions tear-free, acks, hooks and pull mode."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import anyio
import torch

from ._apply import Applier, ApplyMode, Hook
from ._channel import ChannelFactory, ReceiverChannel
from ._config import Heartbeats, Timeouts
from ._exceptions import (
    ConnectError,
    NotConnectedError,
    ProtocolError,
    RefusedError,
    TransportError,
    WeightSyncError,
    WeightSyncTimeout,
)
from ._guard import ReadGuard
from ._layout import Layout
from ._libc import libc
from ._plane import ReceiverPlane
from ._protocol import (
    PROTOCOL_VERSION,
    Ack,
    Bye,
    Connection,
    Heartbeat,
    Hello,
    Message,
    Nack,
    ParamValue,
    Refuse,
    Role,
    Update,
    Welcome,
)
from ._shield import to_the_end
from ._signal import Signal
from ._text import error_text

__all__ = ["ApplyMode", "Hook", "ReceiverCore"]

log = logging.getLogger("aiowsync.receiver")


BYE_FLUSH_S = 1.0
"""How long closing may wait for a queued goodbye to leave (it takes microseconds when the
sender is there)."""
BYE_WINDOW_S = 0.5
"""How long closing spends on its goodbye (and a cancelled apply on its nack)."""
BYE_SEND_S = 0.2
"""How long the goodbye may wait for room on the socket."""


class ReceiverCore:
    def __init__(
        self,
        *,
        channels: ChannelFactory,
        plane: ReceiverPlane,
        layout: Layout,
        targets: Mapping[str, torch.Tensor],
        worker_idx: int,
        model_id: str,
        address: str,
        apply_mode: ApplyMode,
        timeouts: Timeouts,
        heartbeats: Heartbeats,
        guard: ReadGuard,
        hooks: list[Hook],
    ) -> None:
        self._channels = channels
        self._plane = plane
        self.layout = layout
        self.worker_idx = worker_idx
        self.model_id = model_id
        self.address = address
        self.apply_mode = apply_mode
        self._timeouts = timeouts
        self._beats = heartbeats
        self._channel: ReceiverChannel | None = None
        self._conn = Connection(Role.RECEIVER, worker_idx)
        self.guard = guard
        self.hooks = hooks
        self.shield_updates = False
        self.protocol_errors = 0
        self._bye: str | None = None
        self._session = ""
        self._changed = Signal()
        self._applier = Applier(
            plane=plane,
            layout=layout,
            targets=targets,
            mode=apply_mode,
            guard=guard,
            hooks=hooks,
            timeouts=timeouts,
            on_switch=self._notify,
        )
        self._late: tuple[Update, Ack | Nack] | None = None
        """An update switched to within the channel's callback whose answer found no room
        there; :meth:`run` sends it."""
        self._connections_seen = 0
        self._confirmed = -1
        """The count of connections to the sender when it last showed that it knows this
        worker's session (see :attr:`connected`)."""

    @property
    def version(self) -> int:
        """The version the model runs (-1 before the first)."""
        return self._applier.version

    # -- status -------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Connected to the sender that welcomed this worker.

        A renewed connection counts only once that sender shows it knows this worker (a
        beat naming its session): a sender restarted on the same address takes the socket's
        reconnection, but has never heard of this worker and never will.
        """
        channel = self._channel
        return (
            channel is not None
            and self._bye is None
            and channel.peer_alive
            and channel.connections == self._confirmed
        )

    @property
    def dropped(self) -> int:
        channel = self._channel
        return self.protocol_errors + (0 if channel is None else channel.dropped)

    def _notify(self) -> None:
        self._changed.notify()

    async def wait_for_version(self, version: int, timeout: float) -> int:
        try:
            with anyio.fail_after(timeout):
                while self.version < version:
                    await self._changed.wait()
        except TimeoutError:
            raise WeightSyncTimeout(
                f"worker {self.worker_idx} still runs version {self.version}, "
                f"not {version}, after {timeout:g} s"
            ) from None
        return self.version

    # -- handshake ----------------------------------------------------------------------------

    async def connect(self, timeout: float) -> None:
        channel = self._channels.connect(self.address, heartbeat_timeout=self._beats.timeout)
        self._channel = channel
        try:
            with anyio.fail_after(timeout):
                welcome = await self._handshake(channel)
                # The sender judges this worker's liveness from the welcome on, and bringing
                # a big model up to date can take longer than its patience: beat already.
                channel.start_heartbeat(self._heartbeat, welcome.heartbeat_interval)
                self._connections_seen = self._confirmed = channel.connections
                self._plane.setup(self.layout, welcome.params, swap=self.apply_mode == "swap")
                answer = await self._apply_and_answer(welcome.version, welcome.params)
        except TimeoutError:
            await self._abandon()
            raise WeightSyncTimeout(
                f"worker {self.worker_idx}: no answer from the sender at {self.address} "
                f"within {timeout:g} s",
                [self.worker_idx],
            ) from None
        except BaseException:
            await self._abandon()
            raise
        if isinstance(answer, Nack):
            await self._abandon()
            raise ConnectError(
                f"worker {self.worker_idx} could not apply version {welcome.version}: "
                f"{answer.error}"
            )
        if self.apply_mode == "swap":
            _return_freed_memory()

    def _heartbeat(self) -> Heartbeat:
        return Heartbeat(
            worker_idx=self.worker_idx, session=self._session, version=max(self.version, 0)
        )

    async def _handshake(self, channel: ReceiverChannel) -> Welcome:
        hello = Hello(
            protocol=PROTOCOL_VERSION,
            model_id=self.model_id,
            worker_idx=self.worker_idx,
            fingerprint=self.layout.fingerprint,
            layout=self.layout.descs(),
            pid=os.getpid(),
        )
        self._conn.send(hello)
        await channel.send(hello, timeout=self._timeouts.control)
        while True:
            message = await channel.recv(timeout=None)
            if isinstance(message, Heartbeat):
                continue
            self._conn.receive(message)
            if isinstance(message, Refuse):
                raise RefusedError(message.reason)
            if isinstance(message, Welcome):
                if message.worker_idx != self.worker_idx or message.model_id != self.model_id:
                    raise ProtocolError("welcome names another worker or model")
                self._session = message.session
                return message
            raise ProtocolError(f"unexpected {type(message).__name__} during the handshake")

    # -- updates ------------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Background task: apply every update as it comes.

        Beats and most updates are handled as they arrive, within the channel's callback
        (:meth:`_take_inline`); this task gets the rest, in order.
        """
        channel = self._channel
        if channel is not None:
            channel.take_inline(self._take_inline)
        task_status.started()
        try:
            while self._bye is None:
                try:
                    if await self._step(timeout=self._beats.interval) is not None:
                        continue
                except WeightSyncTimeout:
                    pass
                await self._announce_reconnection()
        finally:
            if channel is not None:
                channel.take_inline(None)

    def _take_inline(self, message: Message) -> bool:
        """Handle ``message`` on the spot if that needs no wait; False leaves it to :meth:`run`.

        Called by the channel, on the loop, while :meth:`run` waits for a message: a beat,
        or an update that a swap-mode receiver without hooks can switch to right now (no
        reader holds the guard), is handled here, a loop pass and a task wake-up sooner.
        The outcome is the same as through :meth:`_handle`.
        """
        if self._bye is not None:
            return False
        if isinstance(message, Heartbeat):
            self._on_beat(message)
            return True
        if not isinstance(message, Update):
            return False
        version = message.version
        try:
            switched = self._applier.switch_now(
                version, message.params, lambda: self._conn.receive(message)
            )
        except ProtocolError as exc:
            self._broken(exc)
            return True
        if switched is False:
            return False
        answer: Ack | Nack
        if isinstance(switched, Exception):
            answer = self._failure(version, switched)
        else:
            answer = Ack(worker_idx=self.worker_idx, version=version)
        channel = self._channel
        if channel is None:
            return True
        self._conn.send(answer)
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
        channel = self._channel
        if channel is None or not channel.peer_alive:
            return
        count = channel.connections
        if count == self._connections_seen:
            return
        try:
            await channel.send(self._heartbeat(), timeout=0)
        except WeightSyncError:
            return  # not queued: the next look tries again
        self._connections_seen = count

    async def receive(self, timeout: float) -> int | None:
        """Pull mode: apply the next update if one arrives within ``timeout``; its version."""
        if self._channel is None:
            raise NotConnectedError("connect() first")
        before = self.version
        with anyio.move_on_after(timeout):
            while self._bye is None and self.version == before:
                await self._announce_reconnection()
                try:
                    if await self._step(timeout=self._beats.interval) is not None:
                        return self.version
                except WeightSyncTimeout:
                    pass
        # An update applied whose answer could not be sent still counts.
        return self.version if self.version != before else None

    async def _step(self, timeout: float | None) -> int | None:
        channel = self._channel
        if channel is None:
            raise NotConnectedError("the receiver is closed")
        message = await channel.recv(timeout=timeout)
        return await self._handle(message)

    async def _handle(self, message: Message) -> int | None:
        late = self._late
        if late is not None and late[0] is message:
            # Switched to already (see _take_inline); only the answer is left to send.
            self._late = None
            channel = self._channel
            if channel is not None:
                await to_the_end(channel.send(late[1], timeout=self._timeouts.control))
            return message.version
        if self._bye is not None:
            return None  # nothing more is taken from a sender that left or broke the protocol
        if isinstance(message, Heartbeat):
            self._on_beat(message)
            return None
        try:
            self._conn.receive(message)
        except ProtocolError as exc:
            self._broken(exc)
            return None
        if isinstance(message, Bye):
            self._bye = message.reason or "sender said goodbye"
            if self._channel is not None:
                # Beats would only reach a sender that left, or one that never knew us.
                self._channel.stop_heartbeat()
            log.info("worker %d: sender closed the connection (%s)", self.worker_idx, self._bye)
            self._notify()
            return None
        if isinstance(message, Update):
            # In pull mode an update taken off the wire is answered even if the caller's
            # deadline fires meanwhile; in background mode only shutdown cancels, and then the
            # sender is told.
            if self.shield_updates:
                await to_the_end(self._apply_and_answer(message.version, message.params))
            else:
                await self._apply_and_answer(message.version, message.params)
            return message.version
        return None

    def _on_beat(self, beat: Heartbeat) -> None:
        if beat.session and beat.session == self._session and self._channel is not None:
            self._confirmed = self._channel.connections

    def _broken(self, exc: ProtocolError) -> None:
        """The sender broke the protocol: stop trusting this connection, keep the weights."""
        self.protocol_errors += 1
        self._bye = f"protocol error: {exc}"
        log.warning("worker %d: %s; disconnecting", self.worker_idx, exc)
        self._notify()

    async def _apply_and_answer(self, version: int, params: Mapping[str, ParamValue]) -> Ack | Nack:
        answer: Ack | Nack
        try:
            await self._applier.apply(version, params)
            if self.hooks:
                await self._applier.run_hooks(version)
            answer = Ack(worker_idx=self.worker_idx, version=version)
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(BYE_WINDOW_S):
                await self._answer(self._nack(version, "receiver shut down"))
            raise
        except Exception as exc:  # a user hook may raise anything; the sender must hear of it
            answer = self._failure(version, exc)
        await self._answer(answer)
        return answer

    def _failure(self, version: int, exc: Exception) -> Nack:
        """The nack for ``exc``, raised while applying ``version`` or by a hook."""
        if isinstance(exc, (WeightSyncError, OSError, RuntimeError, ValueError, TimeoutError)):
            log.warning("worker %d could not apply version %d: %s", self.worker_idx, version, exc)
            return self._nack(version, error_text(exc), retryable=isinstance(exc, TransportError))
        return self._nack(version, error_text(exc))

    def _nack(self, version: int, error: str, *, retryable: bool = False) -> Nack:
        """A nack of ``version`` that also says which version the model runs now."""
        return Nack(
            worker_idx=self.worker_idx,
            version=version,
            error=error,
            retryable=retryable,
            running=self.version,
        )

    async def _answer(self, answer: Ack | Nack) -> None:
        """Send ``answer``; once begun, not even cancellation stops it."""
        channel = self._channel
        if channel is None:
            return
        self._conn.send(answer)
        if channel.send_nowait(answer):
            return
        await to_the_end(channel.send(answer, timeout=self._timeouts.control))

    # -- shutdown -----------------------------------------------------------------------------

    async def close(self) -> None:
        channel = self._channel
        if channel is None:
            return
        said_bye = False
        try:
            await self._detach_or_warn()
            # A model still reading shared memory must keep its pins: no goodbye then, and the
            # sender keeps them until this process is gone.
            if self._applier.detached:
                said_bye = await self._say_bye(channel)
        finally:
            # A goodbye only queued would be dropped by an immediate close, and the sender would
            # take this worker for lost instead of gone.
            self._close_channel(flush=BYE_FLUSH_S if said_bye else 0.0)

    async def _say_bye(self, channel: ReceiverChannel) -> bool:
        with anyio.CancelScope(shield=True), anyio.move_on_after(BYE_WINDOW_S):
            if self._bye is None and channel.peer_alive:
                try:
                    self._conn.send(Bye(reason="receiver closing"))
                    await channel.send(Bye(reason="receiver closing"), timeout=BYE_SEND_S)
                    return True
                except (WeightSyncError, ProtocolError):
                    pass
        return False

    async def _abandon(self) -> None:
        """After a failed ``connect()``: stop reading shared memory, close the channel."""
        try:
            await self._detach_or_warn()
        finally:
            self._close_channel()

    async def _detach_or_warn(self) -> None:
        """:meth:`_detach`, run to its end even if cancelled; a failure is logged, and the
        model then keeps reading the shared memory it was on."""
        try:
            await to_the_end(self._applier.detach())
        except Exception as exc:
            log.warning(
                "worker %d: could not give the model weights of its own (%s); it keeps "
                "reading shared memory, which stays mapped and pinned until this process ends",
                self.worker_idx,
                error_text(exc),
            )

    def _close_channel(self, *, flush: float = 0.0) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close(flush=flush)
        if self._applier.detached:
            # Otherwise the model still reads the plane's mappings: they stay.
            self._plane.close()
        self._notify()


def _return_freed_memory() -> None:
    """Give the model's original storage back to the OS after the first swap.

    glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold on the heap, so
    without a trim a swap-mode worker would keep a private copy's worth of freed memory.
    """
    c = libc()
    trim = getattr(c, "malloc_trim", None) if c is not None else None
    if trim is not None:  # not glibc: nothing to trim, or no way to ask
        trim(0)
