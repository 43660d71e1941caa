"""Relays: a receiver that forwards each version it applies to workers of its own.

``upstream.relay_to(local)``: ``upstream`` receives a model from the root sender, ``local``
is a sender initialised on the same model (typically shared memory for the workers of one
host, its *leaves*). Each version ``upstream`` switches to is staged from the model into
``local`` (one copy) and sent to the leaves under the root's number, from a hook of
``upstream``'s: the upstream acknowledges only once the leaves hold it, so the root's
``send()`` returning version v means every leaf runs v.

``local`` serves nothing until ``upstream`` holds a version: its first version is the
upstream's, so leaves never see bytes the root did not send. Both may be entered in either
order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import anyio

from .._config import Timeouts
from .._exceptions import WeightSyncError, WeightSyncTimeout
from .._planes.base import WeightSource
from .._receiving.guard import ReadGuard
from .._sending.engine import SenderCore
from .._sending.workers import WorkerTable
from .._util.text import error_text

if TYPE_CHECKING:
    from .._receiving.engine import ReceiverCore

__all__ = ["LocalSender", "Relay", "Upstream", "check_pair", "digest_of", "root_of"]

log = logging.getLogger("aiowsync.relay")

_POLL_S = 0.05
"""How often the wait for leaves looks again, beside the sender's own wake-ups."""


@dataclass(frozen=True)
class Upstream:
    """What the relay needs of the receiver that feeds it."""

    worker_idx: int
    ack_timeout: float
    """How long the upstream's hooks may run: the relay answers a second before."""
    guard: ReadGuard
    version: Callable[[], int]
    """The version the upstream's model runs (-1 before it holds one)."""
    entered: Callable[[], bool]
    """The upstream is inside ``async with`` (it cannot receive a version before)."""
    digest: Callable[[int], str | None] = lambda version: None
    """The root's digest of ``version``, if the update that brought it carried one."""
    fingerprint: Callable[[], str | None] = lambda: None
    """The fingerprint of the layout the root's bytes travel in (its wire dtype's)."""
    root: Callable[[], str | None] = lambda: None
    """Who numbers the versions the upstream receives: its sender's session (its proof),
    which a restarted root's is not. None before a welcome."""


class LocalSender(Protocol):
    """What the relay needs of the sender session of its leaves."""

    @property
    def entered(self) -> bool:
        """Inside ``async with``."""

    @property
    def core(self) -> SenderCore | None:
        """The engine, once started."""

    @property
    def timeouts(self) -> Timeouts: ...

    @property
    def num_workers(self) -> int: ...

    @property
    def workers(self) -> WorkerTable: ...

    async def start_at(
        self, version: int, *, before: Callable[[SenderCore], None] | None = None
    ) -> SenderCore | None:
        """Start the engine with ``version`` as its first version (None: not entered);
        ``before(core)`` is called first."""

    def default_source(self) -> WeightSource:
        """Where a send takes the model's weights from."""


def check_pair(ours: object, theirs: object, *, entered: bool, taken: bool, follows: bool) -> None:
    """Refuse a relay that cannot work: the upstream receiver's model (or models) ``ours``
    and the leaves' sender's ``theirs`` must be the very same objects, neither scheme may be
    entered yet (``entered``) or relay already (``taken``), and the upstream may not follow
    its sender across restarts (``follows``)."""
    same = ours is theirs or (
        isinstance(ours, dict)
        and isinstance(theirs, dict)
        and ours.keys() == theirs.keys()
        and all(ours[k] is theirs[k] for k in ours)
    )
    if ours is None or not same:
        raise ValueError(
            "relay_to() needs `local` initialised as sender on the very model (or models) "
            "this receiver was initialised on: the relay stages what it receives from it"
        )
    if entered:
        raise RuntimeError("call relay_to() before entering either scheme")
    if taken:
        raise RuntimeError("each scheme takes part in one relay")
    if follows:
        raise ValueError(
            "a relay's upstream cannot follow its sender across restarts (reconnect=): "
            "the leaves count in the root's numbers, which a new root starts again from 0"
        )


