"""Following a sender across restarts: what a receiver built with ``reconnect=`` runs.

A :class:`Follower` runs the update loop of the engine (:class:`ReceiverCore`) of the sender
the receiver follows. When that sender is gone (it said goodbye, or it was lost: the rule of
``connected``), the follower logs it once, lets go of the connection and keeps the engine, so
that the model goes on running its version and leases keep working; then it tries to join a
sender at the same address (or the one ``reconnect``'s function gives), each try an engine
of its own, as a fresh receiver would. The first engine that switches the model to its
sender's version drives the model from then on; the one before lets go of its plane.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

import anyio
import anyio.abc

from .._channel import ChannelFactory
from .._config import Heartbeats, Timeouts
from .._exceptions import NotConnectedError, SenderGoneError, WeightSyncTimeout
from .._planes.base import DataPlane
from .._receiving.engine import ReceiverCore
from .._util.text import error_text
from .config import SchemeConfig

__all__ = ["Follower", "Rejoin", "RejoinAt", "Target"]

log = logging.getLogger("aiowsync.receiver")

RejoinAt = str | SchemeConfig | None
"""What ``reconnect``'s function returns: an address, a scheme (the new sender's, pickled
to this process: its address, channel factory and data plane are taken), or None for "no
sender to join yet"."""
Rejoin = Callable[[], RejoinAt | Awaitable[RejoinAt]]

ANSWER_S = 5.0
"""How long one try waits for a sender's welcome before it asks again (and calls
``reconnect``'s function again); applying the welcome's version then has the handshake's
timeout."""
FIRST_WAIT_S = 0.1
"""Tries start at most this often at first; the wait doubles after each failed try..."""
LONGEST_WAIT_S = 5.0
"""... up to this."""


@dataclass(frozen=True)
class Target:
    """Where a receiver joins its sender: the address and what reaches it."""

    address: str
    channels: ChannelFactory
    plane: DataPlane


MakeCore = Callable[[Target, ReceiverCore | None], ReceiverCore]
"""Builds the engine of a receiver for a sender at a target, following the engine given."""


