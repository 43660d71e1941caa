"""Failure semantics of the shared-memory scheme, with receivers in this process.

Real ZeroMQ sockets and real /dev/shm slots; receivers share the test's event loop, which keeps
these tests fast. Process deaths are covered in test_shm_multiprocess.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import gc
import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio
from torch import nn

import aiowsync
import helpers
from aiowsync._protocol import PROTOCOL_VERSION, Ack, Bye, Heartbeat, Hello, Update, decode, encode
from helpers import bump, eventually, model, same

pytestmark = pytest.mark.timeout(60)

# Beats every 0.1 s; lost after 2 s of silence (a loaded CI machine can stall a process for
# a few hundred ms, which must not count as a loss).
FAST = aiowsync.Heartbeats(interval=0.1, missed=20)


def system(
    n: int = 2, **sender_kw: Any
) -> contextlib.AbstractAsyncContextManager[
    tuple[aiowsync.SharedMemWeightSyncScheme, nn.Module, list[Any]]
]:
    """A shared-memory sender and ``n`` receivers in this process, on quick beats."""
    return helpers.system(aiowsync.SharedMemWeightSyncScheme, n, heartbeats=FAST, **sender_kw)


def pair(
    src: nn.Module, mirror: nn.Module, **kw: Any
) -> contextlib.AbstractAsyncContextManager[
    tuple[aiowsync.SharedMemWeightSyncScheme, aiowsync.SharedMemWeightSyncScheme]
]:
    """A sender of ``src`` and one receiver into ``mirror``, on quick beats."""
    return helpers.pair(src, mirror, heartbeats=FAST, **kw)


async def test_scheme_pickles_to_configuration_and_address_only() -> None:
    async with system(1) as (sender, _, receivers):
        state = sender.__getstate__()
        assert state["_address"] == sender.address
        blob = pickle.dumps(sender)
        assert len(blob) < 4096
        clone = pickle.loads(blob)
        assert clone.address == sender.address and clone.version == -1
        assert not clone.initialized_on_sender


async def test_wrong_model_is_refused_naming_the_differences() -> None:
    async with system(1) as (sender, _, _):
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
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
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
    async with pair(model(0), model(1)) as (live, _):
        with torch.device("meta"):
            twin = model(0)
        with pytest.raises(ValueError, match=r"meta device.*no values to send"):
            await live.send(twin.state_dict(), timeout=5)
        assert (await live.send(timeout=5)).version == 1  # nothing was taken or written


async def test_out_of_range_index_and_second_live_claimant_are_refused() -> None:
    async with system(2) as (sender, _, receivers):
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
    async with system(2) as (sender, src, receivers):
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

    async with system(2) as (sender, src, receivers):
        new = model(42)
        result = await sender.send(new.state_dict(), timeout=5)
        assert result.version == 1
        assert all(same(m, new) for _, m in receivers)
        newer = model(43)
        result = await sender.send(TensorDict.from_module(newer), timeout=5)
        assert result.version == 2 and all(same(m, newer) for _, m in receivers)


async def test_unacked_send_times_out_naming_the_worker_and_others_commit() -> None:
    async with system(3) as (sender, src, receivers):
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
    async with system(2) as (sender, src, receivers):

        def broken(version: int) -> None:
            raise RuntimeError(f"kv cache reset failed at {version}")

        receivers[0][0].register_hook(broken)
        with pytest.raises(aiowsync.RemoteApplyError) as info:
            await sender.send(timeout=5)
        assert info.value.errors == {0: "RuntimeError: kv cache reset failed at 1"}
        assert info.value.acked == (1,)


async def test_a_worker_whose_hook_keeps_failing_does_not_use_up_the_slots() -> None:
    # Each nack used to keep its version pinned, in case the worker ran it: after max_slots
    # failures in a row no slot was left, and every send, to every worker, failed.
    async with system(2) as (sender, src, receivers):

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
    async with system(2) as (sender, src, receivers):
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
    async with system(2) as (sender, src, receivers):
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
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=model(0), num_workers=1)
    joined, finish = asyncio.Event(), asyncio.Event()
    seen: list[bool] = []

    async def worker(address: str) -> None:
        r = aiowsync.SharedMemWeightSyncScheme(address=address, heartbeats=FAST)
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
    async with system(2) as (sender, src, receivers):
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
    async with pair(big, mirror) as (sender, r):
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
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
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
    async with pair(src, mirror, apply_mode="copy") as (sender, r):
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
    async with system(1) as (sender, src, receivers):
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
    async with system(1) as (sender, src, receivers):
        with pytest.raises(aiowsync.WeightSyncTimeout, match="still runs version 0"):
            await receivers[0][0].wait_for_version(5, timeout=0.2)


async def test_receiver_survives_a_busy_event_loop() -> None:
    async with system(1) as (sender, src, receivers):
        import time

        time.sleep(FAST.timeout * 3)  # the loop is blocked; beats keep flowing from a thread
        await asyncio.sleep(0.3)
        assert sender._sender is not None and not sender._sender.lost_workers()
        bump(src)
        assert (await sender.send(timeout=5)).worker_ids == (0,)


async def test_concurrent_sends_are_served_one_at_a_time_in_call_order() -> None:
    async with system(2) as (sender, src, receivers):
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
    async with system(3) as (sender, src, receivers):
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
        async with system(2) as (sender, src, receivers):
            for step in range(1, 4):
                bump(src)
                result = await sender.send(timeout=5)
                assert result.version == step
            assert all(r.version == 3 and same(m, src) for r, m in receivers)

    uvloop.run(main())


async def test_a_failed_hook_keeps_the_workers_slot_protected() -> None:
    async with system(2) as (sender, src, receivers):
        r0, m0 = receivers[0]

        def fail_once(version: int) -> None:
            if version == 1:
                raise RuntimeError("hook failed")

        r0.register_hook(fail_once)
        bump(src)
        with pytest.raises(aiowsync.RemoteApplyError):
            await sender.send(worker_ids=[0], timeout=5)
        held = {k: v.clone() for k, v in m0.state_dict().items()}
        assert r0.version == 1  # switched before the hook failed
        for _ in range(3):  # other versions must not be written into worker 0's slot
            bump(src)
            await sender.send(worker_ids=[1], timeout=5)
        assert all(torch.equal(m0.state_dict()[k], v) for k, v in held.items())


async def test_a_failing_hook_at_connect_fails_connect() -> None:
    src = model(0)
    s = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    s.init_on_sender(model=src, num_workers=1)
    async with s:
        r = aiowsync.SharedMemWeightSyncScheme(address=s.address)
        r.init_on_receiver(model=model(1), worker_idx=0)
        r.register_hook(lambda v: 1 / 0)  # type: ignore[arg-type,func-returns-value]
        async with r:
            with pytest.raises(aiowsync.ConnectError, match="ZeroDivisionError"):
                await r.connect(timeout=5)


async def test_a_slow_first_apply_is_not_taken_for_a_lost_worker() -> None:
    # Bringing a big model up to date can outlast the heartbeat timeout: the worker beats from
    # its welcome on, so the sender keeps it and its connect() succeeds.
    src = model(0)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, heartbeats=FAST)
        m = model(1)
        r.init_on_receiver(model=m, worker_idx=0)

        async def slow(version: int) -> None:
            if version == 0:
                await asyncio.sleep(3 * FAST.timeout)

        r.register_hook(slow)
        async with r:
            await asyncio.gather(sender.connect(timeout=30), r.connect(timeout=30))
            assert sender._sender is not None and not sender._sender.lost_workers()
            bump(src)
            assert (await sender.send(timeout=5)).worker_ids == (0,)
            assert same(m, src)


async def test_sender_shutdown_while_a_send_is_staging() -> None:
    # 64 MiB: staged in the staging thread with helper threads, long enough for the sender to
    # close under it. The receiver stays up, so only the sender's closing can fail a send.
    big = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=big, num_workers=1)
    r = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
    m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])
    r.init_on_receiver(model=m, worker_idx=0)
    outcomes: list[object] = []

    async def one() -> None:
        try:
            outcomes.append(await sender.send(timeout=10))
        except Exception as exc:  # every outcome is kept: the test checks each one's type
            outcomes.append(exc)

    async with r:
        async with sender:
            await asyncio.gather(sender.connect(timeout=10), r.connect(timeout=10))
            first = copy.deepcopy(big)
            bump(big)
            tasks = [asyncio.create_task(one()) for _ in range(3)]
            await asyncio.sleep(0)  # the first send takes the lock and starts staging
        await asyncio.gather(*tasks)
        assert len(outcomes) == 3
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        # Nothing but the library's own errors, and at least the sends queued behind the
        # staging one never ran: the sender closed under them.
        assert all(type(o) is aiowsync.WeightSyncError for o in failed), outcomes
        assert len(failed) >= 2, outcomes
        assert all("shut" in str(o) for o in failed), outcomes
        # Whatever version the worker holds, its bytes are whole: those of that version.
        assert r.version in (0, 1)
        assert same(m, big if r.version == 1 else first)


@pytest.mark.parametrize(
    ("layers", "switch"),
    [(2, "auto"), (40, "auto"), (40, "rebind"), (2, "remap")],
)
async def test_swap_mode_switches_by_rebinding_or_by_remapping_one_window(
    layers: int, switch: Any
) -> None:
    from aiowsync._planes.shm.window import windows_supported

    def many(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])

    src = many(0)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, switch=switch)
        m = many(1)
        r.init_on_receiver(model=m, worker_idx=0)
        async with r:
            await asyncio.gather(sender.connect(timeout=10), r.connect(timeout=10))
            wanted = switch == "remap" or (switch == "auto" and layers * 2 >= 64)
            window = wanted and windows_supported()
            pointers = [p.data_ptr() for p in m.parameters()]
            for step in range(1, 5):
                bump(src)
                await sender.send(timeout=5)
                assert r.version == step and same(m, src)
                # Many small tensors: the same addresses now show the new version (one remap).
                # A few tensors: each is re-bound to the new slot.
                now = [p.data_ptr() for p in m.parameters()]
                assert (now != pointers) != window
                pointers = now
            receiver = r._receiver
            assert receiver is not None
            # The window stays bound, so its per-tensor views were dropped after the first bind.
            live = receiver.applier._live
            assert (live is not None and not live.views) == window
        # Closed: the model keeps the last version, now in memory of its own (the window was
        # released), whichever the mode.
        assert same(m, src)
        assert [p.data_ptr() for p in m.parameters()] != pointers


async def test_a_window_is_given_back_once_no_model_reads_it() -> None:
    """Each receiver session in a process reserves address space for its window; a process
    whose worker reconnects again and again must not keep one range per session."""

    def mapped(addr: int) -> bool:
        with open("/proc/self/maps") as maps:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= addr < hi:
                    return True
        return False

    def many(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Linear(33, 7) for _ in range(48)])

    src, mirror = many(0), many(1)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=src, num_workers=1)
    windows: list[int] = []
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, switch="remap")
        r.init_on_receiver(model=mirror, worker_idx=0)
        for _ in range(4):
            async with r:
                await asyncio.gather(sender.connect(timeout=10), r.connect(timeout=10))
                bump(src)
                await sender.send(timeout=10)
                assert same(mirror, src)
                window = r._receiver._plane._window  # type: ignore[union-attr]
                assert window is not None  # the switches remapped a window
                windows.append(window.addr)
                del window
            gc.collect()
        del r  # a scheme dropped for good leaves no window behind either
        gc.collect()
    assert same(mirror, src)  # the model kept its weights, in memory of its own
    assert [a for a in windows if mapped(a)] == []


async def test_a_window_whose_model_torch_moved_elsewhere_is_not_remapped_blindly() -> None:
    """share_memory_() gives the model's storage new memory and lets go of the window's: the
    window must neither be unmapped under its receiver nor pretend to switch a model that
    no longer reads it."""

    def many(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Linear(33, 7) for _ in range(48)])

    src, mirror = many(0), many(1)
    async with pair(src, mirror, switch="remap") as (sender, _):
        mirror.share_memory()
        gc.collect()
        bump(src)
        with pytest.raises(aiowsync.RemoteApplyError, match="no longer use the slot window"):
            await sender.send(timeout=10)


def test_the_switch_setting_travels_with_the_scheme_and_is_checked() -> None:
    sender = aiowsync.SharedMemWeightSyncScheme(switch="rebind")
    sender.init_on_sender(model=model(0), num_workers=1)
    assert pickle.loads(pickle.dumps(sender)).switch == "rebind"
    with pytest.raises(ValueError, match="switch must be"):
        aiowsync.SharedMemWeightSyncScheme(switch="mmap")  # type: ignore[arg-type]


async def test_a_closed_receiver_keeps_its_weights_in_private_memory() -> None:
    src = model(0)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=src, num_workers=2)
    async with sender:
        r0 = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
        m0 = model(1)
        r0.init_on_receiver(model=m0, worker_idx=0)
        r1 = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
        m1 = model(2)
        r1.init_on_receiver(model=m1, worker_idx=1)
        async with r1:
            async with r0:
                await asyncio.gather(
                    sender.connect(timeout=10), r0.connect(timeout=10), r1.connect(timeout=10)
                )
                bump(src)
                await sender.send(timeout=5)
            kept = {k: v.clone() for k, v in m0.state_dict().items()}
            assert same(m0, src)
            # Slots are reused for worker 1 alone; worker 0's model must not change.
            for _ in range(4):
                bump(src)
                await sender.send(worker_ids=[1], timeout=5)
            assert all(torch.equal(m0.state_dict()[k], v) for k, v in kept.items())
            assert same(m1, src)


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("rehome", [False, True])
async def test_replaced_or_rebound_parameters_are_still_sent_right(rehome: bool, big: bool) -> None:
    src, mirror = model(0, big=big), model(1, big=big)
    async with pair(src, mirror, rehome=rehome) as (sender, r):
        bump(src)
        await sender.send(timeout=5)
        assert same(mirror, src)
        src[0].weight = nn.Parameter(torch.full((32, 16), 3.0))  # a new tensor object
        await sender.send(timeout=5)
        assert same(mirror, src)
        with torch.no_grad():
            src[2].bias.data = torch.full((4,), -2.0)  # same object, new storage
        await sender.send(timeout=5)
        assert same(mirror, src)
        src[2].bias = nn.Parameter(torch.zeros(5))  # wrong shape: refused, nothing sent
        with pytest.raises(aiowsync.LayoutMismatchError, match=r"2\.bias"):
            await sender.send(timeout=5)
        assert r.version == 3


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
@pytest.mark.parametrize("rehome", [False, True])
async def test_a_parameter_rebound_to_another_shape_is_refused_and_nothing_changes(
    rehome: bool, big: bool
) -> None:
    # ``.data =`` fires no registration hook: the sender only finds out when it checks the
    # model's shapes, at every send (not only at the first after the change).
    src, mirror = model(0, big=big), model(1, big=big)
    async with pair(src, mirror, rehome=rehome) as (sender, r):
        bump(src)
        await sender.send(timeout=5)
        assert same(mirror, src)
        kept = {k: v.clone() for k, v in mirror.state_dict().items()}
        good = src[2].bias.data
        with torch.no_grad():
            src[2].bias.data = torch.zeros(5)
        for _ in range(2):
            with pytest.raises(aiowsync.LayoutMismatchError, match=r"2\.bias"):
                await sender.send(timeout=5)
        assert r.version == 1
        assert all(torch.equal(mirror.state_dict()[k], v) for k, v in kept.items())
        with torch.no_grad():
            src[2].bias.data = good
        bump(src)
        assert (await sender.send(timeout=5)).version == 2
        assert r.version == 2 and same(mirror, src)


async def test_a_big_rehomed_parameter_transposed_in_place_arrives_transposed() -> None:
    # Same pointer, other strides: the flat buffers, copied in a thread, must not be sent as
    # they are.
    torch.manual_seed(0)
    src, mirror = model(0, big=True), model(1, big=True)
    async with pair(src, mirror, rehome=True) as (sender, r):
        assert sender._source._flat is not None
        with torch.no_grad():
            src[3].weight.t_()
        await sender.send(timeout=10)
        assert torch.equal(mirror[3].weight, src[3].weight)
        assert sender._source._flat is None  # fell back to per-tensor copies
        bump(src)
        await sender.send(timeout=10)
        assert same(mirror, src)


@pytest.mark.parametrize("pull", [False, True])
async def test_a_worker_whose_connection_was_renewed_is_taken_back(pull: bool) -> None:
    # The sender gave up on the worker (as after a stop longer than the heartbeat timeout) and
    # the worker's connection dropped and came back while its loop was not looking: the worker
    # must still announce itself on the renewed connection, and then get updates again.
    src, mirror = model(0), model(1)
    async with pair(src, mirror, background=not pull) as (sender, r):
        core, receiver = sender._sender, r._receiver
        assert core is not None and receiver is not None and receiver.channel is not None
        core.peers.mark_lost(core.peers.by_index[0], "given up on by the test")
        assert core.lost_workers() == {0}
        sock = receiver.channel._sock  # type: ignore[attr-defined]
        sock.disconnect(sender.address)
        sock.connect(sender.address)
        time.sleep(0.5)  # the loop blocked: the drop and the reconnection happen unobserved
        pulls = [] if not pull else [asyncio.create_task(r.receive(timeout=10))]
        assert await eventually(lambda: not core.lost_workers())
        bump(src)
        assert (await sender.send(timeout=5)).worker_ids == (0,)
        if pulls:
            assert await pulls[0] == 1
        assert r.version == 1 and same(mirror, src)


async def test_a_worker_given_up_on_whose_connection_stayed_up_is_taken_back() -> None:
    # The sender gave up on the worker (its loop and beat thread stalled past the heartbeat
    # timeout, as under a long call that holds the interpreter lock) while its ZeroMQ thread
    # kept the connection up: no renewal to announce. Its beats resume, and the sender finds
    # the main connection still routable and takes it back.
    src, mirror = model(0), model(1)
    async with pair(src, mirror) as (sender, r):
        core = sender._sender
        assert core is not None
        core.peers.mark_lost(core.peers.by_index[0], "given up on by the test")
        assert core.lost_workers() == {0}
        assert await eventually(lambda: not core.lost_workers())
        bump(src)
        assert (await sender.send(timeout=5)).worker_ids == (0,)
        assert r.version == 1 and same(mirror, src)


def slow_writes(sender: aiowsync.SharedMemWeightSyncScheme, seconds: float) -> list[str]:
    """Make each copy into a slot take ``seconds`` longer; returns a log of copy starts/ends."""
    core = sender._sender
    assert core is not None
    plane = core.plane
    original = plane._stage  # type: ignore[attr-defined]  # the copy in the staging thread
    events: list[str] = []

    def stage(slot: int, source: Any) -> None:
        events.append("start")
        time.sleep(seconds)
        original(slot, source)
        events.append("end")

    plane._stage = stage  # type: ignore[attr-defined]
    return events


def big_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 8 MiB: copied in a thread


@pytest.mark.parametrize("how", ["wait_for", "task.cancel"])
async def test_asyncio_cancel_during_a_copy_returns_only_after_the_copy(how: str) -> None:
    # asyncio cancels with Task.cancel(), which anyio's shields do not hold back: the send must
    # still not give its slot back (to the next send) while the copy writes into it.
    src, mirror = big_model(0), big_model(1)
    async with pair(src, mirror) as (sender, r):
        events = slow_writes(sender, 0.3)
        bump(src)
        if how == "wait_for":
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(sender.send(timeout=10), 0.05)
        else:
            task = asyncio.create_task(sender.send(timeout=10))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert events == ["start", "end"]
        bump(src, 5.0)
        result = await sender.send(timeout=10)
        assert r.version == result.version and same(mirror, src)


async def test_a_copy_that_ends_past_the_deadline_is_not_announced() -> None:
    src, mirror = big_model(0), big_model(1)
    async with pair(src, mirror) as (sender, r):
        before = mirror[0].weight.clone()
        events = slow_writes(sender, 0.5)
        bump(src)
        with pytest.raises(aiowsync.WeightSyncTimeout, match="did not stage") as info:
            await sender.send(timeout=0.2)
        assert info.value.version is None  # type: ignore[attr-defined]
        assert events == ["start", "end"] and sender.version == 0
        await asyncio.sleep(0.2)
        assert r.version == 0 and torch.equal(mirror[0].weight, before)
        result = await sender.send(timeout=10)
        assert result.version == 1 and r.version == 1 and same(mirror, src)


async def test_without_a_timeout_staging_is_bounded_by_timeouts_transfer() -> None:
    src, mirror = big_model(0), big_model(1)
    async with pair(src, mirror) as (sender, r):
        sender.timeouts = aiowsync.Timeouts(transfer=0.2)
        events = slow_writes(sender, 0.5)
        bump(src)
        with pytest.raises(aiowsync.WeightSyncTimeout, match=r"did not stage within 0\.2") as info:
            await sender.send()  # no timeout: Timeouts.transfer is the bound
        assert info.value.version is None and info.value.worker_ids == (0,)
        assert events == ["start", "end"] and sender.version == 0 and r.version == 0
        sender.timeouts = aiowsync.Timeouts()  # 120 s: the same slow copy now fits
        result = await sender.send()
        assert result.version == 1 and r.version == 1 and same(mirror, src)


async def test_copy_mode_never_copies_into_the_buffer_a_failed_switch_left_live() -> None:
    src, mirror = model(0), model(1)
    quick = aiowsync.Timeouts(ack=0.5)
    async with pair(src, mirror, apply_mode="copy", timeouts=quick) as (sender, r):
        v0 = {k: v.clone() for k, v in mirror.state_dict().items()}
        guard = r.read_guard()
        await asyncio.to_thread(guard.acquire)
        try:
            for _ in range(2):
                # Readers hold the guard past the receiver's deadline: no switch, a nack.
                bump(src)
                with pytest.raises(aiowsync.RemoteApplyError, match="read guard"):
                    await sender.send(timeout=5)
                # What the model reads (under the guard) is still version 0, byte for byte:
                # the second copy went to the spare buffer, not the one the model reads.
                assert r.version == 0
                assert all(torch.equal(mirror.state_dict()[k], v) for k, v in v0.items())
        finally:
            await asyncio.to_thread(guard.release)
        bump(src)
        result = await sender.send(timeout=5)
        assert r.version == result.version and same(mirror, src)


def many_small(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(8, 8) for _ in range(40)])  # 80 tensors: a slot window


async def test_a_failed_connect_leaves_the_model_readable_weights_of_its_own() -> None:
    src, mirror = many_small(0), many_small(1)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
        r.init_on_receiver(model=mirror, worker_idx=0)

        def refuse(version: int) -> None:
            raise RuntimeError("this worker refuses version 0")

        r.register_hook(refuse)
        async with r:
            with pytest.raises(aiowsync.ConnectError, match="refuses version 0"):
                await r.connect(timeout=10)
            # The model had switched to version 0 before the hook failed; it keeps those
            # values, in memory of its own (not the released window, not the sender's slot).
            assert same(mirror, src)
            with torch.no_grad():
                mirror[0].weight.add_(1.0)  # writable
            ranges = []
            with open("/proc/self/maps") as maps:
                for line in maps:
                    if "/dev/shm/aiowsync-" in line:
                        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                        ranges.append((lo, hi))
            assert ranges  # the sender's slots, mapped in this process
            pointers = [p.data_ptr() for p in mirror.parameters()]
            assert not any(lo <= ptr < hi for ptr in pointers for lo, hi in ranges)


async def test_a_receiver_that_cannot_detach_still_closes_its_channel() -> None:
    src, mirror = model(0), model(1)
    quick = aiowsync.Timeouts(ack=0.3)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, timeouts=quick)
        r.init_on_receiver(model=mirror, worker_idx=0)
        guard = r.read_guard()
        async with r:
            await asyncio.gather(sender.connect(timeout=10), r.connect(timeout=10))
            # A reader holds the guard through the shutdown: the model cannot be switched to
            # private memory, so it keeps reading the slot.
            await asyncio.to_thread(guard.acquire)
        try:
            assert not [t for t in threading.enumerate() if t.name == "aiowsync-heartbeat"]
            assert same(mirror, src)  # still mapped, still the sender's version 0
            core = sender._sender
            assert core is not None
            peer = core.peers.by_index[0]
            # No goodbye: the worker still reads the slot, so it is lost, never gone, and its
            # version stays pinned.
            deadline = time.monotonic() + 15
            while not peer.lost and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert peer.lost and not peer.gone
            assert 0 in core.peers.pinned_versions(core.version)
        finally:
            await asyncio.to_thread(guard.release)


async def test_pull_receive_reports_an_update_applied_even_if_its_answer_failed() -> None:
    src, mirror = model(0), model(1)
    async with pair(src, mirror, background=False) as (sender, r):
        core = r._receiver
        assert core is not None

        async def unanswerable(answer: object, **kw: object) -> None:
            raise aiowsync.WeightSyncTimeout("the sender is not reading", [0])

        core._updates._answer = unanswerable  # type: ignore[method-assign]
        bump(src)
        task = asyncio.create_task(sender.send(timeout=0.5))
        assert await r.receive(timeout=5) == 1
        assert r.version == 1 and same(mirror, src)
        with pytest.raises(aiowsync.WeightSyncTimeout):
            await task


_SMALL_SHM_SENDER = """
import asyncio, sys
import torch
from torch import nn
import aiowsync
from aiowsync._planes.shm import slots as _shm_slots
from pathlib import Path
_shm_slots.SHM_DIR = Path(sys.argv[1])

