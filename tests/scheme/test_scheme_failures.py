"""What a user of a scheme sees on every data plane (2 of 3): deadlines, lost workers, which
error a send raises when several things go wrong, and cancellation.

Same rig as test_scheme_sends.py: one suite over each kind of plane, in this process.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

import aiowsync
from helpers import (
    CONNECT,
    KIND_BEATS,
    Kind,
    big_model,
    eventually,
    fill,
    frozen,
    held,
    model,
    same,
    switch_waits,
    values,
)

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.usefixtures("no_leaked_threads", "no_leaked_tasks"),
]


# -- deadlines, losses, and which error a send raises -----------------------------------------


def late_not_lost(deadline: float) -> dict[str, Any]:
    """Options of a rig whose worker a test holds late through a send of ``deadline``: beats
    that judge it lost only well after that deadline.

    The sender and its receivers share this process: a stall of the whole process (a busy
    host, an operation that holds the GIL) silences the receivers' beat threads too, and
    the sender, reading no beat when it resumes, would call the late worker lost (a
    LostDuringSendError, not the timeout the test is about) if its liveness limit were
    shorter than the send.
    """
    interval = KIND_BEATS.interval
    beats = aiowsync.Heartbeats(interval, missed=math.ceil((deadline + CONNECT) / interval))
    return {"heartbeats": beats, "sender_kw": {"heartbeats": beats}}


async def test_a_guard_held_past_the_deadline_times_out_naming_that_worker(kind: Kind) -> None:
    async with kind.system(3, **late_not_lost(kind.late)) as rig:
        r1, m1 = rig[1]
        fill(rig.src, 1.0)
        before = frozen(m1)
        with held(r1.read_guard()):
            with pytest.raises(aiowsync.WeightSyncTimeout) as info:
                await rig.sender.send(timeout=kind.late)
            assert type(info.value) is aiowsync.WeightSyncTimeout
            assert isinstance(info.value, TimeoutError)
            assert info.value.worker_ids == (1,)
            assert info.value.version == 1 and info.value.acked == (0, 2)
            assert r1.version == 0 and same(m1, before)  # no switch under the guard
            assert values(rig[0][1]) == {1.0} and values(rig[2][1]) == {1.0}
        # Released, the late worker switches to the version it was sent.
        assert await r1.wait_for_version(1, timeout=CONNECT) == 1
        assert values(m1) == {1.0}
        fill(rig.src, 2.0)
        result = await rig.sender.send()
        assert result.version == 2 and result.worker_ids == (0, 1, 2)


async def test_a_worker_that_left_fails_sends_at_once_and_rejoins_with_the_latest(
    kind: Kind,
) -> None:
    async with kind.system(3) as rig:
        core = rig.sender._sender
        assert core is not None
        fill(rig.src, 1.0)
        await rig.sender.send()
        await rig.leave(1)
        assert await eventually(lambda: 1 in core.lost_workers(), within=CONNECT)
        kept = frozen(rig[1][1])
        fill(rig.src, 2.0)
        with pytest.raises(aiowsync.WorkerLostError) as info:
            await rig.sender.send()
        assert type(info.value) is aiowsync.WorkerLostError
        assert info.value.worker_ids == (1,) and info.value.version is None
        assert rig.sender.version == 1  # nothing was staged
        result = await rig.sender.send(worker_ids=[0, 2])
        assert result.version == 2 and result.worker_ids == (0, 2)
        # The model of the worker that left keeps the last version it ran, in memory of its own.
        assert same(rig[1][1], kept) and values(rig[1][1]) == {1.0}
        # A new receiver under the same index is welcomed with the latest version.
        newcomer = model(42)
        r = await rig.add(kind, 1, newcomer)
        await asyncio.gather(r.connect(timeout=CONNECT), rig.sender.connect(timeout=CONNECT))
        assert r.version == 2 and values(newcomer) == {2.0}
        fill(rig.src, 3.0)
        result = await rig.sender.send()
        assert result.worker_ids == (0, 1, 2) and values(newcomer) == {3.0}


async def test_a_second_claimant_of_a_live_index_is_refused(kind: Kind) -> None:
    async with kind.system(2) as rig:
        r = kind.scheme(rig.sender.address, plane=rig.sender.plane)
        r.init_on_receiver(model=model(5), worker_idx=1)
        async with r:
            with pytest.raises(aiowsync.RefusedError, match="already connected"):
                await r.connect(timeout=CONNECT)
        assert rig[1][0].connected
        fill(rig.src, 1.0)
        assert (await rig.sender.send()).worker_ids == (0, 1)


async def test_a_worker_lost_while_a_send_waits_for_it(kind: Kind) -> None:
    # Worker 1 pulls, and does not: the update waits for it until it leaves.
    async with kind.system(3, each={1: {"background": False}}) as rig:
        fill(rig.src, 1.0)
        send = asyncio.create_task(rig.sender.send(timeout=CONNECT))
        assert await eventually(lambda: rig.sender.version == 1, within=CONNECT)
        await rig.leave(1)
        with pytest.raises(aiowsync.LostDuringSendError) as info:
            await send
        assert isinstance(info.value, aiowsync.WorkerLostError)
        assert isinstance(info.value, aiowsync.WeightSyncTimeout)
        assert info.value.worker_ids == (1,)
        assert info.value.version == 1 and info.value.acked == (0, 2)
        assert rig.versions() == [1, 0, 1] and values(rig[1][1]) != {1.0}
        fill(rig.src, 2.0)
        result = await rig.sender.send(worker_ids=[0, 2])
        assert result.version == 2 and values(rig[2][1]) == {2.0}


async def test_a_worker_closed_while_its_guard_blocks_the_switch(kind: Kind) -> None:
    """docs/failures.md: a worker that leaves while it applies an update nacks it with
    "receiver shut down"; its model stays on the version before."""
    async with kind.system(2) as rig:
        r1, m1 = rig[1]
        fill(rig.src, 1.0)
        before = frozen(m1)
        with held(r1.read_guard()):
            send = asyncio.create_task(rig.sender.send(timeout=CONNECT))
            assert await eventually(lambda: rig.sender.version == 1, within=CONNECT)
            assert await eventually(lambda: switch_waits(r1), within=CONNECT)
            leaving = asyncio.create_task(rig.leave(1))
            with pytest.raises(aiowsync.WeightSyncError) as info:
                await send
        await leaving  # its shutdown gives the model memory of its own under the guard
        assert isinstance(info.value, aiowsync.RemoteApplyError), repr(info.value)
        assert info.value.errors == {1: "receiver shut down"}
        assert info.value.version == 1 and info.value.acked == (0,)
        assert r1.version == 0 and same(m1, before)
        fill(rig.src, 2.0)
        assert (await rig.sender.send(worker_ids=[0])).version == 2


def failing_hook(version: int) -> None:
    raise RuntimeError("no room for the kv cache")


async def test_a_timeout_outranks_a_failed_apply(kind: Kind) -> None:
    """docs/failures.md: a send that meets several failures raises WeightSyncTimeout if any
    worker neither answered nor was lost by the deadline."""
    async with kind.system(3, **late_not_lost(kind.late)) as rig:
        rig[0][0].register_hook(failing_hook)
        with held(rig[1][0].read_guard()), pytest.raises(aiowsync.WeightSyncTimeout) as info:
            await rig.sender.send(timeout=kind.late)
        assert type(info.value) is aiowsync.WeightSyncTimeout
        assert info.value.worker_ids == (1,)
        assert info.value.version == 1 and info.value.acked == (2,)
        assert await rig[1][0].wait_for_version(1, timeout=CONNECT) == 1


async def test_a_timeout_outranks_a_loss(kind: Kind) -> None:
    # Worker 0 pulls, and does not, until it leaves; worker 1 holds its guard past the deadline.
    # (On dist, worker 0 holds up the group until it leaves: the group is then dropped, and
    # the others, who were waiting for it to join, are retried on a fresh one.)
    deadline = 2 * kind.late
    async with kind.system(3, each={0: {"background": False}}, **late_not_lost(deadline)) as rig:
        r1 = rig[1][0]
        with held(r1.read_guard()):
            send = asyncio.create_task(rig.sender.send(timeout=deadline))
            assert await eventually(lambda: rig.sender.version == 1, within=CONNECT)
            if kind.name != "dist":  # (there worker 1 waits for the group worker 0 holds up)
                # Worker 1's switch waits for the guard, held past the deadline: its timeout
                # is certain before worker 0 is lost.
                assert await eventually(lambda: switch_waits(r1), within=CONNECT)
            await rig.leave(0)
            with pytest.raises(aiowsync.WeightSyncTimeout) as info:
                await send
        assert type(info.value) is aiowsync.WeightSyncTimeout
        assert info.value.worker_ids == (1,)
        assert info.value.version == 1 and info.value.acked == (2,)


async def test_a_loss_outranks_a_failed_apply(kind: Kind) -> None:
    """docs/failures.md: without a late worker, a loss during the send raises
    LostDuringSendError, even beside a worker that failed to apply; a failure alone raises
    RemoteApplyError."""
    async with kind.system(3, each={1: {"background": False}}) as rig:
        rig[0][0].register_hook(failing_hook)
        send = asyncio.create_task(rig.sender.send(timeout=CONNECT))
        assert await eventually(lambda: rig.sender.version == 1, within=CONNECT)
        await rig.leave(1)
        with pytest.raises(aiowsync.LostDuringSendError) as lost:
            await send
        assert lost.value.worker_ids == (1,)
        assert lost.value.version == 1 and lost.value.acked == (2,)
        with pytest.raises(aiowsync.RemoteApplyError) as nacked:
            await rig.sender.send(worker_ids=[0, 2])
        assert nacked.value.worker_ids == (0,) and nacked.value.acked == (2,)
        assert nacked.value.errors == {0: "RuntimeError: no room for the kv cache"}


# -- cancellation -----------------------------------------------------------------------------


async def test_a_send_cancelled_while_staging_uses_no_version_and_breaks_nothing(
    kind: Kind,
) -> None:
    if kind.name == "dist":
        pytest.skip(
            "the distributed plane stages without suspending (it packs during the transfer)"
        )
    # Staged in a thread, which the cancellation waits for; nothing is announced.
    plane = kind.plane(inline_bytes=0, bucket_bytes=1 << 20)
    async with kind.system(2, make=big_model, plane=plane) as rig:
        kept = [frozen(m) for _, m in rig.receivers]
        fill(rig.src, 1.0)
        send = asyncio.create_task(rig.sender.send())
        await asyncio.sleep(0)  # it reaches the copy, in a thread
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        assert rig.sender.version == 0
        assert rig.versions() == [0, 0]
        assert all(same(m, k) for (_, m), k in zip(rig.receivers, kept, strict=True))
        fill(rig.src, 2.0)
        result = await rig.sender.send()
        assert result.version == 1 and all(values(m) == {2.0} for _, m in rig.receivers)


async def test_a_send_cancelled_while_waiting_for_acks_breaks_nothing(kind: Kind) -> None:
    async with kind.system(2) as rig:
        gate = asyncio.Event()

        async def slow(version: int) -> None:
            await gate.wait()

        rig[0][0].register_hook(slow)
        fill(rig.src, 1.0)
        send = asyncio.create_task(rig.sender.send())
        assert await eventually(lambda: rig[1][0].version == 1, within=CONNECT)
        send.cancel()
        with pytest.raises(asyncio.CancelledError):
            await send
        assert rig.sender.version == 1  # announced: the version is used and still lands
        gate.set()
        rig[0][0]._hooks.clear()
        assert await rig[0][0].wait_for_version(1, timeout=CONNECT) == 1
        fill(rig.src, 2.0)
        result = await rig.sender.send()
        assert result.version == 2 and result.worker_ids == (0, 1)
        assert all(values(m) == {2.0} for _, m in rig.receivers)
