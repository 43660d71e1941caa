"""How the distributed plane delivers a version: transfers in threads, one after another, and
retries on fresh groups for the members whose receive failed."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from aiowsync._exceptions import TransportError, WeightSyncError
from aiowsync._util.daemon import ThreadNotStarted, in_daemon_thread

from ..base import Delivery, Member, Params, Retries
from .groups import Group

__all__ = ["DistDelivery", "Routes", "TransferChain"]

log = logging.getLogger("aiowsync.dist")

MAX_ATTEMPTS = 4
"""Retries of one version within one send (the wire allows far more)."""
OVERRUN_S = 1.0
"""How long past its deadline a send waits for its transfer thread. Each wait of a transfer
ends by the deadline, but gloo may overrun it while a group forms; the send then ends, and the
thread ends by itself (the next transfer waits for it)."""
RETRY_GRACE_S = 0.5
"""After a failed transfer, how long the sender waits for the members' answers before it
retries those that reported a failed receive."""


class TransferChain:
    """Transfers of successive versions run one after another, even past a cancelled send."""

    def __init__(self, limit: float) -> None:
        self._last = threading.Event()
        self._last.set()
        self._limit = limit
        """How long a transfer left behind may still be waited for by the next one."""

    async def run(self, transfer: Callable[..., None], release: Callable[[], None]) -> None:
        """``transfer(after=event)`` in a thread; ``event`` is set once the previous one ended.
        ``release()`` gives back what the transfer would have, if no thread could start."""
        previous, mine = self._last, threading.Event()
        self._last = mine

        def run() -> None:
            try:
                transfer(after=previous)
            finally:
                if previous.is_set():
                    mine.set()
                else:
                    # This one gave up waiting for the previous transfer, which still runs: the
                    # next must wait for both, but this send need not wait any longer.
                    threading.Thread(
                        target=_set_after,
                        args=(previous, mine, self._limit),
                        name="aiowsync-chain",
                        daemon=True,
                    ).start()

        try:
            # Cancelling the caller abandons the wait, not the transfer: one that started runs
            # to its end (each of its waits has a deadline), so collectives never go half-done.
            await in_daemon_thread(run, name="aiowsync-transfer")
        except ThreadNotStarted as exc:
            mine.set()  # never ran: the next transfer must not wait for it
            release()
            raise TransportError(f"could not start a transfer thread: {exc}") from None


class Routes(Protocol):
    """What a delivery asks of the plane that made it: routes (groups of members) for a
    version, the transfer of a version on one, and the sealing of a version's slot."""

    def route(self, members: Sequence[Member], version: int) -> Group:
        """A route to ``members`` that holds ``version``'s slot until its transfer ends."""
        ...

    def route_params(self, route: Group, timeout: float) -> Params:
        """What the members of ``route`` are told to join it within ``timeout``."""
        ...

    def transfer(
        self,
        version: int,
        route: Group,
        deadline: float,
        after: threading.Event | None = None,
        moved: Sequence[int] | None = None,
    ) -> None:
        """Send ``version`` on ``route`` once ``after`` is set (blocking; raises
        :class:`TransportError`)."""
        ...

    def give_back(self, version: int, route: Group) -> None:
        """Give back a route whose transfer will never run."""
        ...

    async def seal(self, version: int) -> None:
        """Read ``version`` from the caller's weights now, whatever is not read yet."""
        ...


@dataclass(eq=False)
class DistDelivery(Delivery):
    """A version on its way to the members of the group ``route`` (None: no members).

    The plane's ``chain`` runs the transfers of successive sends one after another; on a
    ``star`` a transfer that went through reached every member (in a chain, a member may
    still report that its own receive failed)."""

    _plane: Routes
    _chain: TransferChain
    _star: bool
    _version: int
    _route: Any
    _deadline: float
    params: Params
    _moved: list[int] | None = None
    """The models (by number) this delivery moves; None: all."""

    async def run(self, retries: Retries | None) -> None:
        route, self._route = self._route, None
        if route is None:
            return
        plane, version = self._plane, self._version
        if retries is None:
            # Bringing one worker up to date: one attempt, not chained after the sends.
            try:
                with anyio.move_on_after(max(0.0, self._deadline - time.monotonic()) + OVERRUN_S):
                    await in_daemon_thread(
                        functools.partial(
                            plane.transfer, version, route, self._deadline, moved=self._moved
                        ),
                        name="aiowsync-transfer",
                    )
            except ThreadNotStarted as exc:
                plane.give_back(version, route)
                raise TransportError(f"could not start a transfer thread: {exc}") from None
            return
        await self._with_retries(route, retries)

    async def _with_retries(self, route: Any, retries: Retries) -> None:
        """Transfer; when a collective fails its group is torn down, so every member still
        alive fails fast and nacks as retryable; those are sent the same version again, with
        a higher attempt number, on a fresh group. A member that stays silent is dead or
        stalled: the deadline (or its heartbeats) names it. Returns once every member
        answered, or at the deadline."""
        plane, version, move_by = self._plane, self._version, self._deadline
        members = {w for w, _ in route.members if w >= 0}
        attempt, failed = 0, False
        while True:
            if route is not None:
                try:
                    late_by = max(0.0, move_by - time.monotonic()) + OVERRUN_S
                    with anyio.move_on_after(late_by) as late:
                        await self._chain.run(
                            functools.partial(
                                plane.transfer, version, route, move_by, moved=self._moved
                            ),
                            functools.partial(plane.give_back, version, route),
                        )
                except WeightSyncError as exc:
                    log.warning("version %d, attempt %d: %s", version, attempt, exc)
                    failed = True
                else:
                    if late.cancelled_caught:
                        # Stuck in a wait gloo does not cut short (see OVERRUN_S).
                        log.warning("version %d: the transfer outlived the deadline", version)
                        return
                    if not failed and self._star:
                        return  # a star: every member had its bytes from the sender
                    # A retry went through, or a chain's first link did: others may still
                    # report failed receives, to be retried.
                    route = None
                if route is not None:
                    # Give this attempt's members a moment to report their failed receive.
                    grace = min(RETRY_GRACE_S, max(0.0, move_by - time.monotonic()))
                    end = time.monotonic() + grace
                    while retries.waiting() & members and (left := end - time.monotonic()) > 0:
                        await retries.changed(left)
            retry = retries.retryable()
            left = move_by - time.monotonic()
            if left <= 0 or (not retry and retries.done()):
                return
            if not retry:
                # Someone is still silent; a late report of a failed receive is retried too.
                route = None
                await retries.changed(left)
                continue
            if attempt >= MAX_ATTEMPTS:
                log.warning("version %d: giving up after %d attempts", version, attempt + 1)
                return
            attempt += 1
            route = plane.route(retry, version)
            try:
                params = plane.route_params(route, left)
                if self._moved is not None:
                    params["sections"] = ",".join(map(str, self._moved))
                announced = await retries.announce(retry, attempt, params)
            except BaseException:
                plane.give_back(version, route)  # it will never carry this version
                raise
            if not announced:  # the sender is closing: nobody would join this route
                plane.give_back(version, route)
                return

    async def finish(self) -> None:
        # However the send ended (even cancelled), the version is read from the caller's
        # weights now, never after send() stopped waiting.
        await self._plane.seal(self._version)

    def abandon(self) -> None:
        route, self._route = self._route, None
        if route is not None:
            self._plane.give_back(self._version, route)


def _set_after(previous: threading.Event, mine: threading.Event, limit: float) -> None:
    previous.wait(limit)
    mine.set()
