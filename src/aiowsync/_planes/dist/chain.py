"""The chain topology of the distributed plane: each member receives every bucket from the
member before it and forwards it to the member after, and waits on its links for a bounded
time only (see :mod:`~aiowsync._planes.dist.links`).

A member that gets nothing from the member before it for :attr:`ChainLimits.stall` seconds
fails its receive, which the sender retries on a fresh chain without the dead member, well
within the deadline.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from aiowsync._exceptions import TransportError
from aiowsync._util.text import first_line

from ..base import Params
from .collectives import Backend
from .links import stall_limit, wait_link

__all__ = ["ChainLimits", "receive_and_forward"]


@dataclass(frozen=True, slots=True)
class ChainLimits:
    """How long a chain member waits on a link before taking it for broken."""

    stall: float
    """Seconds a link may go without delivering the next bucket."""
    hop: float
    """More seconds for the first bucket per member before this one (it passes through each)."""

    @classmethod
    def for_pace(cls, bucket_seconds: float) -> ChainLimits:
        """The limits for links that move a bucket in ``bucket_seconds``, with room to spare
        for a busy host."""
        return cls(stall_limit(bucket_seconds), 2 * bucket_seconds + 0.05)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> ChainLimits | None:
        """The limits an update gives; None when it gives none (the deadline alone counts)."""
        stall, hop = params.get("stall_ms"), params.get("hop_ms")
        if not isinstance(stall, int) or not isinstance(hop, int) or stall <= 0 or hop < 0:
            return None
        return cls(stall / 1000, hop / 1000)

    def params(self) -> Params:
        return {"stall_ms": max(1, round(self.stall * 1000)), "hop_ms": round(self.hop * 1000)}

    def first(self, before: int) -> float:
        """The wait for the first bucket of a member with ``before`` members before it."""
        return self.stall + before * self.hop


def receive_and_forward(
    pg: Any,
    rank: int,
    workers: list[int],
    targets: list[tuple[int, torch.Tensor]],
    *,
    deadline: float,
    limits: ChainLimits | None,
    backend: Backend,
    device: torch.device,
    held: list[Any],
    arrived: Callable[[int], None] | None = None,
) -> str:
    """Receive each bucket of ``targets`` (index, destination) from rank ``rank - 1`` and send
    it on to rank ``rank + 1`` as soon as it is here, while the next one comes in.

    Raises :class:`TransportError` when a bucket does not arrive. Returns why forwarding
    failed, or ``""``: this member holds the whole version either way. ``held`` receives the
    pending work, so that the caller can let it go with the group. ``arrived(index)`` is
    called for each bucket once it is here and on its way to the next member.
    """
    before = "the sender" if rank == 1 else f"worker {workers[rank - 2]}"
    after = rank + 1 if rank < len(workers) else None
    following = f"worker {workers[rank]}" if after is not None else ""
    stall = limits.stall if limits is not None else float("inf")
    works = [pg.recv([dst], rank - 1, index) for index, dst in targets]
    sends: list[Any] = []
    held += [works, sends]
    broken = ""
    for number, ((index, dst), work) in enumerate(zip(targets, works, strict=True)):
        allowed = limits.first(rank - 1) if limits is not None and number == 0 else stall
        wait_link(work, backend, device, allowed=allowed, deadline=deadline, peer=before)
        if after is not None and not broken:
            try:
                sends.append(pg.send([dst], after, index))
            except RuntimeError as exc:
                broken = first_line(exc)
        if arrived is not None:
            arrived(index)
    for work in sends:
        if broken:
            break  # the rest go with the group
        try:
            wait_link(work, backend, device, allowed=stall, deadline=deadline, peer=following)
        except (RuntimeError, TransportError) as exc:
            broken = first_line(exc)
    return broken