async def main():
    sender = aiowsync.SharedMemWeightSyncScheme()
    sender.init_on_sender(model=nn.Linear(1024, 2048), num_workers=1)  # 8 MiB
    try:
        async with sender:
            print("started")
    except aiowsync.TransportError as exc:
        print("refused:", exc)

asyncio.run(main())
"""


@pytest.mark.timeout(200)  # a child process that imports torch: slow on a busy host
def test_a_full_shm_file_system_is_a_clear_error_not_a_crash(tmp_path: Any) -> None:
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    small = tmp_path / "shm"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=1777", "tmpfs", str(small)],
        capture_output=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        run = subprocess.run(
            [sys.executable, "-c", _SMALL_SHM_SENDER, str(small)],
            capture_output=True,
            text=True,
            timeout=150,
        )
        # Before: the copy into the slot died of SIGBUS (returncode -7).
        assert run.returncode == 0, run.stderr
        assert "refused:" in run.stdout and "shm-size" in run.stdout, run.stdout
        assert os.listdir(small) == []  # nothing left behind
    finally:
        subprocess.run(["umount", str(small)], check=False)


@pytest.mark.parametrize("bind", [None, "tcp://127.0.0.1:0"], ids=["default", "tcp"])
async def test_the_address_is_known_after_init_on_sender_and_kept_across_sessions(
    bind: str | None,
) -> None:
    # DESIGN section 6: scheme.address is read between init_on_sender() and `async with`.
    src = model(0)
    sender = aiowsync.SharedMemWeightSyncScheme(
        heartbeats=FAST, **({} if bind is None else {"bind": bind})
    )
    sender.init_on_sender(model=src, num_workers=2)
    address = sender.address
    if bind is None:  # a Unix socket in a private directory of its own name
        assert re.fullmatch(rf"ipc:///.+/aiowsync-{os.getpid()}-[0-9a-f]{{16}}/control", address)
    else:
        assert address.startswith("tcp://127.0.0.1:") and not address.endswith(":0")
    by_pickle = pickle.loads(pickle.dumps(sender))  # carries the same address
    by_address = aiowsync.SharedMemWeightSyncScheme(address=address)
    for _session in range(2):
        mirrors = [model(1), model(2)]
        by_pickle.init_on_receiver(model=mirrors[0], worker_idx=0)
        by_address.init_on_receiver(model=mirrors[1], worker_idx=1)
        async with sender, by_pickle, by_address:
            assert sender.address == address
            await asyncio.gather(
                sender.connect(timeout=10),
                by_pickle.connect(timeout=10),
                by_address.connect(timeout=10),
            )
            bump(src)
            result = await sender.send(timeout=5)
            assert result.worker_ids == (0, 1) and all(same(m, src) for m in mirrors)
        # A later session serves on the same address; receivers are made afresh.
        by_pickle = pickle.loads(pickle.dumps(sender))
        by_address = aiowsync.SharedMemWeightSyncScheme(address=address)


@pytest.mark.parametrize("bind", [None, "tcp://127.0.0.1:0"], ids=["default", "tcp"])
def test_an_address_read_but_never_served_is_released(bind: str | None) -> None:
    import gc

    sender = aiowsync.SharedMemWeightSyncScheme(**({} if bind is None else {"bind": bind}))
    sender.init_on_sender(model=model(0), num_workers=1)
    address = sender.address
    del sender
    gc.collect()
    # The port is free again: a new sender binds exactly it (no ResourceWarning either,
    # warnings being errors in this suite).
    again = aiowsync.SharedMemWeightSyncScheme(bind=address)
    again.init_on_sender(model=model(0), num_workers=1)
    assert again.address == address
    del again
    gc.collect()


async def test_a_second_session_serves_on_the_first_sessions_address() -> None:
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=model(0), num_workers=1)
    async with sender:
        first = sender.address  # bound by `async with`, not read before
    async with sender:
        assert sender.address == first


@pytest.mark.parametrize("bind", [None, "tcp://127.0.0.1:0"], ids=["default", "tcp"])
async def test_a_later_session_whose_address_is_taken_binds_a_fresh_one(
    caplog: pytest.LogCaptureFixture, bind: str | None
) -> None:
    import socket
    from urllib.parse import urlsplit

    sender = aiowsync.SharedMemWeightSyncScheme(
        heartbeats=FAST, **({} if bind is None else {"bind": bind})
    )
    sender.init_on_sender(model=model(0), num_workers=1)
    async with sender:
        first = sender.address
    # Something else holds the address now (as a child forked during the session would).
    if bind is None:
        path = first.removeprefix("ipc://")
        os.mkdir(os.path.dirname(path), 0o700)
        squatter = socket.socket(socket.AF_UNIX)
        squatter.bind(path)
    else:
        squatter = socket.socket()
        squatter.bind(("127.0.0.1", urlsplit(first).port))
    with squatter:
        squatter.listen()
        with caplog.at_level(logging.WARNING, logger="aiowsync"):
            async with sender:
                second = sender.address
                r = aiowsync.SharedMemWeightSyncScheme(address=second)
                mirror = model(1)
                r.init_on_receiver(model=mirror, worker_idx=0)
                async with r:
                    await asyncio.gather(sender.connect(timeout=10), r.connect(timeout=10))
                    assert same(mirror, sender.model)
    assert second != first
    assert any("cannot serve on" in rec.getMessage() for rec in caplog.records)
    if bind is None:
        os.unlink(path)
        os.rmdir(os.path.dirname(path))


async def test_a_sender_serves_on_bind_whatever_address_it_was_built_with() -> None:
    sender = aiowsync.SharedMemWeightSyncScheme(
        address="tcp://127.0.0.1:1", bind="tcp://127.0.0.1:0", heartbeats=FAST
    )
    sender.init_on_sender(model=model(0), num_workers=1)
    async with sender:
        assert sender.address != "tcp://127.0.0.1:1"
        assert sender.address.startswith("tcp://127.0.0.1:")


_LONG_RETRIES = r"""
import asyncio, secrets, sys, time, torch, zmq
from torch import nn
import aiowsync
from aiowsync._channel import _zmq

