"""The shared-memory scheme with receivers in this process (1 of 5): refusals, sends of given
weights, timeouts, failed applies, hostile frames, goodbyes, cancellation, misuse and uvloop.

Real ZeroMQ sockets and real /dev/shm slots; receivers share the test's event loop, which keeps
these tests fast. Process deaths are covered in test_shm_multiprocess.py.
"""

from __future__ import annotations

import asyncio
import os
import pickle

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from torch import nn

import aiowsync
from aiowsync._protocol import PROTOCOL_VERSION, Ack, Bye, Heartbeat, Hello, Update, decode, encode
from helpers import SHM_BEATS, bump, model, same, shm_pair, shm_system, slow_writes

pytestmark = pytest.mark.timeout(60)


async def test_scheme_pickles_to_configuration_and_address_only() -> None:
    async with shm_system(1) as (sender, _, receivers):
        state = sender.__getstate__()
        assert state["_address"] == sender.address
        blob = pickle.dumps(sender)
        assert len(blob) < 4096
        clone = pickle.loads(blob)
        assert clone.address == sender.address and clone.version == -1
        assert not clone.initialized_on_sender


async def test_wrong_model_is_refused_naming_the_differences() -> None:
    async with shm_system(1) as (sender, _, _):
        other = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 4))
        bad = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
        bad.init_on_receiver(model=other, worker_idx=0)
        async with bad:
            with pytest.raises(aiowsync.RefusedError) as info:
                await bad.connect(timeout=5)
        text = str(info.value)
        assert "0.weight: expected float32[32, 16], got float32[33, 16]" in text
        assert "2.weight" in text


async def test_a_refusal_lists_fifty_differences_then_counts_the_rest() -> None:
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
    sender.init_on_sender(model=nn.Sequential(*[nn.Linear(2, 2) for _ in range(30)]), num_workers=1)
    async with sender:
        other = nn.Sequential(*[nn.Linear(2, 3) for _ in range(30)])  # all 60 keys differ
        bad = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
        bad.init_on_receiver(model=other, worker_idx=0)
        async with bad:
            with pytest.raises(aiowsync.RefusedError) as info:
                await bad.connect(timeout=5)
    lines = info.value.reason.splitlines()
    assert sum(": expected float32[2" in line for line in lines) == 50
    assert lines[-1].strip() == "... and 10 more"


async def test_a_model_on_the_meta_device_is_refused_on_the_sender_too() -> None:
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    sender = aiowsync.SharedMemWeightSyncScheme()
    with pytest.raises(ValueError, match=r"meta device.*no values to send"):
        sender.init_on_sender(model=meta, num_workers=1)
    with pytest.raises(ValueError, match="meta device"):
        sender.init_on_sender(weights=meta.state_dict(), num_workers=1)
    async with shm_pair(model(0), model(1)) as (live, _):
        with torch.device("meta"):
            twin = model(0)
        with pytest.raises(ValueError, match=r"meta device.*no values to send"):
            await live.send(twin.state_dict(), timeout=5)
        assert (await live.send(timeout=5)).version == 1  # nothing was taken or written


async def test_out_of_range_index_and_second_live_claimant_are_refused() -> None:
    async with shm_system(2) as (sender, _, receivers):
        for idx, needle in ((5, "out of range"), (1, "already connected")):
            intruder = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
            intruder.init_on_receiver(model=model(), worker_idx=idx)
            async with intruder:
                with pytest.raises(aiowsync.RefusedError, match=needle):
                    await intruder.connect(timeout=5)
        # The legitimate workers are undisturbed.
        result = await sender.send(timeout=5)
        assert result.worker_ids == (0, 1)


async def test_bad_weights_are_rejected_before_anything_is_written() -> None:
    async with shm_system(2) as (sender, src, receivers):
        bad = {k: v.clone() for k, v in src.state_dict().items()}
        bad["0.weight"] = torch.zeros(3, 3)
        del bad["2.bias"]
        with pytest.raises(aiowsync.LayoutMismatchError) as info:
            await sender.send(bad)
        assert "0.weight" in str(info.value) and "2.bias" in str(info.value)
        assert sender.version == 0
        assert all(r.version == 0 and same(m, src) for r, m in receivers)
        with pytest.raises(ValueError, match="not in range"):
            await sender.send(worker_ids=[7])


