"""The receiver's engine: handshake, applying versions tear-free, acks, hooks and pull mode."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping

import anyio
import torch

from .._channel import ChannelFactory, ReceiverChannel
from .._config import Heartbeats, Timeouts
from .._exceptions import (
    ConnectError,
    NotConnectedError,
    ProtocolError,
    RefusedError,
    SenderGoneError,
    WeightSyncError,
    WeightSyncTimeout,
)
from .._planes.base import ReceiverPlane
from .._protocol import (
    PROTOCOL_VERSION,
    Bye,
    Connection,
    Heartbeat,
    Hello,
    Nack,
    Refuse,
    Role,
    Welcome,
)
from .._util.libc import libc
from .._util.shield import to_the_end
from .._util.signal import Signal
from .._util.text import error_text
from .._weights.layout import Layout
from .apply import Applier, ApplyMode, Hook
from .guard import ReadGuard
from .lease import LeaseTable
from .updates import UpdateLoop

__all__ = ["ApplyMode", "Hook", "ReceiverCore"]

log = logging.getLogger("aiowsync.receiver")

_HOST = socket.gethostname()[:256]


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
        model_layout: Layout | None = None,
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
        self.timeouts = timeouts
        self.beats = heartbeats
        self.channel: ReceiverChannel | None = None
        self.conn = Connection(Role.RECEIVER, worker_idx)
        self.guard = guard
        self.hooks = hooks
        self.shield_updates = False
        self.protocol_errors = 0
        self.bye: str | None = None
        """Why this receiver takes nothing more from its sender (its goodbye, or a broken
        protocol); None while it does."""
        self.said_bye = False
        """The sender ended it with a goodbye (rather than breaking the protocol)."""
        self._unsure_since: float | None = None
        """Since when the connection is down or renewed without the sender's confirmation
        (None while it is confirmed)."""
        self.session = ""
        self.proof = ""
        """The sender's secret from the welcome: updates and beats must carry it."""
        self.impostors = 0
        """Updates refused for not carrying it (see :meth:`UpdateLoop._from_sender`)."""
        self._changed = Signal()
        self.applier = Applier(
            plane=plane,
            layout=layout,
            model_layout=model_layout,
            targets=targets,
            mode=apply_mode,
            guard=guard,
            hooks=hooks,
            timeouts=timeouts,
            on_switch=self.notify,
        )
        self.leases = LeaseTable(self.applier, guard, self._report_leases_soon)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._updates = UpdateLoop(self)
        self.connections_seen = 0
        self.confirmed = -1
        """The count of connections to the sender when it last showed that it knows this
        worker's session (see :attr:`connected`)."""

    @property
    def version(self) -> int:
        """The version the model runs (-1 before the first)."""
        return self.applier.version

    # -- status -------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Connected to the sender that welcomed this worker (see :meth:`gone`).

        It turns False when the sender says goodbye, or once the connection has gone
        unconfirmed for the heartbeat timeout; a shorter drop or a renewal that the sender
        confirms with its next beat leaves it True.
        """
        return self.channel is not None and self.gone() is None

    def gone(self) -> SenderGoneError | None:
        """Why this worker's sender is gone (said goodbye, or lost), or None while it is not.

        Lost means the connection was not confirmed for the heartbeat timeout: down all that
        time, or renewed by the transport without the sender's beat naming this worker's
        session (a sender restarted on the same address never sends one). Shorter gaps, as
        a renewal whose confirming beat is on its way, do not count, as on the sender's side
        a worker is lost only after that much silence.
        """
        keeps = max(self.version, 0)
        if self.bye is not None:
            return SenderGoneError(self.worker_idx, keeps, self.bye, closed=self.said_bye)
        channel = self.channel
        if channel is None:
            return None
        alive = channel.peer_alive
        if alive and channel.connections == self.confirmed:
            self._unsure_since = None
            return None
        now = time.monotonic()
        if self._unsure_since is None:
            self._unsure_since = now
        timeout = self.beats.timeout
        if now - self._unsure_since <= timeout:
            return None
        why = (
            f"the connection to {self.address} came back, but the sender has not recognised "
            f"this worker for {timeout:g} s"
            if alive
            else f"no connection to {self.address} for {timeout:g} s"
        )
        return SenderGoneError(self.worker_idx, keeps, why, closed=False)

    def check_sender(self) -> None:
        """Raise :class:`SenderGoneError` if the sender is gone, :class:`NotConnectedError`
        if this receiver is closed."""
        if self.channel is None:
            raise NotConnectedError(f"worker {self.worker_idx}: this receiver is closed")
        if (why := self.gone()) is not None:
            raise why

    @property
    def dropped(self) -> int:
        channel = self.channel
        dropped = self.protocol_errors + self.impostors
        return dropped + (0 if channel is None else channel.dropped)

    def notify(self) -> None:
        self._changed.notify()

    async def wait_for_version(self, version: int, timeout: float) -> int:
        try:
            with anyio.fail_after(timeout):
                while self.version < version:
                    self.check_sender()
                    # A goodbye wakes this at once; a lost connection is seen at the next look.
                    with anyio.move_on_after(self.beats.interval):
                        await self._changed.wait()
        except TimeoutError:
            raise WeightSyncTimeout(
                f"worker {self.worker_idx} still runs version {self.version}, "
                f"not {version}, after {timeout:g} s"
            ) from None
        return self.version

    # -- handshake ----------------------------------------------------------------------------

    async def connect(self, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        channel = self._channels.connect(self.address, heartbeat_timeout=self.beats.timeout)
        self.channel = channel
        try:
            with anyio.fail_after(timeout):
                welcome = await self._handshake(channel)
                # The sender judges this worker's liveness from the welcome on, and bringing
                # a big model up to date can take longer than its patience: beat already.
                channel.start_heartbeat(self.heartbeat, welcome.heartbeat_interval)
                self.connections_seen = self.confirmed = channel.connections
                self._plane.setup(self.layout, welcome.params, swap=self.apply_mode == "swap")
                answer = await self._updates.apply_and_answer(
                    welcome.version, welcome.params, must_send=True
                )
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

    def heartbeat(self, leased: tuple[int, ...] | None = None) -> Heartbeat:
        return Heartbeat(
            worker_idx=self.worker_idx,
            session=self.session,
            version=max(self.version, 0),
            leased=leased,
        )

    def _report_leases_soon(self) -> None:
        """A leased version in the sender's memory is free again: tell the sender (from any
        thread), so that its slot can take a new version before the next answer says so."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to tell
            loop.call_soon_threadsafe(self._report_leases)

    def _report_leases(self) -> None:
        channel = self.channel
        if channel is None or self.bye is not None or not self.session:
            return
        beat = self.heartbeat(leased=self.leases.pinned())
        # On the connection the answers take, so in order with them; a report that finds no
        # room is dropped: the next answer carries the same news.
        with contextlib.suppress(WeightSyncError):
            channel.send_nowait(beat)

    async def _handshake(self, channel: ReceiverChannel) -> Welcome:
        hello = Hello(
            protocol=PROTOCOL_VERSION,
            model_id=self.model_id,
            worker_idx=self.worker_idx,
            fingerprint=self.layout.fingerprint,
            layout=self.layout.descs(),
            pid=os.getpid(),
            host=_HOST,
        )
        self.conn.send(hello)
        await channel.send(hello, timeout=self.timeouts.control)
        while True:
            message = await channel.recv(timeout=None)
            if isinstance(message, Heartbeat):
                continue
            self.conn.receive(message)
            if isinstance(message, Refuse):
                raise RefusedError(message.reason)
            if isinstance(message, Welcome):
                if message.worker_idx != self.worker_idx or message.model_id != self.model_id:
                    raise ProtocolError("welcome names another worker or model")
                self.session = message.session
                self.proof = message.proof
                return message
            raise ProtocolError(f"unexpected {type(message).__name__} during the handshake")

    # -- updates ------------------------------------------------------------------------------

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Background task: apply every update as it comes (see :class:`UpdateLoop`)."""
        await self._updates.run(task_status=task_status)

    async def receive(self, timeout: float) -> int | None:
        """Pull mode: apply the next update if one arrives within ``timeout``; its version."""
        return await self._updates.receive(timeout)

    # -- shutdown -----------------------------------------------------------------------------

    async def close(self) -> None:
        channel = self.channel
        if channel is None:
            return
        said_bye = False
        try:
            await self._detach_or_warn()
            # A model still reading shared memory must keep its pins: no goodbye then, and the
            # sender keeps them until this process is gone.
            if self.applier.detached:
                said_bye = await self._say_bye(channel)
        finally:
            # A goodbye only queued would be dropped by an immediate close, and the sender would
            # take this worker for lost instead of gone.
            self._close_channel(flush=BYE_FLUSH_S if said_bye else 0.0)

    async def _say_bye(self, channel: ReceiverChannel) -> bool:
        with anyio.CancelScope(shield=True), anyio.move_on_after(BYE_WINDOW_S):
            if self.bye is None and channel.peer_alive:
                try:
                    self.conn.send(Bye(reason="receiver closing"))
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
            self.leases.detach()
            await to_the_end(self.applier.detach())
        except Exception as exc:
            log.warning(
                "worker %d: could not give the model weights of its own (%s); it keeps "
                "reading shared memory, which stays mapped and pinned until this process ends",
                self.worker_idx,
                error_text(exc),
            )

    def _close_channel(self, *, flush: float = 0.0) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            channel.close(flush=flush)
        if self.applier.detached:
            # Otherwise the model still reads the plane's mappings: they stay.
            self._plane.close()
        self.notify()


def _return_freed_memory() -> None:
    """Give the model's original storage back to the OS after the first swap.

    glibc keeps freed blocks below its (adaptive, up to 32 MiB) mmap threshold on the heap, so
    without a trim a swap-mode worker would keep a private copy's worth of freed memory.
    """
    c = libc()
    trim = getattr(c, "malloc_trim", None) if c is not None else None
    if trim is not None:  # not glibc: nothing to trim, or no way to ask
        trim(0)
