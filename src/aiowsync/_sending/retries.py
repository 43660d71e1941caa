"""The sender engine's side of a delivery's retries: its members' answers, and new
announcements for those worth another attempt."""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from .._planes.base import Member, Params
from .._protocol import Update
from .._util.shield import to_the_end
from .outcome import Answers
from .peers import Peer
from .state import SenderState

__all__ = ["AnswerRetries"]


class AnswerRetries:
    """The engine's side of a delivery's retries (see :class:`Retries`), for one version."""

    def __init__(self, state: SenderState, pending: Answers, members: list[Peer]) -> None:
        self._state = state
        self.pending = pending
        self._members = members

    def waiting(self) -> set[int]:
        return self.pending.waiting

    def retryable(self) -> list[Member]:
        pending, peers = self.pending, self._state.peers
        return [
            (p.worker_idx, p.session)
            for p in self._members
            if p.worker_idx in pending.retryable and not p.lost and peers.get(p.worker_idx) is p
        ]

    def done(self) -> bool:
        return self.pending.done.is_set() or self._state.channel is None

    async def changed(self, timeout: float) -> None:
        with anyio.move_on_after(timeout):
            await self.pending.changed.wait()

    async def announce(self, members: Sequence[Member], attempt: int, params: Params) -> bool:
        state = self._state
        channel = state.channel
        if channel is None:
            return False
        version = self.pending.version
        params = state.with_digest(version, params)
        update = Update(version=version, attempt=attempt, params=params, proof=state.proof)
        peers = [p for w, _ in members if (p := state.peers.get(w)) is not None]
        self.pending.reopen([p.worker_idx for p in peers])
        await to_the_end(state.announcer.all(channel, peers, update))
        return True
