"""The sender engine's side of a delivery's retries: its members' answers, and new
announcements for those worth another attempt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio

from .._planes.base import Member, Params
from .._protocol import Update
from .._util.shield import to_the_end
from .outcome import Answers
from .peers import Peer

if TYPE_CHECKING:
    from .engine import SenderCore

__all__ = ["AnswerRetries"]


class AnswerRetries:
    """The engine's side of a delivery's retries (see :class:`Retries`), for one version."""

    def __init__(self, core: SenderCore, pending: Answers, members: list[Peer]) -> None:
        self._core = core
        self.pending = pending
        self._members = members

    def waiting(self) -> set[int]:
        return self.pending.waiting

    def retryable(self) -> list[Member]:
        pending, peers = self.pending, self._core.peers
        return [
            (p.worker_idx, p.session)
            for p in self._members
            if p.worker_idx in pending.retryable and not p.lost and peers.get(p.worker_idx) is p
        ]

    def done(self) -> bool:
        return self.pending.done.is_set() or self._core.channel is None

    async def changed(self, timeout: float) -> None:
        with anyio.move_on_after(timeout):
            await self.pending.changed.wait()

    async def announce(self, members: Sequence[Member], attempt: int, params: Params) -> bool:
        core = self._core
        channel = core.channel
        if channel is None:
            return False
        version = self.pending.version
        params = core.with_digest(version, params)
        update = Update(version=version, attempt=attempt, params=params, proof=core.proof)
        peers = [p for w, _ in members if (p := core.peers.get(w)) is not None]
        self.pending.reopen([p.worker_idx for p in peers])
        await to_the_end(core.announcer.all(channel, peers, update))
        return True
