"""How long either end of a link of the distributed plane waits on it before taking the peer
at its other end for dead or stalled.

Why bounded: a gloo send or receive cannot be interrupted, a send waits for its receiver to
post the receive, and a connection that closes does not always fail the work already posted
on it. A stopped process keeps its connections open, so nothing fails on its own: in a
chain, the members after it waited on it until the send's deadline; in a star, the sender
did, and every other member with it, since the sender posts a bucket only once the one two
before it has left. So every wait on a link ends once the link has moved nothing for the
*stall limit*.

A gloo wait that times out closes every connection of its group (gloo tells all of the
group's pairs), so one stalled link fails the whole group at once: every member still
waiting on it fails its receive, and the sender sends the version again, on a fresh group,
to those that say so (in a star, every member but the stalled one; in a chain, those after
it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from aiowsync._exceptions import TransportError

from .collectives import Backend, finish, seconds_left

__all__ = ["LINK_STALL", "SLOW_LINK", "LinkPace", "stall_limit", "wait_link"]

LINK_STALL = 5.0
"""How long a link may move nothing, beyond a few times what a bucket takes, before the end
waiting on it takes the peer at its other end for dead or stalled."""

SLOW_LINK = 100e6 / 8
"""The link speed, in bytes per second, that the limits assume until a transfer has shown
the real one (100 Mbit/s)."""


def stall_limit(bucket_seconds: float) -> float:
    """The stall limit of a link on which a bucket takes ``bucket_seconds``, with room to
    spare for a busy host."""
    return LINK_STALL + 4 * bucket_seconds


class LinkPace:
    """How long the largest bucket of a version takes on one link, as the latest transfer
    went (before the first, as if on a :data:`SLOW_LINK`): the stall limits scale with it."""

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._ranges = ranges
        self._largest = max((hi - lo for lo, hi in ranges), default=1)
        self.bucket_seconds = self._largest / SLOW_LINK

    def observe(self, seconds: float, indices: Sequence[int], links: int) -> None:
        """A transfer of the buckets ``indices`` on ``links`` links took ``seconds``.

        A transfer of one bucket counts too: its time includes its packing and the receivers'
        posting, so it errs towards longer limits. One of less than half the largest bucket
        (a send of a small model among larger ones) is left out: its time is mostly the
        fixed cost of an operation, which scaled up to the largest bucket would stretch the
        limits far past any link's pace."""
        sent = sum(self._ranges[i][1] - self._ranges[i][0] for i in indices)
        if links > 0 and sent > 0 and 2 * sent >= self._largest:
            self.bucket_seconds = seconds / links * self._largest / sent


def wait_link(
    work: Any,
    backend: Backend,
    device: torch.device,
    *,
    allowed: float,
    deadline: float,
    peer: str,
) -> None:
    """Wait for one send or receive on the link to ``peer``: at most ``allowed`` seconds, and
    never past ``deadline``. A link that moved nothing for ``allowed`` seconds raises
    :class:`TransportError` naming ``peer`` (a wait that starts past ``deadline`` raises it
    too); a wait that fails on its own, or at ``deadline``, raises gloo's ``RuntimeError``."""
    left = seconds_left(deadline)
    if allowed >= left:
        finish(work, backend, left, device)
        return
    started = time.monotonic()
    try:
        finish(work, backend, allowed, device)
    except RuntimeError as exc:
        if time.monotonic() - started < 0.95 * allowed:
            raise  # failed on its own, not for lack of time
        raise TransportError(
            f"nothing moved on the link to {peer} for {allowed:.1f} s: {peer} died or "
            "stalled, or waits on a member that did"
        ) from exc
