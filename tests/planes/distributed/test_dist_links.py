"""The sender's waits on its links in a star: a member that takes nothing for the stall limit
is named, and the group breaks at once, so the others' receives fail instead of waiting for
the deadline (the delivery then sends them the version again on a fresh group); on a real
gloo group whose ranks are threads of this process."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from aiowsync._exceptions import TransportError
from aiowsync._planes.dist.buckets import Buckets, Image
from aiowsync._planes.dist.collectives import finish
from aiowsync._planes.dist.links import LINK_STALL, SLOW_LINK, LinkPace, stall_limit
from aiowsync._planes.dist.send import send_buckets
from helpers import gloo_group_in_threads

pytestmark = pytest.mark.timeout(90)

CPU = torch.device("cpu")
BUCKET = 4096
BUCKETS = 4
"""More than two: the sender posts a bucket only once the one two before it has left."""
DEADLINE = 40.0
"""The transfer's deadline: far above every stall limit here, so that only a limit ends a wait."""


def test_the_stall_limit_grows_with_the_time_a_bucket_takes() -> None:
    assert stall_limit(0.0) == LINK_STALL
    assert stall_limit(0.5) == pytest.approx(LINK_STALL + 2.0)


def test_the_pace_is_that_of_the_largest_bucket_the_model_has_not_of_the_bucket_size() -> None:
    # A model of 8 MiB and 1 MiB in 32 MiB buckets: the limits before the first transfer
    # assume 8 MiB on a slow link, not 32 MiB (a stopped chain member held up a send of an
    # 8 MiB model for 27 s where the link moved it in 20 ms).
    pace = LinkPace([(0, 8 << 20), (8 << 20, 9 << 20)])
    assert pace.bucket_seconds == pytest.approx((8 << 20) / SLOW_LINK)


def test_a_transfer_of_one_bucket_or_some_buckets_sets_the_pace_of_the_largest() -> None:
    pace = LinkPace([(0, 8 << 20), (8 << 20, 12 << 20), (12 << 20, 12 << 20 | 4096)])
    pace.observe(0.02, [0], 1)  # the largest bucket alone
    assert pace.bucket_seconds == pytest.approx(0.02)
    pace.observe(0.01, [1], 2)  # 4 MiB to each of two members: 8 MiB takes twice as long
    assert pace.bucket_seconds == pytest.approx(0.01 / 2 * 2)
    pace.observe(0.5, [0, 1], 1)
    assert pace.bucket_seconds == pytest.approx(0.5 * 8 / 12)
    # Learnt from nothing: no bytes, no link, or a bucket too small to show the pace (4 KiB
    # in 5 ms would make 8 MiB take 10 s).
    pace.observe(0.5, [], 1)
    pace.observe(0.5, [0], 0)
    pace.observe(0.005, [2], 1)
    assert pace.bucket_seconds == pytest.approx(0.5 * 8 / 12)


@dataclass
class Star:
    raised: BaseException | None
    """What :func:`send_buckets` raised."""
    took: float
    """How long it took."""
    held: dict[int, bool]
    """By receiving rank, whether it got every bucket exactly."""
    failed_after: dict[int, float]
    """By receiving rank whose receive failed, after how long (from the send's start)."""


def send_to_a_star(stalled: set[int], members: int, stall: float) -> Star:
    """Send :data:`BUCKETS` buckets from rank 0 to ``members`` ranks (rank r is worker
    ``10 + r``); the ranks in ``stalled`` post no receive, the others receive every bucket,
    in a thread each."""
    values = torch.Generator().manual_seed(len(stalled))
    image = Image(torch.randint(0, 256, (BUCKETS * BUCKET,), dtype=torch.uint8, generator=values))
    packer = SimpleNamespace(
        buckets=Buckets(BUCKETS * BUCKET, BUCKET), pack=lambda image, index: None
    )
    got: dict[int, list[torch.Tensor]] = {}
    failed_after: dict[int, float] = {}
    with gloo_group_in_threads(members + 1) as groups:
        started = time.monotonic()

        def receive(rank: int) -> None:
            buckets = [torch.zeros(BUCKET, dtype=torch.uint8) for _ in range(BUCKETS)]
            try:
                works = [groups[rank].recv([b], 0, i) for i, b in enumerate(buckets)]
                for work in works:
                    finish(work, "gloo", DEADLINE, CPU)
            except RuntimeError:
                failed_after[rank] = time.monotonic() - started
            else:
                got[rank] = buckets

        ranks = [r for r in range(1, members + 1) if r not in stalled]
        threads = [threading.Thread(target=receive, args=(r,), daemon=True) for r in ranks]
        for thread in threads:
            thread.start()
        raised = None
        try:
            send_buckets(
                groups[0],
                packer,  # type: ignore[arg-type]
                [image],
                range(BUCKETS),
                {r: 10 + r for r in range(1, members + 1)},
                started + DEADLINE,
                stall=stall,
                backend="gloo",
                device=CPU,
            )
        except TransportError as exc:
            raised = exc
        took = time.monotonic() - started
        for thread in threads:
            thread.join(DEADLINE)
    want = list(image.flat.split(BUCKET))
    held = {
        rank: all(torch.equal(a, b) for a, b in zip(buckets, want, strict=True))
        for rank, buckets in got.items()
    }
    return Star(raised, took, held, failed_after)


def test_a_stalled_member_is_named_and_the_others_are_let_go_at_once() -> None:
    stall = 1.0
    star = send_to_a_star({2}, members=3, stall=stall)
    assert isinstance(star.raised, TransportError), repr(star.raised)
    assert str(star.raised).startswith(
        "worker 12: nothing moved on the link to worker 12 for 1.0 s"
    ), star.raised
    assert stall <= star.took < DEADLINE / 2  # the limit ended the wait, not the deadline
    # The others' receives fail soon after (the group's connections closed), so that they
    # can say so and be sent the version again; none took a bucket as the whole version.
    assert set(star.failed_after) == {1, 3} and not star.held, star
    assert max(star.failed_after.values()) < DEADLINE / 2, star


def test_healthy_members_take_no_limit_at_all() -> None:
    star = send_to_a_star(set(), members=3, stall=LINK_STALL)
    assert star.raised is None and star.held == {1: True, 2: True, 3: True}, star
    assert star.took < LINK_STALL
