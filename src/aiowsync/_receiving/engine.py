"""The receiver's engine: handshake, applying versions tear-free, acks, hooks and pull mode."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Mapping

import anyio
import torch

from .._channel import ChannelFactory, ReceiverChannel, missing_socket
from .._config import Heartbeats, Timeouts
from .._exceptions import (
    ConnectError,
    ProtocolError,
    SenderGoneError,
    WeightSyncError,
    WeightSyncTimeout,
)
from .._planes.base import ReceiverPlane
from .._protocol import (
    Bye,
    Heartbeat,
    Nack,
    Welcome,
)
from .._util.shield import to_the_end
from .._util.text import error_text
from .._weights.layout import Layout
from .apply import Applier, ApplyMode, Hook
from .guard import ReadGuard
from .handshake import handshake, return_freed_memory
from .lease import LeaseTable
from .state import ReceiverState
from .updates import UpdateLoop

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
        model_layout: Layout | None = None,
        worker_idx: int,
        model_id: str,
        address: str,
        apply_mode: ApplyMode,
        timeouts: Timeouts,
        heartbeats: Heartbeats,
        guard: ReadGuard,
        hooks: list[Hook],
        after: ReceiverCore | None = None,
    ) -> None:
        """``after``: the engine of the sender this receiver followed before, when it joins
        a new one on the same model (its copies and its place in the senders' count carry
        over; this engine keeps no reference to it)."""
        self._channels = channels
        self._plane = plane
        self.layout = layout
        self.worker_idx = worker_idx
        self.model_id = model_id
        self.address = address
        self.apply_mode = apply_mode
        self.timeouts = timeouts
        self.beats = heartbeats
        self.guard = guard
        self.hooks = hooks
        self._state = ReceiverState(
            worker_idx=worker_idx, address=address, timeouts=timeouts, beats=heartbeats
        )
        """The link to the sender, shared with the update loop."""
        before = None if after is None else after.applier
        self.applier: Applier = Applier(
            plane=plane,
            layout=layout,
            model_layout=model_layout,
            targets=targets,
            mode=apply_mode,
            guard=guard,
            hooks=hooks,
            timeouts=timeouts,
            on_switch=self._state.notify,
            tenure=None if before is None else before.tenure,
            private=None if before is None else before.private,
        )
        self._before: tuple[int, str] | None = (
            None if after is None or before is None else (before.generation, after._state.proof)
        )
        """The generation and proof of the sender followed before (see :meth:`connect`)."""
        self.unlinked = False
        """The sender is gone and this engine let go of the connection (:meth:`unlink`); the
        model still runs its version."""
        self.leases = LeaseTable(self.applier, guard, self._report_leases_soon)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._updates = UpdateLoop(self._state, self.applier, self.leases.pinned)

    @property
    def version(self) -> int:
        """The version the model runs (-1 before the first)."""
        return self.applier.version

    @property
    def generation(self) -> int:
        """Which sender :attr:`version` counts in (see :attr:`Applier.generation`)."""
        return self.applier.generation

    @property
    def sender_proof(self) -> str:
        """The session of the sender that welcomed this worker (its proof; "" before the
        welcome): a restarted sender's differs."""
        return self._state.proof

    async def changed(self) -> None:
        """Wait until the version or the sender's state changes (or this engine closes)."""
        await self._state.changed()

    # -- status -------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        """Connected to the sender that welcomed this worker (see :meth:`gone`).

        It turns False when the sender says goodbye, or once the connection has gone
        unconfirmed for the heartbeat timeout; a shorter drop or a renewal that the sender
        confirms with its next beat leaves it True.
        """
        return self._state.channel is not None and self.gone() is None

    def gone(self) -> SenderGoneError | None:
        """Why this worker's sender is gone (said goodbye, or lost), or None while it is not
        (see :meth:`ReceiverState.gone`)."""
        return self._state.gone(self.version)

    def check_sender(self) -> None:
        """Raise :class:`SenderGoneError` if the sender is gone, :class:`NotConnectedError`
        if this receiver is closed."""
        self._state.check_sender(self.version)

    @property
    def channel(self) -> ReceiverChannel | None:
        """The connection to the sender; None before ``connect()`` and once closed."""
        return self._state.channel

    @property
    def dropped(self) -> int:
        return self._state.dropped

    @property
    def protocol_errors(self) -> int:
        return self._state.protocol_errors

    @property
    def shield_updates(self) -> bool:
        """Pull mode: apply and answer an update taken off the wire even if the caller's
        deadline fires meanwhile."""
        return self._updates.shield

    @shield_updates.setter
    def shield_updates(self, shield: bool) -> None:
        self._updates.shield = shield

    def notify(self) -> None:
        self._state.notify()

    async def wait_for_version(self, version: int, timeout: float) -> int:
        try:
            with anyio.fail_after(timeout):
                while self.version < version:
                    self.check_sender()
                    # A goodbye wakes this at once; a lost connection is seen at the next look.
                    with anyio.move_on_after(self.beats.interval):
                        await self._state.changed()
        except TimeoutError:
            raise WeightSyncTimeout(
                f"worker {self.worker_idx} still runs version {self.version}, "
                f"not {version}, after {timeout:g} s"
            ) from None
        return self.version

    # -- handshake ----------------------------------------------------------------------------

    async def connect(self, timeout: float, *, answer_within: float | None = None) -> None:
        """Say hello, apply the welcome's version and answer, within ``timeout``; with
        ``answer_within``, the welcome (or a refusal) must come within that much of it."""
        self._loop = asyncio.get_running_loop()
        self._state.activity.bind(self._loop)
        channel = self._channels.connect(self.address, heartbeat_timeout=self.beats.timeout)
        self._state.channel = channel
        first = timeout if answer_within is None else min(timeout, answer_within)
        welcome: Welcome | None = None
        try:
            with anyio.fail_after(first) as scope:
                welcome = await handshake(
                    channel,
                    self._state,
                    layout=self.layout,
                    model_id=self.model_id,
                    worker_idx=self.worker_idx,
                    timeout=self.timeouts.control,
                )
                scope.deadline += timeout - first  # the rest is for applying its version
                self.applier.generation = self._generation(welcome)
                # The sender judges this worker's liveness from the welcome on, and bringing
                # a big model up to date can take longer than its patience: beat already.
                channel.start_heartbeat(self._beat, welcome.heartbeat_interval)
                self._state.connections_seen = self._state.confirmed = channel.connections
                self._plane.setup(self.layout, welcome.params, swap=self.apply_mode == "swap")
                answer = await self._updates.apply_and_answer(
                    welcome.version, welcome.params, must_send=True
                )
        except TimeoutError:
            await self._abandon()
            why = ""
            if welcome is None and (path := missing_socket(self.address)) is not None:
                why = (
                    f": its socket {path} does not exist (the sender has closed or died, "
                    "or the file was removed; a live sender binds it again within a "
                    "heartbeat period)"
                )
            elif welcome is None and (size := _hello_size(self.layout)) > _CUT_OFF_BELOW:
                why = (
                    f": if the sender's model has far fewer tensors than this worker's "
                    f"{len(self.layout.specs)} (a hello of about {size >> 10} KiB), the sender "
                    "cut the hello off unread; check that both sides hold the same model"
                )
            raise WeightSyncTimeout(
                f"worker {self.worker_idx}: no answer from the sender at {self.address} "
                f"within {first if welcome is None else timeout:g} s{why}",
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
            return_freed_memory()

    def _generation(self, welcome: Welcome) -> int:
        """The generation of the sender that sent ``welcome``: the one before's again if it
        is that sender (its proof: a connection lost and found again), else one more."""
        if self._before is None:
            return 0
        generation, proof = self._before
        return generation if hmac.compare_digest(welcome.proof, proof) else generation + 1

    def heartbeat(self, leased: tuple[int, ...] | None = None) -> Heartbeat:
        return self._state.heartbeat(self.version, leased)

    def _beat(self) -> Heartbeat:
        """The beat thread's beat: it also says what holds this worker up."""
        return self._state.heartbeat(self.version, doing=self._state.activity.text())

    def _report_leases_soon(self) -> None:
        """A leased version in the sender's memory is free again: tell the sender (from any
        thread), so that its slot can take a new version before the next answer says so."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to tell
            loop.call_soon_threadsafe(self._report_leases)

    def _report_leases(self) -> None:
        channel, state = self._state.channel, self._state
        if channel is None or state.bye is not None or not state.session:
            return
        beat = self.heartbeat(leased=self.leases.pinned())
        # On the connection the answers take, so in order with them; a report that finds no
        # room is dropped: the next answer carries the same news.
        with contextlib.suppress(WeightSyncError):
            channel.send_nowait(beat)

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

    def unlink(self) -> None:
        """The sender is gone: close the connection (its beats stop), without a goodbye.

        The model goes on running its version from the memory it reads (a mapping of shared
        memory outlives the sender that made it), and leases keep working. Then
        :meth:`close`, or :meth:`retire` once an engine of a new sender drives the model.
        """
        channel, self._state.channel = self._state.channel, None
        if channel is not None:
            self.unlinked = True
            channel.close()
        self.notify()

    def retire(self) -> None:
        """An engine of a new sender drives the model now: let go of the connection and the
        plane. Leases still held keep the memory they read."""
        self.unlink()
        if self.unlinked:
            self.unlinked = False
            self._plane.close()
        self.notify()

    async def close(self) -> None:
        channel = self._state.channel
        if channel is None:
            if self.unlinked:  # the sender was gone: the model needs memory of its own still
                self.unlinked = False
                await self._detach_or_warn()
                self._close_channel()
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
            if self._state.bye is None and channel.peer_alive:
                try:
                    self._state.conn.send(Bye(reason="receiver closing"))
                    await channel.send(Bye(reason="receiver closing"), timeout=BYE_SEND_S)
                    return True
                except (WeightSyncError, ProtocolError):
                    pass
        return False

    async def _abandon(self) -> None:
        """After a failed ``connect()``: stop reading shared memory, close the channel. A
        model that runs the version switched in keeps taking leases (copies of it)."""
        try:
            await self._detach_or_warn(close_leases=self.version < 0)
        finally:
            self._close_channel()

    async def _detach_or_warn(self, *, close_leases: bool = True) -> None:
        """:meth:`_detach`, run to its end even if cancelled; a failure is logged, and the
        model then keeps reading the shared memory it was on."""
        try:
            self.leases.detach(close=close_leases)
            await to_the_end(self.applier.detach())
        except Exception as exc:
            log.warning(
                "worker %d: could not give the model weights of its own (%s); it keeps "
                "reading shared memory, which stays mapped and pinned until this process ends",
                self.worker_idx,
                error_text(exc),
            )

    def _close_channel(self, *, flush: float = 0.0) -> None:
        channel, self._state.channel = self._state.channel, None
        if channel is not None:
            channel.close(flush=flush)
        if self.applier.detached:
            # Otherwise the model still reads the plane's mappings: they stay.
            self._plane.close()
        self.notify()


_CUT_OFF_BELOW = 128 * 1024
"""A sender takes messages of twice its own hello plus this much: a hello smaller than this
is never cut off."""


def _hello_size(layout: Layout) -> int:
    """About the bytes of a hello that lists ``layout``."""
    return sum(len(s.key) + 16 for s in layout.specs)
