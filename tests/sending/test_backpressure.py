"""A trainer that publishes ahead of a lagging worker: the worker is sent the newest version
once it catches up (the ones between are superseded for it), so its slots do not run out and
the trainer does not wait; and when every slot is in use all the same, a send waits for one."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

import aiowsync
from _workers import connect_all, digest, make_model, randomize, workers
from aiowsync._sending.peers import LAG_IN_FLIGHT
from helpers import Kind, fill, values

pytestmark = pytest.mark.timeout(120)

PUBLISHED = 20


@pytest.mark.parametrize("name", ["memory", "shm"])
async def test_a_lagging_worker_is_sent_the_newest_version_and_the_trainer_never_waits(
    name: str,
) -> None:
    kind = Kind(name)
    # Worker 1 pulls: nothing is applied until it calls receive(), as a blocked loop would.
    async with kind.system(2, each={1: {"background": False}}) as rig:
        lagging, lagging_model = rig[1]
        pendings = []
        for v in range(1, PUBLISHED + 1):
            fill(rig.src, float(v))
            pendings.append(await rig.sender.publish(timeout=60))
        assert not any(p.done() for p in pendings)  # each waits for worker 1 too
        # Announced: the versions up to the lag; the rest wait, the newest for it.
        assert rig.sender.workers[1].in_flight == LAG_IN_FLIGHT
        applied = []
        while lagging.version < PUBLISHED:
            got = await lagging.receive(timeout=20)
            assert got is not None
            applied.append(got)
        # The versions announced before it lagged, in order, then the newest one at once.
        assert applied == [*range(1, LAG_IN_FLIGHT + 1), PUBLISHED]
        assert values(lagging_model) == {float(PUBLISHED)}
        results = [await p.wait(60) for p in pendings]
        # Worker 0 keeps up, or lags a little behind a trainer that publishes in a tight loop
        # and is then superseded too; every version reaches each worker or is passed over.
        for r in results:
            assert sorted(r.worker_ids + r.superseded) == [0, 1], r
        assert all(1 in r.worker_ids for r in results[:LAG_IN_FLIGHT])
        assert all(r.superseded[-1:] == (1,) for r in results[LAG_IN_FLIGHT:-1])
        assert (results[-1].worker_ids, results[-1].superseded) == ((0, 1), ())
        assert rig.versions() == [PUBLISHED, PUBLISHED]
        # Nothing of the skipped versions is pinned for it any more: sends go on as before.
        fill(rig.src, 99.0)
        sending = asyncio.create_task(rig.sender.send(timeout=60))
        assert await lagging.receive(timeout=20) == PUBLISHED + 1
        assert (await sending).worker_ids == (0, 1)
        assert values(lagging_model) == {99.0}


@pytest.mark.parametrize("name", ["memory", "shm"])
async def test_publish_with_every_slot_in_flight_waits_for_the_oldest_and_warns(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With fewer slots than the lag that defers, the slots do run out: the trainer waits
    for the oldest to be released instead of failing, and says who holds it."""
    kind = Kind(name)
    plane = (
        aiowsync.MemoryPlane(num_slots=2, max_slots=3)
        if name == "memory"
        else aiowsync.SharedMemPlane(num_slots=2, max_slots=3)
    )
    caplog.set_level("WARNING", logger="aiowsync.sender")
    async with kind.system(2, plane=plane, each={1: {"background": False}}) as rig:
        lagging, _ = rig[1]
        fill(rig.src, 1.0)
        first = await rig.sender.publish(timeout=60)
        fill(rig.src, 2.0)
        second = await rig.sender.publish(timeout=60)  # slots: 0 (worker 1), 1, 2
        fill(rig.src, 3.0)
        began = time.monotonic()
        third = asyncio.create_task(rig.sender.publish(timeout=60))
        while "no slot is free for version 3" not in caplog.text:
            assert time.monotonic() - began < 30
            await asyncio.sleep(0.01)
        assert not third.done()
        assert await lagging.receive(timeout=20) == 1  # version 0's slot is free
        pending = await asyncio.wait_for(third, 30)
        while lagging.version < 3:
            await lagging.receive(timeout=20)
        assert [(await p.wait(30)).version for p in (first, second, pending)] == [1, 2, 3]
        (warning,) = [m for m in caplog.messages if m.startswith("no slot is free")]
        assert warning.startswith(
            "no slot is free for version 3: every slot holds a version still in use [0, 1, 2]; "
            "waiting up to "
        )
        # Worker 0 may not have answered version 1 yet either, on a busy host.
        assert "for the oldest, 0, to be released (" in warning
        assert warning.endswith("worker 1 runs it)"), warning


