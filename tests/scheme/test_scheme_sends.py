"""What a user of a scheme sees on every data plane (1 of 3): connect, sends, sends to a subset,
reads that never mix two versions, and hooks.

Each test runs once per kind of plane (the ``kind`` fixture of conftest.py):

- ``memory``: the in-process twins (``MemoryPlane`` + ``MemoryChannelFactory``), milliseconds
  per test;
- ``shm``: real ``/dev/shm`` slots (``SharedMemPlane``) over ZeroMQ;
- ``dist``: real gloo groups (``DistributedPlane``) over ZeroMQ on loopback TCP.

Sender and receivers share this process and its event loop. The tests assert what a user can
see: the bytes each receiver's model holds against the sender's, versions, the exact error and
the workers it names, ``acked`` and ``version`` on errors. Deadlines are seconds, never tight:
the host may be busy.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from tensordict import TensorDict
from torch import nn

import aiowsync
from helpers import (
    CONNECT,
    Kind,
    eventually,
    fill,
    frozen,
    held,
    model,
    nbytes_of,
    same,
    tensors,
    values,
)

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.usefixtures("no_leaked_threads", "no_leaked_tasks"),
]


# -- connect ----------------------------------------------------------------------------------


async def test_connect_gives_every_receiver_version_0_with_the_senders_bytes(kind: Kind) -> None:
    async with kind.system(3) as rig:
        assert rig.sender.version == 0
        for r, m in rig.receivers:
            assert r.version == 0 and r.ready and r.connected
            assert same(m, rig.src)


async def test_a_receiver_whose_model_differs_is_refused_and_the_sender_names_it(
    kind: Kind,
) -> None:
    src = model(0)
    sender = kind.scheme()
    sender.init_on_sender(model=src, num_workers=3)
    wider = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 4))
    doubled = model(1).double()
    async with sender:
        good = kind.scheme(sender.address, plane=sender.plane)
        mirror = model(2)
        good.init_on_receiver(model=mirror, worker_idx=0)
        async with good:
            await good.connect(timeout=CONNECT)
            for idx, wrong, expected in (
                (1, wider, ["0.weight", "float32[32, 16]", "float32[33, 16]", "2.weight"]),
                (2, doubled, ["0.weight", "float32[32, 16]", "float64[32, 16]"]),
            ):
                before = frozen(wrong)
                r = kind.scheme(sender.address, plane=sender.plane)
                r.init_on_receiver(model=wrong, worker_idx=idx)
                async with r:
                    with pytest.raises(aiowsync.RefusedError) as info:
                        await r.connect(timeout=CONNECT)
                    assert all(text in info.value.reason for text in expected), info.value.reason
                    assert same(wrong, before) and r.version == -1 and not r.ready
            with pytest.raises(aiowsync.WeightSyncTimeout) as timeout:
                await sender.connect(timeout=kind.late)
            assert timeout.value.worker_ids == (1, 2)
            with pytest.raises(aiowsync.WorkerLostError) as lost:
                await sender.send()
            assert lost.value.worker_ids == (1, 2) and lost.value.version is None
            assert sender.version == 0
            result = await sender.send(worker_ids=[0])
            assert result.version == 1 and good.version == 1 and same(mirror, src)


# -- send ---------------------------------------------------------------------------------------


async def test_each_send_raises_the_version_by_one_on_every_receiver(kind: Kind) -> None:
    async with kind.system(3) as rig:
        for version in range(1, 4):
            fill(rig.src, float(version))
            result = await rig.sender.send()
            assert isinstance(result, aiowsync.SendResult)
            assert result.version == version == rig.sender.version
            assert result.worker_ids == (0, 1, 2)
            assert result.nbytes >= nbytes_of(rig.src)
            assert 0 <= result.stage_seconds <= result.seconds
            assert rig.versions() == [version] * 3
            assert all(same(m, rig.src) for _, m in rig.receivers)


async def test_send_of_given_weights_sends_those_and_not_the_model(kind: Kind) -> None:
    async with kind.system(2) as rig:
        before = frozen(rig.src)
        other = model(7)
        result = await rig.sender.send(weights=TensorDict.from_module(other))
        assert result.version == 1
        assert all(same(m, other) for _, m in rig.receivers)
        third = model(8)
        result = await rig.sender.send(weights=third.state_dict())
        assert result.version == 2
        assert all(same(m, third) for _, m in rig.receivers)
        assert same(rig.src, before)  # the sender's own model is only read, never written
        result = await rig.sender.send()
        assert result.version == 3 and all(same(m, rig.src) for _, m in rig.receivers)


async def test_weights_that_do_not_fit_the_layout_are_refused_and_use_no_version(
    kind: Kind,
) -> None:
    async with kind.system(2) as rig:
        bad_shape = dict(rig.src.state_dict(), **{"0.weight": torch.zeros(32, 17)})
        missing = {k: v for k, v in rig.src.state_dict().items() if k != "2.bias"}
        bad_dtype = dict(rig.src.state_dict(), **{"0.bias": torch.zeros(32, dtype=torch.float64)})
        fill(rig.src, 5.0)
        for weights, key in ((bad_shape, "0.weight"), (missing, "2.bias"), (bad_dtype, "0.bias")):
            with pytest.raises(aiowsync.LayoutMismatchError) as info:
                await rig.sender.send(weights=weights)
            assert any(line.startswith(key) for line in info.value.differences)
            assert info.value.version is None and info.value.acked == ()
            assert rig.sender.version == 0 and rig.versions() == [0, 0]
            assert all(values(m) != {5.0} for _, m in rig.receivers)
        result = await rig.sender.send()
        assert result.version == 1 and all(same(m, rig.src) for _, m in rig.receivers)


# -- subsets ----------------------------------------------------------------------------------


async def test_a_send_to_a_subset_moves_only_those_workers(kind: Kind) -> None:
    async with kind.system(3) as rig:
        kept = [frozen(m) for _, m in rig.receivers]
        fill(rig.src, 1.0)
        result = await rig.sender.send(worker_ids=[1])
        assert result.version == 1 and result.worker_ids == (1,)
        assert rig.versions() == [0, 1, 0]
        assert same(rig[1][1], rig.src)
        assert same(rig[0][1], kept[0]) and same(rig[2][1], kept[2])
        fill(rig.src, 2.0)
        result = await rig.sender.send(worker_ids=2)
        assert result.worker_ids == (2,) and rig.versions() == [0, 1, 2]
        assert values(rig[1][1]) == {1.0} and values(rig[2][1]) == {2.0}
        with pytest.raises(ValueError):
            await rig.sender.send(worker_ids=[3])
        with pytest.raises(ValueError):
            await rig.sender.send(worker_ids=[1, 1])
        assert rig.sender.version == 2


async def test_a_lagging_worker_keeps_its_version_intact_while_others_move_on(
    kind: Kind,
) -> None:
    """The tear test that can see lag: the slot a lagging worker reads is never rewritten,
    however many versions go to the others meanwhile."""
    async with kind.system(3) as rig:
        fill(rig.src, 1.0)
        await rig.sender.send()
        lagging = rig[0][1]
        for version in range(2, 12):
            fill(rig.src, float(version))
            targets = [[1], [2], [1, 2]][version % 3]
            result = await rig.sender.send(worker_ids=targets)
            assert result.version == version and result.worker_ids == tuple(targets)
            assert rig[0][0].version == 1 and values(lagging) == {1.0}
            for w in targets:
                assert rig[w][0].version == version and values(rig[w][1]) == {float(version)}
        fill(rig.src, 99.0)
        result = await rig.sender.send()
        assert result.version == 12 and rig.versions() == [12] * 3
        assert all(values(m) == {99.0} for _, m in rig.receivers)


# -- tear-free --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["swap", "copy"])
async def test_no_reader_ever_sees_two_versions_at_once(kind: Kind, mode: str) -> None:
    sends = 30
    async with kind.system(2, apply_mode=mode) as rig:
        fill(rig.src, 1.0)
        await rig.sender.send()  # every model is now one value, the version's number
        stop = threading.Event()
        mixed: list[str] = []
        seen: list[set[float]] = [set(), set()]

        def check(r: aiowsync.WeightSyncScheme, parts: list[torch.Tensor], who: str) -> float:
            found = set(torch.cat([t.reshape(-1) for t in parts]).unique().tolist())
            if len(found) != 1 or found != {float(r.version)}:
                mixed.append(f"{who}: values {sorted(found)} at version {r.version}")
            return min(found)

        async def loop_reader(i: int) -> None:
            r, m = rig[i]
            while not stop.is_set():
                # Across an await, only the guard keeps the version: half, a pause, the rest.
                async with r.read_guard():
                    parts = tensors(m)
                    first = [t.clone() for t in parts[:2]]
                    await asyncio.sleep(0)
                    seen[i].add(check(r, first + [t.clone() for t in tensors(m)[2:]], "loop"))
                await asyncio.sleep(0.001)

        def thread_reader(i: int) -> None:
            r, m = rig[i]
            while not stop.is_set():
                with r.read_guard():
                    seen[i].add(check(r, tensors(m), "thread"))
                time.sleep(0.001)

        readers = [asyncio.create_task(loop_reader(i)) for i in range(2)]
        threads = [threading.Thread(target=thread_reader, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        try:
            for version in range(2, sends + 2):
                fill(rig.src, float(version))
                result = await rig.sender.send()
                assert result.version == version and result.worker_ids == (0, 1)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=10)
            await asyncio.gather(*readers)
        assert not mixed, mixed[:5]
        assert all(len(s) > 1 for s in seen), "the readers saw only one version"
        assert all(values(m) == {float(sends + 1)} for _, m in rig.receivers)


# -- hooks ------------------------------------------------------------------------------------


# Digests on and off: computing a digest reads the whole version, which would seal it anyway
# and hide a publish() that returns before the version is its own.
@pytest.mark.parametrize("integrity", [False, True], ids=["no-digest", "digest"])
async def test_publish_frees_the_weights_once_staged_and_gives_the_outcome_later(
    kind: Kind, integrity: bool
) -> None:
    async with kind.system(2, sender_kw={"integrity": integrity}) as rig:
        fill(rig.src, 1.0)
        pending = await rig.sender.publish()
        assert pending.version == 1 and rig.sender.version == 1
        fill(rig.src, 9.0)  # the trainer's next step, at once: version 1 must not see it
        result = await pending
        assert result.version == 1 and result.worker_ids == (0, 1)
        assert result.retries == 0  # the first attempt delivered it
        assert pending.done() and await pending is result  # awaited again: the same outcome
        assert all(values(m) == {1.0} for _, m in rig.receivers)
        # Two in flight keep their order; each carries what the trainer held when published.
        fill(rig.src, 2.0)
        second = await rig.sender.publish()
        fill(rig.src, 3.0)
        third = await rig.sender.publish()
        fill(rig.src, 4.0)
        assert (await third).version == 3 and (await second).version == 2
        assert rig.versions() == [3, 3] and all(values(m) == {3.0} for _, m in rig.receivers)


async def test_in_flight_names_the_newest_version_a_worker_has_not_answered(kind: Kind) -> None:
    if kind.name == "dist":
        pytest.skip(
            "on the distributed plane worker 1 takes no second version while the first "
            "waits to switch: two are never in flight to it"
        )
    async with kind.system(2) as rig:
        r1, _ = rig[1]
        with held(r1.read_guard()):  # worker 1 cannot switch: both versions stay in flight
            first = await rig.sender.publish()
            second = await rig.sender.publish()
            assert await eventually(lambda: rig.sender.workers[0].version == 2, within=CONNECT)
            assert rig.sender.workers[0].in_flight is None
            status = rig.sender.workers[1]
            assert (status.version, status.in_flight) == (0, 2)
        assert (await first).version == 1 and (await second).version == 2
        status = rig.sender.workers[1]
        assert (status.version, status.in_flight) == (2, None)


async def test_a_published_version_that_fails_raises_when_awaited_naming_the_worker(
    kind: Kind,
) -> None:
    async with kind.system(2) as rig:
        r1, m1 = rig[1]
        fill(rig.src, 1.0)
        with held(r1.read_guard()):
            pending = await rig.sender.publish(timeout=kind.late)
            fill(rig.src, 2.0)
            # Not known yet: a bounded look says so and leaves the send going.
            with pytest.raises(TimeoutError) as early:
                await pending.wait(timeout=0.05)
            assert not isinstance(early.value, aiowsync.WeightSyncError) and not pending.done()
            with pytest.raises(aiowsync.WeightSyncTimeout) as info:
                await pending
            assert info.value.worker_ids == (1,) and info.value.acked == (0,)
            assert str(info.value) == "version 1 was not acknowledged in time (workers [1])"
        assert values(rig[0][1]) == {1.0}
        assert await r1.wait_for_version(1, timeout=CONNECT) == 1 and values(m1) == {1.0}
        # Before anything is staged, publish() itself raises (here: a worker that is lost).
        await rig.leave(1)
        assert await eventually(lambda: rig.sender.workers[1].state == "gone", within=CONNECT)
        with pytest.raises(aiowsync.WorkerLostError):
            await rig.sender.publish()
        assert rig.sender.version == 1


async def test_sync_and_async_hooks_run_once_per_switch_with_its_version(kind: Kind) -> None:
    async with kind.system(2) as rig:
        calls: list[list[tuple[str, int]]] = [[], []]
        for i, (r, m) in enumerate(rig.receivers):

            def sync_hook(version: int, i: int = i, m: nn.Module = m) -> None:
                # A hook runs after the switch: the model already holds the new version.
                assert values(m) == {float(version)}
                calls[i].append(("sync", version))

            async def async_hook(version: int, i: int = i) -> None:
                await asyncio.sleep(0)
                calls[i].append(("async", version))

            r.register_hook(sync_hook)
            r.register_hook(async_hook)
        for version in (1, 2):
            fill(rig.src, float(version))
            await rig.sender.send()
        fill(rig.src, 3.0)
        await rig.sender.send(worker_ids=[1])
        twice = [("sync", 1), ("async", 1), ("sync", 2), ("async", 2)]
        assert calls == [twice, [*twice, ("sync", 3), ("async", 3)]]


async def test_a_failing_hook_fails_the_send_naming_the_worker_and_its_error(kind: Kind) -> None:
    async with kind.system(3) as rig:

        def broken(version: int) -> None:
            raise RuntimeError(f"cache reset failed at {version}")

        rig[1][0].register_hook(broken)
        fill(rig.src, 1.0)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await rig.sender.send()
        assert info.value.errors == {1: "RuntimeError: cache reset failed at 1"}
        assert info.value.worker_ids == (1,)
        assert info.value.version == 1 and info.value.acked == (0, 2)
        # Hooks run after the switch: the failing worker runs the version too.
        assert rig.versions() == [1, 1, 1] and all(values(m) == {1.0} for _, m in rig.receivers)
        rig[1][0]._hooks.clear()
        fill(rig.src, 2.0)
        result = await rig.sender.send()
        assert result.version == 2 and result.worker_ids == (0, 1, 2)