# One reconnection attempt a millisecond instead of ten a second: seconds here stand for the
# minutes after which a receiver's connection monitor used to be full.
plain = _zmq._base_options
def fast_retries(sock, heartbeat_timeout):
    plain(sock, heartbeat_timeout)
    sock.setsockopt(zmq.RECONNECT_IVL, 1)
_zmq._base_options = fast_retries

def linear(value):
    m = nn.Linear(4, 4)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m

async def outlive(seconds):
    sender = aiowsync.SharedMemWeightSyncScheme()
    sender.init_on_sender(model=linear(1.0), num_workers=1)
    started = asyncio.Event()

    async def serve():
        async with sender:
            started.set()
            await sender.connect(timeout=10)

    serving = asyncio.create_task(serve())
    await started.wait()
    r = aiowsync.SharedMemWeightSyncScheme(address=sender.address)
    r.init_on_receiver(model=linear(0.0), worker_idx=0)
    async with r:
        await r.connect(timeout=10)
        await serving  # the sender says goodbye and closes
        # The receiver serves on with the weights it has.
        await asyncio.sleep(seconds)
        assert not r.connected
        t0 = time.monotonic()
    print(f"closed in {time.monotonic() - t0:.2f} s")

async def early(seconds):
    # The worker starts first and keeps trying to reach a trainer that is not there yet.
    address = f"ipc://@aiowsync-test-{secrets.token_hex(8)}"
    mirror = linear(0.0)
    r = aiowsync.SharedMemWeightSyncScheme(address=address)
    r.init_on_receiver(model=mirror, worker_idx=0)
    async with r:
        joining = asyncio.create_task(r.connect(timeout=seconds + 20))
        await asyncio.sleep(seconds)
        sender = aiowsync.SharedMemWeightSyncScheme(bind=address)
        sender.init_on_sender(model=linear(2.0), num_workers=1)
        async with sender:
            await asyncio.gather(sender.connect(timeout=20), joining)
            assert torch.equal(mirror.weight, torch.full((4, 4), 2.0))
            print("joined")