async def test_send_weights_given_explicitly_as_state_dict_and_tensordict() -> None:
    from tensordict import TensorDict

    async with shm_system(2) as (sender, src, receivers):
        new = model(42)
        result = await sender.send(new.state_dict(), timeout=5)
        assert result.version == 1
        assert all(same(m, new) for _, m in receivers)
        newer = model(43)
        result = await sender.send(TensorDict.from_module(newer), timeout=5)
        assert result.version == 2 and all(same(m, newer) for _, m in receivers)


async def test_unacked_send_times_out_naming_the_worker_and_others_commit() -> None:
    async with shm_system(3) as (sender, src, receivers):
        release = asyncio.Event()

        async def slow(version: int) -> None:
            await release.wait()

        receivers[1][0].register_hook(slow)
        bump(src)
        with pytest.raises(aiowsync.WeightSyncTimeout) as info:
            await sender.send(timeout=3.0)
        assert isinstance(info.value, TimeoutError)
        assert info.value.worker_ids == (1,)
        assert info.value.acked == (0, 2) and info.value.version == 1
        assert receivers[0][0].version == 1 and same(receivers[0][1], src)
        assert receivers[2][0].version == 1 and same(receivers[2][1], src)
        release.set()
        assert await receivers[1][0].wait_for_version(1, timeout=5) == 1
        receivers[1][0]._hooks.clear()
        bump(src)
        result = await sender.send(timeout=5)
        assert result.version == 2 and result.worker_ids == (0, 1, 2)


async def test_apply_failure_comes_back_as_a_nack_with_its_text() -> None:
    async with shm_system(2) as (sender, src, receivers):

        def broken(version: int) -> None:
            if version == 1:
                raise RuntimeError(f"kv cache reset failed at {version}")

        receivers[0][0].register_hook(broken)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await sender.send(timeout=5)
        assert info.value.errors == {0: "RuntimeError: kv cache reset failed at 1"}
        assert info.value.acked == (1,)

        def verbose(version: int) -> None:
            raise RuntimeError("\u20ac" * 60000)  # 180 kB in UTF-8

        receivers[0][0].register_hook(verbose)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await sender.send(timeout=5)
        # Cut to fit a message the sender takes (it cut the worker off before).
        text = info.value.errors[0]
        assert text.startswith("RuntimeError: \u20ac\u20ac") and len(text.encode()) <= 60000


async def test_a_worker_whose_hook_keeps_failing_does_not_use_up_the_slots() -> None:
    # Each nack used to keep its version pinned, in case the worker ran it: after max_slots
    # failures in a row no slot was left, and every send, to every worker, failed.
    async with shm_system(2) as (sender, src, receivers):

        def broken(version: int) -> None:
            raise RuntimeError("downstream cache is down")

        failing, healthy = receivers
        failing[0].register_hook(broken)
        core = sender._sender
        assert core is not None
        for version in range(1, 25):
            bump(src)
            with pytest.raises(aiowsync.RemoteApplyError) as info:
                await sender.send(timeout=5)
            assert info.value.version == version and info.value.acked == (1,)
            assert same(healthy[1], src)
        # Its hooks run after the switch: the failing worker runs the latest version too.
        assert failing[0].version == 24 and same(failing[1], src)
        assert len(core.plane._tables[""]) <= 4  # type: ignore[attr-defined]