PUBLISH_STEPS = 40
BLOCKED_S = 5.0


async def test_publish_40_versions_past_a_worker_whose_loop_is_blocked_for_5_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real processes over shared memory, as the trainer of an async RL loop runs them: a
    step of training, then ``publish()``. Worker 3's loop blocks for 5 s in its hook of
    version 2. The trainer never waits for it, the others apply every version, worker 3
    ends on the newest, and the sender says who held version 2's answers up and why."""
    scheme = aiowsync.SharedMemWeightSyncScheme()
    model = make_model("small")
    scheme.init_on_sender(model=model, num_workers=4)
    caplog.set_level("WARNING", logger="aiowsync.sender")
    async with scheme:
        with workers() as w:
            for i in range(4):
                extra = {"block": (2, BLOCKED_S)} if i == 3 else {}
                w.start(i, "small", scheme=scheme, **extra)
            await connect_all(scheme, w, 4)
            expected = {0: digest(model)}
            calls, pendings = [], []
            for v in range(1, PUBLISH_STEPS + 1):
                await asyncio.sleep(0.15)  # the training step
                randomize(model, v)
                expected[v] = digest(model)
                began = time.perf_counter()
                pendings.append(await scheme.publish())  # ack deadline: 30 s
                calls.append(time.perf_counter() - began)
            results = [await p.wait(60) for p in pendings]
            applied: dict[int, list[int]] = {i: [] for i in range(4)}
            deadline = time.monotonic() + 60
            while any(not got or got[-1] != PUBLISH_STEPS for got in applied.values()):
                left = deadline - time.monotonic()
                assert left > 0, applied
                _, worker, version, held = await asyncio.to_thread(w.next_event, left)
                assert held == expected[version], (worker, version)  # the trainer's bytes
                applied[worker].append(version)
    ms = sorted(c * 1e3 for c in calls)
    print(f"publish() calls: longest {ms[-1]:.1f} ms, median {ms[len(ms) // 2]:.1f} ms")
    print(f"worker 3 applied {applied[3]}")
    print(*[m for m in caplog.messages if "waits on" in m], sep="\n")
    # The trainer went on at its own pace: no call waited for the blocked worker.
    assert max(calls) < BLOCKED_S / 2
    assert [r.version for r in results] == list(range(1, PUBLISH_STEPS + 1))
    assert all(3 in r.worker_ids + r.superseded for r in results)
    assert sum(3 in r.superseded for r in results) > 0
    # Worker 3 took the versions announced before it lagged, then the newest at once.
    # Worker 3 took the versions announced before it lagged, jumped to the newest once it
    # answered them, and then took each version as it came.
    got = applied[3]
    gaps = [(a, b) for a, b in itertools.pairwise(got) if b != a + 1]
    assert got[0] == 1 and got[-1] == PUBLISH_STEPS and len(gaps) == 1, got
    assert gaps[0][0] <= 2 + LAG_IN_FLIGHT, got
    assert all(applied[i] == list(range(1, PUBLISH_STEPS + 1)) for i in range(3))
    # A warning for the stall, naming the worker and what it was doing. (On a busy machine
    # its answer to version 1 can come after that warning, and a later version warns again.)
    held, *again = [m for m in caplog.messages if "waits on" in m]
    assert held.startswith("version 2 waits on 1 worker(s) after 3.0 s of its 30.0 s: worker 3: ")
    assert "its event loop has not run for " in held and ", applying version 2 " in held
    assert all("waits on 1 worker(s)" in m and "worker 3: its event loop" in m for m in again)
