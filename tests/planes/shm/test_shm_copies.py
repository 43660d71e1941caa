"""The shared-memory scheme with receivers in this process (3 of 5): copies into a slot that run
in a thread (cancelled, late, bounded), failed connects and a full shared-memory file system.

Real ZeroMQ sockets and real /dev/shm slots, receivers on the test's event loop.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import aiowsync
from helpers import SHM_BEATS, bump, model, same, shm_pair, slow_writes

pytestmark = pytest.mark.timeout(60)


def two_mib_layers(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # 8 MiB: copied in a thread


@pytest.mark.parametrize("how", ["wait_for", "task.cancel"])
async def test_asyncio_cancel_during_a_copy_returns_only_after_the_copy(how: str) -> None:
    # asyncio cancels with Task.cancel(), which anyio's shields do not hold back: the send must
    # still not give its slot back (to the next send) while the copy writes into it.
    src, mirror = two_mib_layers(0), two_mib_layers(1)
    async with shm_pair(src, mirror) as (sender, r):
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
    src, mirror = two_mib_layers(0), two_mib_layers(1)
    async with shm_pair(src, mirror) as (sender, r):
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
    src, mirror = two_mib_layers(0), two_mib_layers(1)
    async with shm_pair(src, mirror) as (sender, r):
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
    async with shm_pair(src, mirror, apply_mode="copy", timeouts=quick) as (sender, r):
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
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
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
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
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
    async with shm_pair(src, mirror, background=False) as (sender, r):
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