async def test_hostile_frames_are_dropped_without_disturbing_workers() -> None:
    async with shm_system(2) as (sender, src, receivers):
        ctx = zmq.asyncio.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(sender.address)
        try:
            hostile = [
                [os.urandom(64)],
                [pickle.dumps({"type": "ack", "worker_idx": 0, "version": 1})],
                [b"AW\x01" + b"\x00" * (9 * 1024 * 1024)],
                [b"AW\x01", b"two frames"],
                [encode(Ack(worker_idx=0, version=1))],  # out of state: never said hello
                [encode(Update(version=99))],  # wrong direction
                [b"AW\x01" + msgspec.msgpack.encode({"type": "hello", "worker_idx": -3})],
            ]
            for frames in hostile:
                await raw.send_multipart(frames)
            hello = Hello(
                protocol=PROTOCOL_VERSION, model_id="policy", worker_idx=9, fingerprint="0" * 64
            )
            await raw.send_multipart([encode(hello)])
            refused = await asyncio.wait_for(raw.recv_multipart(), 5)
            assert b"out of range" in refused[0]
            for step in range(1, 4):
                bump(src)
                result = await sender.send(timeout=5)
                assert result.version == step and result.worker_ids == (0, 1)
            assert all(same(m, src) for _, m in receivers)
            assert sender.dropped_messages >= 5
        finally:
            raw.close(0)
            ctx.term()


async def test_beats_for_a_session_never_given_out_get_one_goodbye_each_peer() -> None:
    """What a worker of a previous sender on this address sees: one goodbye per socket, not
    one per beat, and the sender's own workers undisturbed."""
    async with shm_system(2) as (sender, src, receivers):
        ctx = zmq.asyncio.Context()
        strangers = []
        try:
            for _ in range(2):
                raw = ctx.socket(zmq.DEALER)
                raw.setsockopt(zmq.LINGER, 0)
                raw.connect(sender.address)
                strangers.append(raw)
            beat = encode(Heartbeat(worker_idx=0, session="ab" * 16, version=3))
            for _ in range(20):
                for raw in strangers:
                    await raw.send(beat)
                await asyncio.sleep(0.01)
            for raw in strangers:
                told = decode(await asyncio.wait_for(raw.recv(), 5))
                assert isinstance(told, Bye) and "never welcomed" in told.reason
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(raw.recv(), 0.5)  # once, not once per beat
            bump(src)
            result = await sender.send(timeout=5)
            assert result.worker_ids == (0, 1)
            assert all(same(m, src) and r.connected for r, m in receivers)
        finally:
            for raw in strangers:
                raw.close(0)
            ctx.term()


async def test_a_worker_told_goodbye_stops_beating() -> None:
    """Its sender left; the next session on the same address must not hear it beat for good."""
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
    sender.init_on_sender(model=model(0), num_workers=1)
    joined, finish = asyncio.Event(), asyncio.Event()
    seen: list[bool] = []

    async def worker(address: str) -> None:
        r = aiowsync.SharedMemWeightSyncScheme(address=address, heartbeats=SHM_BEATS)
        r.init_on_receiver(model=model(1), worker_idx=0)
        async with r:
            await r.connect(timeout=10)
            joined.set()
            await finish.wait()
            seen.append(r.connected)

    async with sender:
        task = asyncio.create_task(worker(sender.address))
        await asyncio.gather(sender.connect(timeout=10), joined.wait())
    try:
        async with sender:  # a second session on the same address: the worker's sockets reconnect
            # A beat the worker sent before it read the goodbye may still arrive (and is
            # dropped); after that the worker must stay silent: 10 more intervals, no beat.
            await asyncio.sleep(0.5)
            stray = sender.dropped_messages
            await asyncio.sleep(1.0)
            assert stray <= 1 and sender.dropped_messages == stray
    finally:
        finish.set()
        await task
    assert seen == [False]


async def test_cancelled_send_leaves_everything_consistent() -> None:
    async with shm_system(2) as (sender, src, receivers):
        gate = asyncio.Event()

        async def hold(version: int) -> None:
            await gate.wait()

        receivers[0][0].register_hook(hold)
        bump(src)
        task = asyncio.create_task(sender.send(timeout=10))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        receivers[0][0]._hooks.clear()
        # The announced version still lands everywhere; the next send works.
        assert await receivers[0][0].wait_for_version(1, timeout=5) == 1
        bump(src)
        result = await sender.send(timeout=5)
        assert result.version == 2 and result.worker_ids == (0, 1)
        assert all(r.version == 2 and same(m, src) for r, m in receivers)


