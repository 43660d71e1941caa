"""The sender's part of a transfer in the distributed plane: buckets packed and sent point to
point, in a star to every member, in a chain to the first one only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from aiowsync._exceptions import TransportError
from aiowsync._util.text import first_line

from .buckets import Image, Packer
from .chain import ChainLimits, wait_link
from .collectives import Backend, finish, seconds_left

__all__ = ["send_buckets"]


def send_buckets(
    pg: Any,
    packer: Packer,
    images: Sequence[Image],
    indices: Sequence[int],
    workers: Sequence[int],
    deadline: float,
    *,
    limits: ChainLimits | None,
    backend: Backend,
    device: torch.device,
) -> None:
    """Send buckets ``indices`` (each from the image of its model in ``images``) from rank 0
    to the members ``workers`` (ranks 1, 2, ...); with chain ``limits``, to the first member
    only, which forwards them, and a member that takes nothing for ``limits.stall`` seconds
    counts as failed. Each bucket is packed just before it is sent, while the one before it
    is still on the wire.

    Not a broadcast: gloo relays a broadcast through a tree of receivers, so one dead
    receiver would hold up the others behind it until the deadline. Here each member depends
    on the sender alone; a member that fails is left out of the later buckets, the others
    get the whole version, and the failure is raised at the end, naming each failed member.
    """
    buckets = packer.buckets
    alive = dict(enumerate(workers, start=1))  # rank -> worker index
    if limits is not None:
        alive = dict(list(alive.items())[:1])  # the first member; it forwards the rest
    failed: dict[int, str] = {}

    def fail(rank: int, exc: BaseException) -> None:
        worker = alive.pop(rank, None)
        if worker is not None:
            failed[worker] = first_line(exc)

    def post(index: int) -> list[tuple[int, Any]]:
        lo, hi = buckets.ranges[index]
        image = images[buckets.span_of[index]]
        works = []
        for rank in list(alive):
            try:
                works.append((rank, pg.send([image.flat[lo:hi]], rank, index)))
            except RuntimeError as exc:
                fail(rank, exc)
        return works

    def wait(works: list[tuple[int, Any]]) -> None:
        for rank, work in works:
            try:
                if limits is None:
                    finish(work, backend, seconds_left(deadline), device)
                else:
                    peer = f"worker {workers[rank - 1]}"
                    wait_link(
                        work, backend, device, allowed=limits.stall, deadline=deadline, peer=peer
                    )
            except (RuntimeError, TransportError) as exc:
                fail(rank, exc)

    in_flight: list[tuple[int, Any]] = []
    for number, index in enumerate(indices):
        packer.pack(images[buckets.span_of[index]], index)
        posted = post(index) if alive else []
        if number:
            wait(in_flight)
        in_flight = posted
    wait(in_flight)
    if failed:
        detail = "; ".join(f"worker {w}: {text}" for w, text in sorted(failed.items()))
        raise TransportError(detail)