asyncio.run({"outlive": outlive, "early": early}[sys.argv[1]](float(sys.argv[2])))
"""


def _long_retries(case: str) -> str:
    """Run ``case`` of :data:`_LONG_RETRIES` in a process of its own (so that a hang is a
    failed test); its output."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _LONG_RETRIES, case, "6"],
            capture_output=True,
            text=True,
            timeout=150,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{case}: hung")
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.timeout(200)
def test_a_receiver_that_outlives_its_sender_for_minutes_still_closes() -> None:
    # Each reconnection attempt queued an event for the connection monitor, which nothing read
    # once the background task had heard the goodbye; when the queue was full, libzmq's thread
    # waited for room while holding a lock, and closing the receiver waited for that lock
    # forever.
    out = _long_retries("outlive")
    assert out.startswith("closed in ")
    assert float(out.split()[2]) < 4.0  # short of the 5 s join that a hang would wait out


@pytest.mark.timeout(200)
def test_a_worker_that_waits_minutes_for_its_trainer_still_joins() -> None:
    # Before the welcome nothing but the beat thread reads the monitor: events of the failed
    # attempts must not pile up until libzmq's thread stalls and no handshake can happen.
    assert _long_retries("early").strip() == "joined"


def test_a_switch_that_timed_out_leaves_nothing_behind_for_later_releases() -> None:
    from aiowsync._receiving.guard import ReadGuard

    guard = ReadGuard()
    guard.acquire()  # a reader (this thread) holds the guard past the switch's deadline

    async def switch() -> None:
        with pytest.raises(TimeoutError):
            await guard.switch(lambda: None, timeout=0.05)

    asyncio.run(switch())  # and that loop is closed afterwards
    assert guard._idle_waiters == []
    # The last reader out used to call into the closed loop and raise RuntimeError here.
    guard.release()
    assert guard.readers == 0
    assert asyncio.run(guard.switch(lambda: 7, timeout=1)) == 7