async def test_cancel_during_staging_keeps_workers_on_the_previous_version() -> None:
    big = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])  # 64 MiB
    mirror = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
    async with shm_pair(big, mirror) as (sender, r):
        before = mirror.state_dict()["0.weight"].clone()
        events = slow_writes(sender, 0.3)  # the cancel surely lands while the copy runs
        bump(big)
        with pytest.raises(asyncio.TimeoutError) as info:
            await asyncio.wait_for(sender.send(timeout=10), 0.05)
        assert not isinstance(info.value, aiowsync.WeightSyncError)  # wait_for's, not send's
        assert events == ["start", "end"]  # the call returned only after the copy
        await asyncio.sleep(0.2)
        # Nothing announced and no version number used: the next send is version 1.
        assert sender.version == 0 and r.version == 0
        assert torch.equal(mirror.state_dict()["0.weight"], before)
        result = await sender.send(timeout=10)
        assert result.version == 1 and r.version == 1 and same(mirror, big)


async def test_shutdown_during_a_send_raises_and_leaks_nothing() -> None:
    src = model(0)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
        mirror = model(1)
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=10), r.connect(timeout=10))
            gate = asyncio.Event()
            r.register_hook(lambda v: gate.wait())  # type: ignore[arg-type,return-value]
            task = asyncio.create_task(sender.send(timeout=10))
            await asyncio.sleep(0.2)
        # The receiver shut down mid-send: the sender hears its goodbye.
        with pytest.raises(aiowsync.WeightSyncError) as info:
            await asyncio.wait_for(task, 5)
        assert info.value.worker_ids == (0,)  # type: ignore[attr-defined]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"aiowsync-{os.getpid()}-")]


async def test_copy_mode_keeps_private_tensors_and_stays_consistent() -> None:
    src, mirror = model(0), model(1)
    async with shm_pair(src, mirror, apply_mode="copy") as (sender, r):
        for step in range(1, 4):
            bump(src)
            await sender.send(timeout=5)
            assert r.version == step and same(mirror, src)
        # Private: writing the worker's tensor does not touch the sender's slot.
        with torch.no_grad():
            mirror[0].weight.fill_(123.0)
        bump(src)
        await sender.send(timeout=5)
        assert same(mirror, src)


async def test_read_guard_delays_the_switch_until_released() -> None:
    async with shm_system(1) as (sender, src, receivers):
        r, m = receivers[0]
        guard = r.read_guard()
        before = m[0].weight.clone()
        await asyncio.to_thread(guard.acquire)
        bump(src)
        task = asyncio.create_task(sender.send(timeout=5))
        await asyncio.sleep(0.3)
        assert r.version == 0 and torch.equal(m[0].weight, before)
        await asyncio.to_thread(guard.release)
        result = await task
        assert result.version == 1 and r.version == 1 and same(m, src)


async def test_wait_for_version_times_out_with_a_clear_error() -> None:
    async with shm_system(1) as (sender, src, receivers):
        with pytest.raises(aiowsync.WeightSyncTimeout, match="still runs version 0"):
            await receivers[0][0].wait_for_version(5, timeout=0.2)


async def test_receiver_survives_a_busy_event_loop() -> None:
    async with shm_system(1) as (sender, src, receivers):
        import time

        time.sleep(SHM_BEATS.timeout * 3)  # the loop is blocked; beats keep flowing from a thread
        await asyncio.sleep(0.3)
        assert sender._sender is not None and not sender._sender.lost_workers()
        bump(src)
        assert (await sender.send(timeout=5)).worker_ids == (0,)


async def test_concurrent_sends_are_served_one_at_a_time_in_call_order() -> None:
    async with shm_system(2) as (sender, src, receivers):
        seen: list[int] = []
        receivers[0][0].register_hook(seen.append)
        payloads = [model(200 + k).state_dict() for k in range(4)]
        results = await asyncio.gather(*(sender.send(p, timeout=10) for p in payloads))
        assert [r.version for r in results] == [1, 2, 3, 4]
        assert seen == [1, 2, 3, 4]
        final = model(203)
        assert all(same(m, final) for _, m in receivers)


