"""The sender's part of a transfer in the distributed plane: buckets packed and sent point to
point, in a star to every member, in a chain to the first one only."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from aiowsync._exceptions import TransportError
from aiowsync._util.text import first_line

from .buckets import Image, Packer
from .collectives import Backend
from .links import wait_link

__all__ = ["send_buckets"]


def send_buckets(
    pg: Any,
    packer: Packer,
    images: Sequence[Image],
    indices: Sequence[int],
    peers: Mapping[int, int],
    deadline: float,
    *,
    stall: float,
    backend: Backend,
    device: torch.device,
    hashing: bool = False,
    follow: Callable[[], torch.Tensor | None] = lambda: None,
) -> None:
    """Send buckets ``indices`` (each from the image of its model in ``images``) from rank 0
    to the ranks of ``peers`` (rank -> worker index): every member in a star, the first one
    in a chain (which forwards them). Each bucket is packed just before it is sent, while the
    one before it is still on the wire; with ``hashing``, it is hashed for the digest once
    sent, while it is on the wire. What ``follow()`` gives (the sealed digest, made once the
    last bucket is out) is sent after the last bucket, tagged with the bucket count.

    Not a broadcast: gloo relays a broadcast through a tree of receivers, so one dead
    receiver would hold up the others behind it until the deadline. Here each member depends
    on the sender alone. A member whose send fails is left out of the later buckets, the
    others get the whole version, and the failure is raised at the end, naming each failed
    member. A member whose link moved nothing for ``stall`` seconds (a stopped process, whose
    connections stay open) is raised at once: the wait that found it closed the group's
    every connection (see :mod:`~aiowsync._planes.dist.links`), so the others fail their
    receives and are sent the version again on a fresh group.
    """
    buckets = packer.buckets
    alive = dict(peers)  # rank -> worker index
    failed: dict[int, str] = {}

    def fail(rank: int, exc: BaseException) -> None:
        worker = alive.pop(rank, None)
        if worker is not None:
            failed[worker] = first_line(exc)

    def failure() -> TransportError:
        return TransportError("; ".join(f"worker {w}: {t}" for w, t in sorted(failed.items())))

    def post(tensor: torch.Tensor, tag: int) -> list[tuple[int, Any]]:
        works = []
        for rank in list(alive):
            try:
                works.append((rank, pg.send([tensor], rank, tag)))
            except RuntimeError as exc:
                fail(rank, exc)
        return works

    def wait(works: list[tuple[int, Any]]) -> None:
        for rank, work in works:
            if rank not in alive:
                continue  # failed on an earlier bucket: its sends go with the group
            peer = f"worker {alive[rank]}"
            try:
                wait_link(work, backend, device, allowed=stall, deadline=deadline, peer=peer)
            except RuntimeError as exc:  # failed on its own (or at the deadline)
                fail(rank, exc)
            except TransportError as exc:  # stalled, or out of time: the group is gone
                fail(rank, exc)
                raise failure() from None

    in_flight: list[tuple[int, Any]] = []
    for number, index in enumerate(indices):
        image = images[buckets.span_of[index]]
        packer.pack(image, index)
        lo, hi = buckets.ranges[index]
        posted = post(image.flat[lo:hi], index) if alive else []
        if hashing:
            packer.hash_bucket(image, index)
        if number:
            wait(in_flight)
        in_flight = posted
    trailer = follow() if alive else None
    if trailer is not None:
        in_flight += post(trailer, len(buckets.ranges))
    wait(in_flight)
    if failed:
        raise failure()
