"""The shared-memory scheme with receivers in this process (2 of 5): failing hooks, slow first
applies, swap-mode windows, parameters replaced or rebound, and connections renewed.

Real ZeroMQ sockets and real /dev/shm slots, receivers on the test's event loop.
"""

from __future__ import annotations

import asyncio
import copy
import gc
import pickle
import time
from typing import Any

import pytest
import torch
from torch import nn

import aiowsync
from helpers import SHM_BEATS, Hosted, bump, eventually, model, same, shm_pair, shm_system

pytestmark = pytest.mark.timeout(60)


def _many(seed: int, layers: int, shape: tuple[int, int] = (8, 8)) -> nn.Module:
    """A model of ``layers`` small linear layers (each of ``shape``)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(*shape) for _ in range(layers)])


async def test_a_failed_hook_keeps_the_workers_slot_protected() -> None:
    async with shm_system(2) as (sender, src, receivers):
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
    s = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
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
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, heartbeats=SHM_BEATS)
        m = model(1)
        r.init_on_receiver(model=m, worker_idx=0)

        async def slow(version: int) -> None:
            if version == 0:
                await asyncio.sleep(3 * SHM_BEATS.timeout)

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
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
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

    src = _many(0, layers)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, switch=switch)
        m = _many(1, layers)
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

    src, mirror = _many(0, 48, (33, 7)), _many(1, 48, (33, 7))
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
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


@pytest.mark.parametrize("reconnect", [False, True])
async def test_a_window_receiver_leases_its_version_once_its_sender_has_ended(
    reconnect: bool,
) -> None:
    """A receiver that outlives its sender serves its version from the slot its window
    shows; the sender removed the slot's name on its way out, and a lease maps the slot all
    the same (with ``reconnect=``, a copy of it)."""

    src, mirror = _many(0, 40), _many(1, 40)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
    sender.init_on_sender(model=src, num_workers=1)
    host = Hosted(sender)
    await host.start()
    try:
        r = aiowsync.SharedMemWeightSyncScheme(
            address=sender.address, switch="remap", apply_mode="swap"
        )
        r.init_on_receiver(model=mirror, worker_idx=0, reconnect=reconnect)
        async with r:
            await asyncio.gather(sender.connect(timeout=10), r.connect(timeout=10))
            bump(src)
            await sender.send(timeout=10)
            assert r._receiver._plane._window is not None  # type: ignore[union-attr]
            expected = {k: v.clone() for k, v in src.state_dict().items()}
            await host.stop()  # its slot files go with it
            await eventually(lambda: not r.connected, what="the receiver sees its sender gone")
            assert r.ready == reconnect and r.version == 1 and same(mirror, src)
            async with r.lease() as held:
                assert held.version == 1
                assert all(torch.equal(held.params()[k], v) for k, v in expected.items())
    finally:
        await host.stop()


async def test_a_window_whose_model_torch_moved_elsewhere_is_not_remapped_blindly() -> None:
    """share_memory_() gives the model's storage new memory and lets go of the window's: the
    window must neither be unmapped under its receiver nor pretend to switch a model that
    no longer reads it."""

    src, mirror = _many(0, 48, (33, 7)), _many(1, 48, (33, 7))
    async with shm_pair(src, mirror, switch="remap") as (sender, _):
        mirror.share_memory()
        gc.collect()
        bump(src)
        with pytest.raises(aiowsync.RemoteApplyError, match="no longer use the slot window"):
            await sender.send(timeout=10)


def test_the_switch_setting_travels_with_the_scheme_and_is_checked() -> None:
    sender = aiowsync.SharedMemWeightSyncScheme(switch="rebind")
    sender.init_on_sender(model=model(0), num_workers=1)
    assert pickle.loads(pickle.dumps(sender)).plane.switch == "rebind"
    with pytest.raises(ValueError, match="switch must be"):
        aiowsync.SharedMemWeightSyncScheme(switch="mmap")  # type: ignore[arg-type]


async def test_a_closed_receiver_keeps_its_weights_in_private_memory() -> None:
    src = model(0)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
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
    async with shm_pair(src, mirror, rehome=rehome) as (sender, r):
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
    async with shm_pair(src, mirror, rehome=rehome) as (sender, r):
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
    async with shm_pair(src, mirror, rehome=True) as (sender, r):
        assert sender._sending.source._flat is not None
        with torch.no_grad():
            src[3].weight.t_()
        await sender.send(timeout=10)
        assert torch.equal(mirror[3].weight, src[3].weight)
        assert sender._sending.source._flat is None  # fell back to per-tensor copies
        bump(src)
        await sender.send(timeout=10)
        assert same(mirror, src)


@pytest.mark.parametrize("pull", [False, True])
async def test_a_worker_whose_connection_was_renewed_is_taken_back(pull: bool) -> None:
    # The sender gave up on the worker (as after a stop longer than the heartbeat timeout) and
    # the worker's connection dropped and came back while its loop was not looking: the worker
    # must still announce itself on the renewed connection, and then get updates again.
    src, mirror = model(0), model(1)
    async with shm_pair(src, mirror, background=not pull) as (sender, r):
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
    async with shm_pair(src, mirror) as (sender, r):
        core = sender._sender
        assert core is not None
        core.peers.mark_lost(core.peers.by_index[0], "given up on by the test")
        assert core.lost_workers() == {0}
        assert await eventually(lambda: not core.lost_workers())
        bump(src)
        assert (await sender.send(timeout=5)).worker_ids == (0,)
        assert r.version == 1 and same(mirror, src)
