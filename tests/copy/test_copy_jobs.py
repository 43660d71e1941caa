"""The copy engine's jobs: fused copies, copies cut into pieces across helper threads, the helpers'
CPUs, and the share of a copy started early."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from aiowsync._copy.engine import CopyPolicy, fused_copy
from aiowsync._copy.job import (
    EARLY_TAILS,
    MAX_MOVE,
    TAIL,
    CopyJob,
    cut_moves,
    early_share,
    split_sizes,
)


def test_fused_copy_of_a_large_mixed_list_copies_every_byte(policy: CopyPolicy) -> None:
    g = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.float16]
    src: list[torch.Tensor] = []
    for i in range(300):
        n = int(torch.randint(1, 20000, (1,), generator=g))
        t = (torch.randn(n, generator=g) * 100).to(dtypes[i % len(dtypes)])
        src.append(t)
    src.append(torch.randn(64, 32, generator=g).t())  # non-contiguous goes through torch
    dst = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in src]
    assert sum(t.nbytes for t in dst) > 4 * 1024 * 1024  # large enough for the threaded path
    fused_copy(dst, src, policy)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))


def test_a_closed_policy_still_copies_every_byte_in_the_callers_thread() -> None:
    # A plane that closes while a send stages shuts its helper threads down under that copy:
    # the copy must still end whole, with no new threads started for it.
    policy = CopyPolicy()
    src = [torch.randn(3 * 1024 * 1024) for _ in range(3)]
    dst = [torch.empty_like(t) for t in src]
    fused_copy(dst, src, policy)
    policy.close()
    for t in src:
        t.add_(1.0)
    fused_copy(dst, src, policy)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    assert policy.gather_pool() is None


def test_a_job_whose_helpers_cannot_start_is_finished_by_its_caller() -> None:
    done: list[int] = []
    job = CopyJob([0, 1], [2, 3], done.append)
    shut = ThreadPoolExecutor(max_workers=1)
    shut.shutdown()
    job.start(shut)
    job.finish()
    assert sorted(done) == [0, 1, 2, 3]


def test_a_helper_kept_off_the_cpus_delays_nothing_it_had_not_begun() -> None:
    """A helper that has not begun when the caller runs out of pieces (its thread busy, or
    not scheduled: another process holds the CPU it was woken on) neither holds the copy up
    nor copies anything after it: the caller takes its tail, and the helper, once it runs,
    finds nothing left."""
    import threading

    done: list[int] = []
    hold = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(hold.wait, 30)  # the pool's only thread is busy
        job = CopyJob([0, 1, 2], [10], done.append)
        job.start(pool, settle=0.01)
        job.finish()  # returns without the helper
        assert sorted(done) == [0, 1, 2, 10]
        hold.set()
    assert sorted(done) == [0, 1, 2, 10]  # the helper ran later and copied nothing


def test_a_caller_waiting_for_its_helper_to_begin_copies_the_head_meanwhile() -> None:
    """While the helper has not begun (its CPU busy with another process), the caller copies
    pieces of the head instead of idling through the settle time; the helper's tail stays
    the helper's until the caller finishes, and every piece is copied once."""
    import threading
    import time

    done: list[int] = []
    hold = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(hold.wait, 30)  # the helper cannot begin
        job = CopyJob([0, 1, 2], [10], done.append)
        t0 = time.monotonic()
        job.start(pool, settle=0.05)
        assert time.monotonic() - t0 >= 0.04  # no piece left: it waited the rest
        assert done == [0, 1, 2]
        job.finish()
        assert done == [0, 1, 2, 10]
        hold.set()
    assert done == [0, 1, 2, 10]


def test_a_caller_stops_copying_the_head_once_its_helper_begins() -> None:
    """The helper begins while the caller copies its first piece: the caller copies no more
    before its check, and the rest of the head is still there for both."""
    import threading

    done: list[int] = []
    copying, gate = threading.Event(), threading.Event()

    def run(piece: int) -> None:
        if piece == 0:  # the caller's first piece lets the helper begin, and waits for it
            copying.set()
            assert job._begun.wait(5)
        if piece == 10:  # the helper's tail waits for the caller's check
            assert gate.wait(5)
        done.append(piece)

    job = CopyJob(list(range(6)), [10], run)
    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(copying.wait, 5)  # the helper begins once the caller copies
        job.start(pool, settle=5.0)
        assert done == [0]
        gate.set()
        job.finish()
    assert sorted(done) == [0, 1, 2, 3, 4, 5, 10]


def test_an_error_while_settling_stops_the_helpers_and_is_raised() -> None:
    import threading

    hold = threading.Event()

    def run(piece: int) -> None:
        if piece == 0:
            raise OSError("no room")

    with ThreadPoolExecutor(max_workers=1) as pool:
        pool.submit(hold.wait, 30)  # the helper cannot begin while the caller copies
        job = CopyJob([0, 1], [10], run)
        with pytest.raises(OSError, match="no room"):
            job.start(pool, settle=1.0)
        assert job._stopped
        hold.set()


