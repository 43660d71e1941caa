"""The chain topology's own parts: its timing limits (pure functions), and the peer a stalled
link's error names, on a real gloo group whose ranks are threads of this process."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from aiowsync._exceptions import TransportError
from aiowsync._planes.dist.chain import ChainLimits, receive_and_forward
from aiowsync._planes.dist.collectives import finish
from aiowsync._planes.dist.links import LINK_STALL
from helpers import gloo_group_in_threads

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")
STALL = 0.5
"""The gloo tests' stall limit: short, since each of them waits it out."""
MEMBERS = [5, 6]
"""The chain's workers: rank 1 is worker 5, rank 2 worker 6 (rank 0 is the sender)."""
BUCKET = 4096

# -- the limits ---------------------------------------------------------------------------------


def test_the_limits_grow_with_the_time_a_bucket_takes() -> None:
    fast, slow = ChainLimits.for_pace(0.0), ChainLimits.for_pace(0.5)
    assert fast.stall == LINK_STALL and fast.hop == pytest.approx(0.05)
    assert slow.stall == pytest.approx(LINK_STALL + 2.0) and slow.hop == pytest.approx(1.05)
    # The first bucket passes through every member before: each adds a hop to the wait.
    assert slow.first(0) == slow.stall
    assert slow.first(3) == pytest.approx(LINK_STALL + 2.0 + 3 * 1.05)


def test_the_limits_travel_in_an_update_in_whole_milliseconds() -> None:
    limits = ChainLimits.for_pace(0.123)
    params = limits.params()
    assert params == {"stall_ms": 5492, "hop_ms": 296}
    back = ChainLimits.from_params({**params, "topology": "chain", "group": "0123"})
    assert back is not None
    assert back.stall == pytest.approx(5.492) and back.hop == pytest.approx(0.296)
    assert back.first(7) == pytest.approx(limits.first(7), abs=0.01)
    # A stall under a millisecond is still a limit (0 would read as none); a hop may be 0.
    assert ChainLimits(0.0001, 0.0).params() == {"stall_ms": 1, "hop_ms": 0}
    assert ChainLimits.from_params({"stall_ms": 1, "hop_ms": 0}) == ChainLimits(0.001, 0.0)


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"stall_ms": 5000},
        {"hop_ms": 50},
        {"stall_ms": 0, "hop_ms": 50},
        {"stall_ms": -5000, "hop_ms": 50},
        {"stall_ms": 5000, "hop_ms": -1},
        {"stall_ms": "5000", "hop_ms": 50},
        {"stall_ms": 5000.0, "hop_ms": 50},
        {"stall_ms": 5000, "hop_ms": None},
    ],
)
def test_an_update_without_sound_limits_gives_none(params: dict[str, Any]) -> None:
    # None: the member then waits on its links until the send's deadline, never less.
    assert ChainLimits.from_params(params) is None


# -- a stalled link names its peer ----------------------------------------------------------


def run_members(groups: list[Any], ranks: list[int]) -> dict[int, tuple[Any, list[torch.Tensor]]]:
    """Run :func:`receive_and_forward` of two buckets on each rank of ``ranks``, in threads
    at once: each rank's outcome (what it returned, or what it raised) and its buckets."""
    outcomes: dict[int, tuple[Any, list[torch.Tensor]]] = {}
    limits = ChainLimits(stall=STALL, hop=0.0)
    deadline = time.monotonic() + 30

    def member(rank: int) -> None:
        targets = [(i, torch.zeros(BUCKET, dtype=torch.uint8)) for i in range(2)]
        outcome: Any
        try:
            outcome = receive_and_forward(
                groups[rank],
                rank,
                MEMBERS,
                targets,
                deadline=deadline,
                limits=limits,
                backend="gloo",
                device=CPU,
                held=[],
            )
        except (TransportError, RuntimeError) as exc:
            outcome = exc
        outcomes[rank] = (outcome, [dst for _, dst in targets])

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(25)
    assert not any(t.is_alive() for t in threads), "a member waited past its stall limit"
    return outcomes


def test_a_stalled_receive_names_the_member_before() -> None:
    # The sender sends nothing: worker 5 waits on the sender, worker 6 on worker 5.
    with gloo_group_in_threads(3) as groups:
        started = time.monotonic()
        outcomes = run_members(groups, [1, 2])
        took = time.monotonic() - started
    (first, _), (second, _) = outcomes[1], outcomes[2]
    assert isinstance(first, TransportError), repr(first)
    assert str(first).startswith("nothing moved on the link to the sender for 0.5 s"), first
    assert isinstance(second, TransportError), repr(second)
    assert str(second).startswith("nothing moved on the link to worker 5 for 0.5 s"), second
    assert took < 10  # the stall limit ended the waits, not the 30 s deadline


def test_a_stalled_forward_names_the_member_after_and_keeps_what_arrived() -> None:
    # The sender sends both buckets to worker 5, which forwards them to worker 6; worker 6
    # never posts a receive, so worker 5's sends never complete.
    with gloo_group_in_threads(3) as groups:
        sent = [torch.full((BUCKET,), 10 + i, dtype=torch.uint8) for i in range(2)]
        sends = [groups[0].send([t], 1, i) for i, t in enumerate(sent)]
        outcomes = run_members(groups, [1])
        for work in sends:
            finish(work, "gloo", 10, CPU)
    broken, got = outcomes[1]
    # Forwarding failed, and said why; worker 5 holds the whole version all the same.
    assert isinstance(broken, str), repr(broken)
    assert broken.startswith("nothing moved on the link to worker 6 for 0.5 s"), broken
    assert all(torch.equal(got, want) for got, want in zip(got, sent, strict=True))