async def test_misuse_gives_clear_errors() -> None:
    s = aiowsync.SharedMemWeightSyncScheme()
    with pytest.raises(RuntimeError, match="init_on_sender"):
        async with s:
            pass
    with pytest.raises(ValueError, match="num_workers"):
        s.init_on_sender(model=model(), num_workers=0)
    with pytest.raises(ValueError, match="address"):
        aiowsync.SharedMemWeightSyncScheme().init_on_receiver(model=model(), worker_idx=0)
    with pytest.raises(ValueError, match="num_slots"):
        aiowsync.SharedMemWeightSyncScheme(num_slots=1)
    s.init_on_sender(model=model(), num_workers=1)
    with pytest.raises(RuntimeError, match="already initialised"):
        s.init_on_sender(model=model(), num_workers=1)
    with pytest.raises(RuntimeError, match="async with"):
        await s.send()
    async with s:
        with pytest.raises(aiowsync.WorkerLostError) as lost:
            await s.send(timeout=1)
        assert str(lost.value) == (
            "cannot send: workers [0] have not connected yet: call `await scheme.connect()` "
            "first, which waits until every worker holds version 0 (workers [0])"
        )
        with pytest.raises(aiowsync.WeightSyncTimeout) as info:
            await s.connect(timeout=0.2)
        assert info.value.worker_ids == (0,)


async def test_slots_grow_when_versions_stay_in_use_side_by_side() -> None:
    async with shm_system(3) as (sender, src, receivers):
        # Each worker is left on a different version, so more than two slots are in use.
        for worker in range(3):
            bump(src)
            await sender.send(worker_ids=[worker], timeout=5)
        assert [r.version for r, _ in receivers] == [1, 2, 3]
        bump(src)
        result = await sender.send(timeout=5)
        assert result.worker_ids == (0, 1, 2)
        assert all(same(m, src) for _, m in receivers)


def test_scheme_runs_under_uvloop() -> None:
    uvloop = pytest.importorskip("uvloop")

    async def main() -> None:
        async with shm_system(2) as (sender, src, receivers):
            for step in range(1, 4):
                bump(src)
                result = await sender.send(timeout=5)
                assert result.version == step
            assert all(r.version == 3 and same(m, src) for r, m in receivers)

    uvloop.run(main())


async def test_worker_ids_take_any_integer_and_refuse_the_rest_before_a_version() -> None:
    import numpy as np

    async with shm_system(3) as (sender, src, receivers):
        bump(src)
        result = await sender.send(worker_ids=[np.int64(2), 0], timeout=5)  # numpy's, as well
        assert result.worker_ids == (0, 2) and receivers[1][0].version == 0
        for bad, message in (
            ([], "worker_ids is empty"),
            ([True], "worker id True is not in range"),
            ([1.0], "worker id 1.0 is not in range"),
            ([3], "worker id 3 is not in range"),
            ([1, np.int32(1)], "worker_ids has duplicates"),
        ):
            with pytest.raises(ValueError, match=message):
                await sender.send(worker_ids=bad, timeout=5)
        assert sender.version == 1


async def test_a_worker_whose_model_is_far_larger_is_told_its_hello_may_be_cut_off() -> None:
    """The sender reads no message much larger than its own model's hello (a cap on what
    any process reaching the socket can make it hold): such a worker hears nothing back."""
    src = nn.Linear(4, 4)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        huge = {f"layers.{i:05d}.mixture.experts.weight": torch.zeros(1) for i in range(8000)}
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, heartbeats=SHM_BEATS)
        r.init_on_receiver(weights=huge, worker_idx=0)
        async with r:
            with pytest.raises(aiowsync.WeightSyncTimeout) as info:
                await r.connect(timeout=2)
    assert "far fewer tensors than this worker's 8000" in str(info.value)
    assert "the sender cut the hello off unread" in str(info.value)