# -- updates handled within the channel's callback ----------------------------------------------


async def test_an_update_whose_answer_finds_no_room_is_answered_by_the_background_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An update is switched to as it arrives; when the answer cannot be queued there, the
    background task sends it, and the version is applied once."""
    async with system(1) as (sender, src, receivers):
        r, m = receivers[0]
        core = r._receiver
        assert core is not None and core.channel is not None
        channel = core.channel
        real = channel.send_nowait
        refused: list[object] = []

        def full_once(message: Any) -> bool:
            if not refused:
                refused.append(message)
                return False
            return real(message)

        monkeypatch.setattr(channel, "send_nowait", full_once)
        switched: list[int] = []
        applier = core.applier
        real_commit = applier._commit
        monkeypatch.setattr(
            applier, "_commit", lambda v, s, **kw: (switched.append(v), real_commit(v, s, **kw))[1]
        )
        bump(src)
        result = await sender.send(timeout=5)
        assert result.version == 1 and result.worker_ids == (0,)
        assert [type(a).__name__ for a in refused] == ["Ack"]
        assert switched == [1] and r.version == 1 and same(m, src)
        assert core._updates._late is None
        bump(src)
        assert (await sender.send(timeout=5)).version == 2 and same(m, src)


async def test_an_update_out_of_order_disconnects_the_worker_and_keeps_its_weights() -> None:
    """A sender that repeats a version breaks the protocol: the worker stops trusting it,
    keeps the weights it runs, and applies nothing more from it."""
    async with system(1) as (sender, src, receivers):
        r, m = receivers[0]
        bump(src)
        await sender.send(timeout=5)
        held = {k: v.clone() for k, v in m.state_dict().items()}
        core = sender._sender
        assert core is not None and core.channel is not None
        peer = core.peers.by_index[0]
        again = Update(version=1, params=core.plane.deliver(1, [], 0.0).params, proof=core.proof)
        assert core.channel.send_nowait(peer.routing, again)
        deadline = time.monotonic() + 5
        while r._receiver is not None and r._receiver.protocol_errors == 0:
            assert time.monotonic() < deadline, "the repeated version went unnoticed"
            await asyncio.sleep(0.01)
        assert not r.connected and r.version == 1
        bump(src)
        with pytest.raises(aiowsync.WeightSyncTimeout):
            await sender.send(timeout=0.5)
        assert r.version == 1
        assert all(torch.equal(v, held[k]) for k, v in m.state_dict().items())


async def test_a_sender_whose_slot_files_were_removed_goes_on_and_workers_join_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before: once the slot files were removed under a running sender (logind's RemoveIPC
    # at logout, a tidy-up rm), every send failed with a wrong "raise --shm-size" hint and
    # no worker could join again.
    src, mirror = model(0), model(1)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=src, num_workers=2)
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, heartbeats=FAST)
        r.init_on_receiver(model=mirror, worker_idx=0)
        async with r:
            await r.connect(timeout=20)
            bump(src)
            await sender.send(timeout=10, worker_ids=[0])
            prefix = f"aiowsync-{os.getpid()}-"
            mine = [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]
            assert mine
            for name in mine:
                os.unlink(f"/dev/shm/{name}")
            with caplog.at_level(logging.WARNING, logger="aiowsync.shm"):
                for _ in range(3):
                    bump(src)
                    result = await sender.send(timeout=10, worker_ids=[0])
                    assert result.worker_ids == (0,) and same(mirror, src)
            # A worker joins afterwards and gets the latest version.
            late = model(7)
            joiner = aiowsync.SharedMemWeightSyncScheme(address=sender.address, heartbeats=FAST)
            joiner.init_on_receiver(model=late, worker_idx=1)
            async with joiner:
                await joiner.connect(timeout=20)
                assert joiner.version == sender.version and same(late, src)
            assert "was removed by another process; made anew" in caplog.text


_WRITER = """
import asyncio, sys
import torch
from torch import nn
import aiowsync
address = sys.argv[1]
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))
async def main():
    scheme = aiowsync.SharedMemWeightSyncScheme(address=address, switch="rebind", apply_mode="swap")
    scheme.init_on_receiver(model=model, worker_idx=0)
    async with scheme:
        await scheme.connect(timeout=30)
        await scheme.wait_for_version(1, timeout=30)
        print("running version 1", flush=True)
        with torch.no_grad():
            model.train()(torch.randn(32, 8))  # BatchNorm writes its running stats
        print("wrote into the model", flush=True)