@pytest.mark.parametrize("early", [0.0, 0.01, 0.5, 2.0])
@pytest.mark.parametrize("threads", [1, 2, 3, 4])
@pytest.mark.parametrize("total", [4 << 20, (64 << 20) + 70, 1 << 30])
def test_a_parallel_copy_is_cut_into_pieces_that_cover_every_byte_once(
    threads: int, total: int, early: float
) -> None:
    heads, tails = split_sizes(total, threads, early)
    assert sum(heads) + sum(tails) == total
    assert len(tails) in (0, threads - 1) and all(n > 0 for n in heads + tails)
    usual = TAIL * (threads - 1) / threads
    if tails:
        # Started before a check: the tails take the check's expected share of the copy, up
        # to EARLY_TAILS, and never less than usual.
        want = max(usual, min(early, EARLY_TAILS))
        assert sum(tails) == pytest.approx(want * total, rel=1e-3)
    # Moves laid end to end (sources far from destinations), cut into those groups.
    sizes = [total // 3, 5, total - total // 3 - 5]
    moves, at = [], 0
    for n in sizes:
        moves.append((at, (1 << 40) + at, n))
        at += n
    groups = cut_moves(moves, heads + tails)
    assert len(groups) == len(heads) + len(tails)
    flat = [m for g in groups for m in g]
    assert all(0 < n <= MAX_MOVE and s - d == 1 << 40 for d, s, n in flat)
    covered = 0
    for d, _, n in flat:  # in order, no gap, no overlap
        assert d == covered
        covered += n
    assert covered == total
    assert [sum(n for _, _, n in g) for g in groups] == heads + tails


def test_a_copy_job_abandoned_stops_taking_pieces() -> None:
    import time
    from concurrent.futures import ThreadPoolExecutor

    done: list[int] = []
    jobs: list[CopyJob[int]] = []

    def run(piece: int) -> None:
        if piece == -1:  # the helper's tail: it ends only once the job is abandoned
            deadline = time.monotonic() + 5
            while not jobs[0]._stopped and time.monotonic() < deadline:
                time.sleep(0.001)
        done.append(piece)

    with ThreadPoolExecutor(1) as pool:
        jobs.append(CopyJob(list(range(100)), [-1], run))
        jobs[0].start(pool, settle=1.0)
        before = list(done)  # pieces the caller copied until its helper began
        jobs[0].abandon()
        # The tail ends; no piece of the head is begun after it.
        assert sorted(done) == [-1, *before]
        # finish() copies everything, the calling thread included.
        done.clear()
        job = CopyJob(list(range(100)), [-1], done.append)
        job.start(pool)
        job.finish()
        assert sorted(done) == [-1, *range(100)]


def test_helpers_are_woken_away_from_the_callers_cpu_and_take_its_cpus_back() -> None:
    import os
    import threading

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs Linux and two CPUs")
    cpus = os.sched_getaffinity(0)
    src = torch.randn(3 << 20)  # 12 MiB: copied by this thread and a helper
    dst = torch.zeros_like(src)
    policy = CopyPolicy()
    others = set(threading.enumerate())
    fused_copy([dst], [src], policy)
    assert torch.equal(dst, src)
    helpers = [t for t in set(threading.enumerate()) - others if t.name.startswith("aiowsync-copy")]
    assert helpers
    assert policy.steer_helpers() == cpus
    for t in helpers:
        assert t.native_id is not None
        mask = os.sched_getaffinity(t.native_id)
        assert mask < cpus and len(mask) == len(cpus) - 1  # all but the caller's CPU
    ran: list[threading.Thread] = []
    for _ in range(50):  # on a busy host the caller may copy every share before a helper wakes
        src.add_(1)
        fused_copy([dst], [src], policy)  # a helper takes its share, and its CPUs back
        assert torch.equal(dst, src)
        ran = [t for t in helpers if t.native_id and os.sched_getaffinity(t.native_id) == cpus]
        if ran:
            break
    assert ran
    policy.close()
    assert not any(t.is_alive() for t in helpers)


def test_the_early_share_follows_what_the_check_is_expected_to_cost() -> None:
    mib = 1 << 20
    # A thousand tensors in 64 MiB: the check may outlast half the copy, the tails take the most.
    many = early_share(1000, 64 * mib)
    assert many > EARLY_TAILS
    heads, tails = split_sizes(64 * mib, 2, many)
    assert sum(tails) == pytest.approx(EARLY_TAILS * 64 * mib, rel=1e-3)
    # Four tensors in 256 MiB check in microseconds: cut as a copy started after the check.
    few = early_share(4, 256 * mib)
    assert few < 0.01
    assert split_sizes(256 * mib, 2, few) == split_sizes(256 * mib, 2)
    assert sum(split_sizes(256 * mib, 2, few)[1]) == pytest.approx(TAIL / 2 * 256 * mib, 1e-3)
    assert early_share(10, 0) == 0.0