def root_of(core: ReceiverCore | None) -> str | None:
    """The session of the sender ``core`` follows (the proof its welcome gave), or None."""
    return (core.sender_proof or None) if core is not None else None


def digest_of(core: ReceiverCore | None, version: int) -> str | None:
    """The sender's digest of ``version``, if ``core``'s model runs it and its update carried
    one."""
    held = None if core is None else core.applier.digest
    return held[1] if held is not None and held[0] == version else None


class Relay:
    """What ``upstream.relay_to(local)`` sets up (see the module)."""

    def __init__(self, upstream: Upstream, local: LocalSender) -> None:
        self.upstream = upstream
        self.local = local
        self._lock: anyio.Lock | None = None
        self._unfit_logged = False
        self._start_failed: str | None = None
        """Why ``local``'s engine could not start (it is not tried again)."""
        self._numbered_by: tuple[SenderCore, str | None] | None = None
        """``local``'s engine and the root session whose numbers it sends under."""

    async def start_local(self, at: int | None = None) -> SenderCore | None:
        """``local``'s engine, started if it is not yet; None while it cannot start.

        ``at``: the version the model holds, from the upstream's hook (no switch can happen
        meanwhile). Without it, the upstream's version, if it holds one, staged under the
        upstream's read guard (the upstream may switch meanwhile).
        """
        local = self.local
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if local.core is not None:
                return local.core
            if not local.entered:
                return None
            if at is not None:
                return await self._start_at(at)
            if self.upstream.version() < 0:
                return None
            async with self.upstream.guard:
                return await self._start_at(self.upstream.version())

    async def _start_at(self, version: int) -> SenderCore | None:
        # The leaves that join check the first version against the root's digest too.
        root = self.upstream.root()
        try:
            core = await self.local.start_at(
                version, before=lambda core: self._hand_on_digest(core, version)
            )
        except Exception as exc:
            self._start_failed = error_text(exc)
            raise
        if core is not None:
            self._numbered_by = (core, root)
        return core

    async def wait_started(self, timeout: float) -> float:
        """Wait (at most ``timeout`` s) until ``local`` serves; the seconds it took."""
        started = time.monotonic()
        if self.local.core is None and not self.upstream.entered():
            # Nothing can start ``local`` before then: waiting would only run out the time.
            raise RuntimeError(
                "the relay's local sender starts once its upstream holds a version, and the "
                "upstream scheme is not entered: enter the upstream (`async with upstream:`) "
                "and connect it first, then wait on `local.connect()` (or await both at once)"
            )
        while self.local.core is None:
            if self._start_failed is not None:
                raise WeightSyncError(
                    f"the relay's local sender could not start: {self._start_failed}"
                )
            if time.monotonic() - started >= timeout:
                raise WeightSyncTimeout(
                    f"the relay's local sender did not start within {timeout:g} s: it starts "
                    "once its upstream holds a version (enter the upstream scheme and connect "
                    "it; the leaves' versions are the root's)",
                    list(range(self.local.num_workers)),
                )
            await self.start_local()
            if self.local.core is None:
                await anyio.sleep(_POLL_S)
        return time.monotonic() - started

    async def forward(self, version: int) -> None:
        """The upstream's hook: bring every leaf to ``version``, or raise naming those that
        do not hold it (the upstream then nacks with that text)."""
        if not self.local.entered:
            return  # ``local`` is not entered: it starts at the upstream's version when it is
        core = await self.start_local(at=version)
        if core is not None:
            self._check_numbering(core, version)
        if core is None:
            if self._start_failed is not None:  # the leaves would never get a version
                raise WeightSyncError(
                    f"relay (worker {self.upstream.worker_idx}): its sender to the leaves "
                    f"could not start ({self._start_failed}); leave and enter it again"
                )
            return
        timeouts = self.local.timeouts
        # Hooks may run for the upstream's ack timeout: the relay is done a second before,
        # so that the upstream's nack carries its explanation rather than a timeout.
        end = time.monotonic() + max(1.0, self.upstream.ack_timeout - 1.0)
        # ``local`` started at this version: its leaves are joining, and may take as long as
        # a handshake; a version sent to leaves already there takes as long as an ack.
        wait = timeouts.handshake if version <= core.version else timeouts.ack
        end = min(end, time.monotonic() + wait)
        failure = ""
        if version > core.version:
            self._hand_on_digest(core, version)
            try:
                await core.send(
                    self.local.default_source(),
                    # Leaves still joining too: one welcomed at the version before this
                    # one is not ready yet, and would be left on it.
                    sorted(core.reachable_workers()),
                    stage_limit=max(0.001, min(timeouts.transfer, end - time.monotonic())),
                    ack_limit=timeouts.ack,
                    deadline=end,
                    version=version,
                )
            except WeightSyncError as exc:
                failure = error_text(exc)
        missing = await self._leaves_short_of(core, version, end - time.monotonic())
        if missing or failure:
            raise WeightSyncError(self._explain(version, missing, failure))

    def _check_numbering(self, core: SenderCore, version: int) -> None:
        """Refuse ``version`` from a sender session other than the one ``local``'s numbers
        follow, when it is below the version the leaves hold: a restarted root numbers from
        0 again, and its versions would count as held. (A restarted relay above this one
        sends under the root's numbers: they go on, and are taken.)"""
        numbered = self._numbered_by
        if numbered is None or numbered[0] is not core:
            return
        now = self.upstream.root()
        if numbered[1] is None or now is None or numbered[1] == now:
            return
        if version < core.version:
            raise WeightSyncError(
                f"relay (worker {self.upstream.worker_idx}): its upstream now receives from "
                f"another sender, at version {version}, below the {core.version} its leaves "
                "run (a restarted trainer numbers from 0 again); leave and enter the relay's "
                "local scheme, then connect the upstream again: the leaves then start at the "
                "new trainer's version"
            )
        self._numbered_by = (core, now)  # a restarted relay above: the numbers go on

    def _hand_on_digest(self, core: SenderCore, version: int) -> None:
        """The leaves check ``version`` against the root's digest, when the root sent one:
        bytes the relay damaged after its own check (a flipped bit, a bug) are then refused
        by the leaves, not passed on under a digest of the damage."""
        root = self.upstream.digest(version)
        if root is None:
            return
        # A digest fits a layout's bucket count; the bytes must also be the same: the root's
        # and the leaves' wire dtypes may differ.
        same = self.upstream.fingerprint() == core.digests.layout.fingerprint
        if not (same and core.digests.give(version, root)) and not self._unfit_logged:
            self._unfit_logged = True
            log.warning(
                "relay (worker %d): the root's digests do not fit the leaves' layout (a "
                "wire dtype or model differs); the leaves check the relay's own digest, where "
                "its sender makes one (integrity=)",
                self.upstream.worker_idx,
            )

    async def _leaves_short_of(
        self, core: SenderCore, version: int, timeout: float
    ) -> dict[int, str]:
        """Wait (at most ``timeout`` s) until every leaf holds ``version`` or is lost or gone;
        those that do not hold it, with what the sender knows of them."""
        deadline = time.monotonic() + timeout

        def short() -> dict[int, str]:
            out = {}
            for worker, status in self.local.workers.items():
                held = -1 if status.version is None else status.version
                if status.state != "ready" or held < version:
                    note = f": {status.note}" if status.note else ""
                    out[worker] = f"{status.state}, version {status.version}{note}"
            return out

        while (missing := short()) and time.monotonic() < deadline:
            if all(s.startswith(("lost", "gone")) for s in missing.values()):
                break  # nothing left to wait for
            with anyio.move_on_after(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
                await core.changed()
        return short()

    def _explain(self, version: int, missing: dict[int, str], failure: str) -> str:
        where = f"relay (worker {self.upstream.worker_idx})"
        parts = []
        if missing:
            named = "; ".join(f"leaf {w}: {text}" for w, text in sorted(missing.items()))
            parts.append(f"leaves {sorted(missing)} do not hold version {version} ({named})")
        if failure:
            parts.append(f"its send to the leaves failed: {failure}")
        return f"{where}: " + "; ".join(parts)