asyncio.run(main())
"""


async def test_a_worker_that_writes_a_rebound_model_fails_alone_and_loudly() -> None:
    # Before: rebind mode mapped slots shared and read-write, so a worker whose BatchNorm was
    # left in train mode silently changed the sender's slot and the other worker's
    # running_mean. Its mappings are read only now: the write faults in that worker alone.
    src = _bn_model(0)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=src, num_workers=2)
    other = _bn_model(2)
    async with sender:
        writer = await asyncio.create_subprocess_exec(
            sys.executable,
            "-X",
            "faulthandler",
            "-c",
            _WRITER,
            sender.address,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            r = aiowsync.SharedMemWeightSyncScheme(
                address=sender.address, heartbeats=FAST, switch="rebind", apply_mode="swap"
            )
            r.init_on_receiver(model=other, worker_idx=1)
            async with r:
                await asyncio.gather(sender.connect(timeout=30), r.connect(timeout=30))
                with torch.no_grad():
                    for p in src.parameters():
                        p.add_(0.5)
                sent = _state(src)
                await sender.send(timeout=20)
                out, err = await asyncio.wait_for(writer.communicate(), 60)
                # The writer died on its write (SIGSEGV), saying where.
                assert writer.returncode == -signal.SIGSEGV, (writer.returncode, err[-2000:])
                assert b"running version 1" in out and b"wrote into the model" not in out
                assert b"Segmentation fault" in err and b"batchnorm" in err.lower()
                # Nothing changed for the sender or the other worker.
                assert _holds(other, sent) and _holds(src, sent)
                assert await eventually(lambda: sender.workers[0].state in ("lost", "gone"), 30)
                with torch.no_grad():
                    for p in src.parameters():
                        p.add_(0.5)
                sent = _state(src)
                assert (await sender.send(worker_ids=[1], timeout=20)).worker_ids == (1,)
                assert _holds(other, sent)
        finally:
            if writer.returncode is None:
                writer.kill()
                await writer.wait()


def _bn_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))


def _state(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _holds(m: nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, expected[k]) for k, v in m.state_dict().items())


async def test_a_worker_that_writes_its_swap_mode_model_changes_only_its_own() -> None:
    # Before: slots were mapped read-write and shared, so a worker whose BatchNorm was left in
    # train mode changed the sender's slot and the other worker's running_mean. The slot
    # window maps each version privately (copy-on-write).
    switch = "remap"
    src = _bn_model(0)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=FAST)
    sender.init_on_sender(model=src, num_workers=2)
    models = [_bn_model(1), _bn_model(2)]
    async with sender:
        receivers = []
        for i, m in enumerate(models):
            r = aiowsync.SharedMemWeightSyncScheme(
                address=sender.address, heartbeats=FAST, switch=switch, apply_mode="swap"
            )
            r.init_on_receiver(model=m, worker_idx=i)
            receivers.append(r)
        async with receivers[0], receivers[1]:
            await asyncio.gather(
                sender.connect(timeout=20), *(r.connect(timeout=20) for r in receivers)
            )
            for version in range(1, 6):
                with torch.no_grad():
                    for p in src.parameters():
                        p.add_(0.5)
                sent = _state(src)
                await sender.send(timeout=10)
                # Every worker runs exactly what was sent: what worker 0 wrote into the
                # version before is gone, also when the sender reuses that slot.
                assert all(_holds(m, sent) for m in models), version
                # Worker 0 writes into its model: BatchNorm's running stats in train mode,
                # and noise added to a weight.
                writer = models[0].train()
                with torch.no_grad():
                    writer(torch.randn(32, 8) * 10)
                    writer[0].weight.add_(1.0)
                assert not torch.equal(writer[1].running_mean, sent["1.running_mean"])
                assert not torch.equal(writer[0].weight, sent["0.weight"])
                # ... and changes nothing of the sender's or of the other worker.
                assert _holds(models[1], sent), version
