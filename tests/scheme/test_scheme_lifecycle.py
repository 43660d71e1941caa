"""What a user of a scheme sees on every data plane (3 of 3): pull mode, waiting, concurrent
sends, the sender's end and after, the documented behaviours (context, model ids, slots, hooks,
readiness), and reads while workers lag.

Same rig as test_scheme_sends.py: one suite over each kind of plane, in this process.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from typing import Any

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import aiowsync
from helpers import (
    CONNECT,
    Kind,
    System,
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


HELD_UP = (
    "dist: a pull-mode worker that has not called receive() holds up the transfer to every "
    "other member of the send (the group waits for it to join, up to its forming limit), so "
    "the other members get the version only once it pulls, or after that limit"
)
"""Why some tests fail on the distributed plane: its documented limit (docs/distributed.md)."""


def fails_on_dist(kind: Kind, request: pytest.FixtureRequest, reason: str) -> None:
    if kind.name == "dist":
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))


# -- pull mode, waiting, concurrent sends -----------------------------------------------------


async def test_pull_mode_applies_an_update_only_inside_receive(kind: Kind) -> None:
    async with kind.system(2, each={0: {"background": False}}) as rig:
        puller, pm = rig[0]
        assert await puller.receive(timeout=0.2) is None  # nothing sent: None, no error
        for version in (1, 2):
            fill(rig.src, float(version))
            result, got = await asyncio.gather(rig.sender.send(), puller.receive(timeout=CONNECT))
            assert result.version == got == version and result.worker_ids == (0, 1)
            assert values(pm) == {float(version)}
        fill(rig.src, 3.0)
        send = asyncio.create_task(rig.sender.send(worker_ids=[0]))
        await asyncio.sleep(0.2)
        assert puller.version == 2 and values(pm) == {2.0}  # it waits for receive()
        assert await puller.receive(timeout=CONNECT) == 3
        assert (await send).worker_ids == (0,) and values(pm) == {3.0}
        with pytest.raises(RuntimeError):
            await rig[1][0].receive(timeout=0.1)  # a background receiver does not pull


async def test_a_worker_that_has_not_pulled_holds_up_no_other(
    kind: Kind, request: pytest.FixtureRequest
) -> None:
    fails_on_dist(kind, request, HELD_UP)
    async with kind.system(2, each={0: {"background": False}}) as rig:
        puller, pm = rig[0]
        fill(rig.src, 1.0)
        send = asyncio.create_task(rig.sender.send(timeout=CONNECT))
        try:
            assert await rig[1][0].wait_for_version(1, timeout=2 * kind.late) == 1
            assert puller.version == 0
        finally:
            assert await puller.receive(timeout=CONNECT) == 1
            assert (await send).worker_ids == (0, 1) and values(pm) == {1.0}


async def test_wait_for_version_returns_once_it_runs_and_times_out_clearly(kind: Kind) -> None:
    async with kind.system(1) as rig:
        r = rig[0][0]
        assert await r.wait_for_version(0, timeout=CONNECT) == 0
        with pytest.raises(aiowsync.WeightSyncTimeout, match="still runs version 0, not 1") as info:
            await r.wait_for_version(1, timeout=0.2)
        assert info.value.worker_ids == ()
        waiter = asyncio.create_task(r.wait_for_version(2, timeout=CONNECT))
        for _ in range(3):
            await rig.sender.send()
        assert await waiter in (2, 3)


async def test_concurrent_sends_are_served_in_call_order(kind: Kind) -> None:
    async with kind.system(2) as rig:
        finished: list[int] = []

        async def send(value: float) -> aiowsync.SendResult:
            weights = TensorDict.from_module(rig.src).clone()
            weights.apply_(lambda t: t.fill_(value))
            result = await rig.sender.send(weights=weights)
            finished.append(result.version)
            return result

        results = await asyncio.gather(*(send(float(i)) for i in range(1, 7)))
        assert [r.version for r in results] == [1, 2, 3, 4, 5, 6]
        assert finished == sorted(finished)
        assert all(values(m) == {6.0} for _, m in rig.receivers)


# -- the sender's end, and after ----------------------------------------------------------------


async def test_receivers_keep_the_last_version_when_the_sender_shuts_down(kind: Kind) -> None:
    async with kind.system(2) as rig:
        fill(rig.src, 1.0)
        await rig.sender.send()
        fill(rig.src, 2.0)
        await rig.sender.send(worker_ids=[1])
        await rig.stop_sender()
        receivers = [r for r, _ in rig.receivers]
        mirrors = [m for _, m in rig.receivers]
        assert await eventually(lambda: not any(r.connected for r in receivers), CONNECT)
        assert not any(r.ready for r in receivers)
        assert [r.version for r in receivers] == [1, 2]
        assert values(mirrors[0]) == {1.0} and values(mirrors[1]) == {2.0}
        # The end of the sender is an event: a wait for a newer version raises at once (not at
        # its deadline), saying so and naming the version the worker keeps.
        started = time.monotonic()
        with pytest.raises(aiowsync.SenderGoneError) as info:
            await receivers[0].wait_for_version(2, timeout=60)
        assert time.monotonic() - started < 30
        assert str(info.value) == (
            "the sender closed (sender shutting down); worker 0 keeps version 1"
        )
        assert info.value.closed and info.value.version == 1
        assert await receivers[1].wait_for_version(2, timeout=60) == 2  # held already
    # Out of their schemes, the models keep valid values, in writable memory of their own.
    assert values(mirrors[0]) == {1.0} and values(mirrors[1]) == {2.0}
    with torch.no_grad():
        mirrors[0][0].weight.add_(1.0)
    assert values(mirrors[0]) == {1.0, 2.0} and values(mirrors[1]) == {2.0}


async def test_a_sender_leaving_while_a_send_waits_names_the_workers_not_yet_answered(
    kind: Kind, request: pytest.FixtureRequest
) -> None:
    async with kind.system(2) as rig:
        r1, m1 = rig[1]
        before = frozen(m1)
        fill(rig.src, 1.0)
        with held(r1.read_guard()):
            send = asyncio.create_task(rig.sender.send(timeout=CONNECT))
            assert await eventually(lambda: rig[0][0].version == 1, within=CONNECT)
            assert await eventually(lambda: switch_waits(r1), within=CONNECT)
            await rig.stop_sender()
            with pytest.raises(aiowsync.LostDuringSendError) as info:
                await send
        assert info.value.worker_ids == (1,)
        assert info.value.version == 1 and info.value.acked == (0,)
        assert values(rig[0][1]) == {1.0}
        # Released, worker 1 either switches to the version it had fetched or stays: never a mix.
        assert await eventually(lambda: not r1.read_guard()._idle_waiters, within=CONNECT)
        assert (r1.version == 1 and values(m1) == {1.0}) or (r1.version == 0 and same(m1, before))


async def test_a_connect_still_waiting_when_its_scheme_closes_ends_and_leaves_nothing(
    tmp_path: Any,
) -> None:
    # Before: a worker's connect() outlived its `async with` (Ctrl-C in a blocking facade,
    # a task left running), joined a trainer started later and kept beating, counted ready
    # by it for ever; a trainer's connect() waited out its whole timeout after its close.
    address = f"ipc://{tmp_path}/control"
    worker = aiowsync.SharedMemWeightSyncScheme(address=address)
    worker.init_on_receiver(model=model(1), worker_idx=0)
    async with worker:  # no trainer there yet: the handshake waits
        pending = asyncio.create_task(worker.connect(timeout=60))
        await asyncio.sleep(0.2)
    with pytest.raises(aiowsync.NotConnectedError, match="ended while connect"):
        await asyncio.wait_for(pending, CONNECT)
    assert not worker.connected
    sender = aiowsync.SharedMemWeightSyncScheme(bind=address)
    sender.init_on_sender(model=model(0), num_workers=1)
    async with sender:
        trainer = asyncio.create_task(sender.connect(timeout=60))
        await asyncio.sleep(1.0)  # a worker left beating would have joined by now
        assert sender.workers[0].state == "never connected"
    with pytest.raises(aiowsync.NotConnectedError, match="sender closed while connect"):
        await asyncio.wait_for(trainer, CONNECT)


async def test_a_receiver_built_from_the_pickled_sender_works(kind: Kind) -> None:
    src = model(0)
    sender = kind.scheme()
    sender.init_on_sender(model=src, num_workers=1)
    r = pickle.loads(pickle.dumps(sender))
    assert r.address == sender.address and r.plane == sender.plane
    if kind.name == "memory":
        assert r.channels is sender.channels  # the in-process factory comes back as itself
    mirror = model(1)
    r.init_on_receiver(model=mirror, worker_idx=0)
    async with sender, r:
        await asyncio.gather(sender.connect(timeout=CONNECT), r.connect(timeout=CONNECT))
        assert same(mirror, src)
        fill(src, 3.0)
        assert (await sender.send()).version == 1 and values(mirror) == {3.0}


# -- documented behaviours: context, model ids, slots, hooks, readiness -----------------------


class _Trainer:
    """A seed-style context: ``get_model`` and the worker count."""

    num_workers = 2

    def __init__(self, m: nn.Module) -> None:
        self.m = m
        self.asked: list[str] = []

    def get_model(self, model_id: str) -> nn.Module:
        self.asked.append(model_id)
        return self.m


class _Rollout:
    """A context the receiver walks by attribute path: ``agents.0.policy``."""

    def __init__(self, m: nn.Module) -> None:
        self.agents = [nn.ModuleDict({"policy": m})]


async def test_a_context_gives_the_model_and_the_worker_count(kind: Kind) -> None:
    src = model(0)
    trainer = _Trainer(src)
    sender = kind.scheme(model_id="agents.0.policy")
    sender.init_on_sender(context=trainer)
    assert trainer.asked == ["agents.0.policy"]
    rig = System(sender, src)
    try:
        await rig.enter(sender)
        mirrors = [model(1), model(2)]
        for i, m in enumerate(mirrors):
            r = kind.scheme(sender.address, plane=sender.plane, model_id="agents.0.policy")
            r.init_on_receiver(context=_Rollout(m), worker_idx=i)
            await rig.enter(r)
            rig.receivers.append((r, m))
        await asyncio.gather(
            sender.connect(timeout=CONNECT), *(r.connect(timeout=CONNECT) for r, _ in rig)
        )
        fill(src, 3.0)
        result = await sender.send()
        assert result.worker_ids == (0, 1)  # two workers: the context's count
        assert all(values(m) == {3.0} for m in mirrors)
        # send(weights=<model id>) resolves through the context too.
        fill(src, 4.0)
        assert (await sender.send(weights="agents.0.policy")).version == 2
        assert all(values(m) == {4.0} for m in mirrors)
    finally:
        await rig.close()


async def test_a_receiver_of_another_model_id_is_refused_naming_both(kind: Kind) -> None:
    async with kind.system(1) as rig:
        other = kind.scheme(rig.sender.address, plane=rig.sender.plane, model_id="critic")
        mine = model(3)
        before = frozen(mine)
        other.init_on_receiver(model=mine, worker_idx=0)
        async with other:
            with pytest.raises(aiowsync.RefusedError) as info:
                await other.connect(timeout=CONNECT)
        assert "serves model 'policy', not 'critic'" in info.value.reason
        assert same(mine, before) and other.version == -1
        assert rig[0][0].connected and rig[0][0].version == 0  # the real worker 0 is untouched


async def test_all_slots_pinned_refuses_the_send_before_it_takes_a_version(
    kind: Kind, request: pytest.FixtureRequest
) -> None:
    if kind.name == "dist":
        pytest.skip("receivers of the distributed plane keep their own copies: nothing pins")
    plane = (
        aiowsync.SharedMemPlane(max_slots=2)
        if kind.name == "shm"
        else aiowsync.MemoryPlane(max_slots=2)
    )
    async with kind.system(2, plane=plane) as rig:
        fill(rig.src, 1.0)
        await rig.sender.send()  # slots: v0 (free), v1 (both workers)
        fill(rig.src, 2.0)
        await rig.sender.send(worker_ids=[1])  # v0's slot reused: v2 (worker 1), v1 (worker 0)
        fill(rig.src, 3.0)
        with pytest.raises(aiowsync.WeightSyncError, match=r"all 2 .*slots hold versions") as info:
            await rig.sender.send(worker_ids=[1])
        assert info.value.version is None and rig.sender.version == 2
        assert rig.versions() == [1, 2]
        assert values(rig[0][1]) == {1.0} and values(rig[1][1]) == {2.0}
        # Every send needs a free slot, to any subset; once the lagging worker leaves, its
        # pin goes with it and sends go on.
        with pytest.raises(aiowsync.WeightSyncError, match="until a worker on one of them"):
            await rig.sender.send(worker_ids=[0])
        await rig.leave(0)
        core = rig.sender._sender
        assert core is not None
        assert await eventually(lambda: 0 in core.lost_workers(), within=CONNECT)  # its bye
        result = await rig.sender.send(worker_ids=[1])
        assert result.version == 3 and values(rig[1][1]) == {3.0}


async def test_a_hook_that_outlasts_the_ack_deadline_fails_the_send_after_the_switch(
    kind: Kind,
) -> None:
    slow = aiowsync.Timeouts(handshake=20.0, ack=0.3, transfer=30.0, control=5.0)
    async with kind.system(2, each={1: {"timeouts": slow}}) as rig:
        r1, m1 = rig[1]
        release = asyncio.Event()

        async def stuck(version: int) -> None:
            await release.wait()

        r1.register_hook(stuck)
        fill(rig.src, 1.0)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await rig.sender.send(timeout=CONNECT)
        assert list(info.value.errors) == [1] and "TimeoutError" in info.value.errors[1]
        assert info.value.acked == (0,) and info.value.version == 1
        # The hook ran after the switch: worker 1 runs the version the sender counts as failed.
        assert r1.version == 1 and values(m1) == {1.0}
        r1._hooks.clear()
        release.set()
        fill(rig.src, 2.0)
        assert (await rig.sender.send()).worker_ids == (0, 1)


async def test_ready_is_false_until_connect_and_after_the_sender_leaves(kind: Kind) -> None:
    src = model(0)
    sender = kind.scheme()
    sender.init_on_sender(model=src, num_workers=1)
    rig = System(sender, src)
    try:
        await rig.enter(sender)
        m = model(1)
        r = await rig.add(kind, 0, m, background=False)
        rig.receivers.append((r, m))
        assert not r.ready and r.version == -1  # entered, not yet connected
        await asyncio.gather(sender.connect(timeout=CONNECT), r.connect(timeout=CONNECT))
        assert r.ready and r.connected and r.version == 0
        await rig.stop_sender()
        assert await eventually(lambda: not r.connected, within=CONNECT)
        assert not r.ready
        # Pull mode after the goodbye: receive() raises at once saying so, the weights stay.
        with pytest.raises(aiowsync.SenderGoneError, match="keeps version 0"):
            await r.receive(timeout=60)
        assert r.version == 0 and same(m, src)
    finally:
        await rig.close()


# -- tear-free while workers lag --------------------------------------------------------------


@pytest.mark.parametrize("mode", ["swap", "copy"])
async def test_readers_of_workers_that_lag_never_see_two_versions(kind: Kind, mode: str) -> None:
    """Workers fall behind one another (subset sends, a slow hook, two sends in flight at
    once), so older versions stay in use while newer ones are staged beside them; a reader
    thread on each worker checks, under the read guard, that every value is its version's."""
    async with kind.system(3, apply_mode=mode) as rig:

        async def slow_hook(version: int) -> None:
            await asyncio.sleep(0.02)

        rig[2][0].register_hook(slow_hook)
        keys = list(rig.src.state_dict())

        def weights(value: float) -> dict[str, torch.Tensor]:
            return {k: torch.full_like(t, value) for k, t in rig.src.state_dict().items()}

        await rig.sender.send(weights=weights(1.0))
        stop = threading.Event()
        mixed: list[str] = []
        seen: list[set[int]] = [set(), set(), set()]

        def reader(i: int) -> None:
            r, m = rig[i]
            while not stop.is_set():
                with r.read_guard():
                    version = r.version
                    found = values(m)
                if found != {float(version)}:
                    mixed.append(f"worker {i}: values {sorted(found)} at version {version}")
                seen[i].add(version)
                time.sleep(0.001)

        threads = [threading.Thread(target=reader, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        subsets = [[0], [1, 2], [1], [0, 2], [2], [0, 1]]
        try:
            for step in range(12):
                first = [rig.sender.version + 1, rig.sender.version + 2]
                # Two sends in flight: staged in call order, the second while the first
                # still waits for its acks (worker 2's hook is slow).
                a = asyncio.create_task(
                    rig.sender.send(weights=weights(float(first[0])), worker_ids=subsets[step % 6])
                )
                b = asyncio.create_task(
                    rig.sender.send(
                        weights=weights(float(first[1])), worker_ids=subsets[(step + 1) % 6]
                    )
                )
                results = await asyncio.gather(a, b)
                assert [res.version for res in results] == first
                await asyncio.sleep(0.005)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=10)
        print(f"versions seen per worker: {[len(s) for s in seen]}; mixed reads: {len(mixed)}")
        assert not mixed, mixed[:5]
        assert all(len(s) >= 4 for s in seen), seen
        last = rig.sender.version + 1
        await rig.sender.send(weights=weights(float(last)))
        assert all(values(m) == {float(last)} for _, m in rig.receivers) and keys


def test_a_timed_out_send_also_names_the_workers_lost_during_it() -> None:
    # In a chain, a lost member is often why the members after it did not answer: the error
    # names both, and ``acked`` says who runs the version.
    from aiowsync._sending.outcome import Answers

    answers = Answers(version=4, waiting={0, 1, 2, 3})
    answers.acked.add(0)
    answers.settle(0)
    answers.lost.add(1)
    answers.settle(1)
    with pytest.raises(aiowsync.WeightSyncTimeout) as info:
        answers.result(0, 0.0, 0.0)
    assert not isinstance(info.value, aiowsync.WorkerLostError)
    assert info.value.worker_ids == (2, 3) and info.value.acked == (0,)
    assert str(info.value) == (
        "version 4 was not acknowledged in time, and workers [1] were lost during the send "
        "(workers [2, 3])"
    )