class Follower:
    """Runs the current engine's update loop and joins the next sender when its sender is
    gone (see the module).

    ``make`` builds an engine for a target (the session's model, layouts and options), the
    engine before passed along (its copies and count of senders carry over).
    """

    def __init__(
        self,
        core: ReceiverCore,
        target: Target,
        *,
        make: MakeCore,
        where: Rejoin | None,
        timeouts: Timeouts,
        heartbeats: Heartbeats,
    ) -> None:
        self._current = core
        self._joining: ReceiverCore | None = None
        self._target = target
        self._make = make
        self._where = where
        self._timeouts = timeouts
        self._beats = heartbeats
        self._noted: set[str] = set()
        """Failures already logged during this wait for a sender (each is logged once)."""

    @property
    def core(self) -> ReceiverCore:
        """The engine that drives the model: an engine joining a new sender is it from the
        instant it switched the model (under the read guard), even before it acknowledged."""
        joining = self._joining
        if joining is not None and joining.version >= 0:
            return joining
        return self._current

    @property
    def target(self) -> Target:
        """Where the sender followed (or last followed) is."""
        return self._target

    @property
    def address(self) -> str:
        """The address of the sender followed (or last followed)."""
        return self._target.address

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Background task: the current engine's update loop, and the joins that follow."""
        started = False
        while True:
            core = self._current
            async with anyio.create_task_group() as tg:
                await tg.start(core.run)
                if not started:
                    task_status.started()
                    started = True
                gone = await self._until_gone(core)
                tg.cancel_scope.cancel()
            core.unlink()
            # Leases in the sender's memory become copies: a sender that lived on lets go of
            # this worker's old pins once it joins again (same process, new connection).
            core.leases.detach(close=False)
            log.warning(
                "worker %d: the sender at %s %s (%s); the model keeps version %d and goes on "
                "serving it; joining the next sender at %s as soon as one answers (reconnect)",
                core.worker_idx,
                self._target.address,
                "closed" if gone.closed else "was lost",
                gone.reason,
                core.version,
                self._target.address if self._where is None else "the address reconnect gives",
            )
            await self._rejoin(core.version)

    async def _until_gone(self, core: ReceiverCore) -> SenderGoneError:
        # Looked at once a beat at least: a lost connection is a matter of time, not an event.
        while (gone := core.gone()) is None:
            with anyio.move_on_after(self._beats.interval):
                await core.changed()
        return gone

    async def _rejoin(self, kept: int) -> None:
        """Try to join a sender until one welcomes this worker and its version is applied,
        each try starting at least a growing wait after the one before."""
        self._noted.clear()
        since, wait = time.monotonic(), FIRST_WAIT_S
        while True:
            began = time.monotonic()
            target = await self._next_target()
            if target is not None and await self._try(target):
                core = self._current
                log.info(
                    "worker %d joined the sender at %s %.1f s after it lost the one before: "
                    "version %d (generation %d) replaces version %d",
                    core.worker_idx,
                    target.address,
                    time.monotonic() - since,
                    core.version,
                    core.generation,
                    kept,
                )
                return
            await anyio.sleep(max(0.0, wait - (time.monotonic() - began)))
            wait = min(2 * wait, LONGEST_WAIT_S)

    async def _try(self, target: Target) -> bool:
        """One try at joining the sender at ``target``: whether it succeeded."""
        before = self._current
        core: ReceiverCore | None = None
        failure: Exception | None = None
        try:
            core = self._joining = self._make(target, before)
            handshake = self._timeouts.handshake
            await core.connect(handshake, answer_within=min(ANSWER_S, handshake))
        except Exception as exc:  # every failure is worth another try, none may end the task
            failure = exc
        finally:
            self._joining = None
            if core is not None and core.version >= 0:
                # It switched the model (even if what came after failed): it drives it now.
                self._current, self._target = core, target
                before.retire()
        if failure is None:
            return True
        if isinstance(failure, (WeightSyncTimeout, NotConnectedError)):  # nobody answered
            log.debug("worker %d: %s", before.worker_idx, error_text(failure))
        else:
            self._note(f"could not join {target.address}: {error_text(failure)}")
        return False

    async def _next_target(self) -> Target | None:
        """Where to try next: the last address, or what ``reconnect``'s function gives (None
        while it knows of no sender, or failed)."""
        where = self._where
        if where is None:
            return self._target
        try:
            with anyio.fail_after(self._timeouts.control):
                given = where()
                if inspect.isawaitable(given):
                    given = await given
        except Exception as exc:
            self._note(f"reconnect's function failed: {error_text(exc)}")
            return None
        last = self._target
        if given is None:
            return None
        if isinstance(given, str):
            try:
                last.channels.check_address(given, bind=False)
            except ValueError as exc:
                self._note(f"reconnect's function gave an address that cannot be used: {exc}")
                return None
            return replace(last, address=given)
        if isinstance(given, SchemeConfig):
            address = given._pickled_address()
            if address is None:
                self._note("reconnect's function gave a scheme without an address")
                return None
            if type(given.plane) is not type(last.plane):
                self._note(
                    f"reconnect's function gave a scheme on another data plane "
                    f"({type(given.plane).__name__}, not {type(last.plane).__name__})"
                )
                return None
            return Target(address, given.channels, given.plane)
        self._note(
            "reconnect's function must return an address, a scheme or None, not "
            f"{type(given).__name__}"
        )
        return None

    def _note(self, text: str) -> None:
        """Log ``text`` as a warning, once while this wait for a sender lasts."""
        if text not in self._noted:
            self._noted.add(text)
            log.warning("worker %d: %s; trying again (reconnect)", self._current.worker_idx, text)
