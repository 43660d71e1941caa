"""The shared-memory scheme with receivers in this process (5 of 5): updates answered within the
channel's callback, slot files removed under a running sender, and workers that write their
own model.

Real ZeroMQ sockets and real /dev/shm slots, receivers on the test's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from torch import nn

import aiowsync
from aiowsync._protocol import Update
from helpers import SHM_BEATS, bump, eventually, frozen, model, same, shm_system

pytestmark = pytest.mark.timeout(60)


# -- updates handled within the channel's callback ----------------------------------------------


async def test_an_update_whose_answer_finds_no_room_is_answered_by_the_background_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An update is switched to as it arrives; when the answer cannot be queued there, the
    background task sends it, and the version is applied once."""
    async with shm_system(1) as (sender, src, receivers):
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
    async with shm_system(1) as (sender, src, receivers):
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


@pytest.mark.parametrize("then", ["nothing", "a file", "a link"])
async def test_a_sender_whose_slot_files_were_removed_goes_on_and_workers_join_again(
    caplog: pytest.LogCaptureFixture, tmp_path: Any, then: str
) -> None:
    # Before: once the slot files were removed under a running sender (logind's RemoveIPC
    # at logout, a tidy-up rm), every send failed with a wrong "raise --shm-size" hint and
    # no worker could join again. And where another process then put a file under a removed
    # name, the slot was never made anew (every send failed); where it put a link, the
    # sender allocated the slot's size in the file the link named.
    victim = tmp_path / "victim"
    victim.write_bytes(b"not a slot\n")
    src, mirror = model(0), model(1)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
    sender.init_on_sender(model=src, num_workers=2)
    async with sender:
        r = aiowsync.SharedMemWeightSyncScheme(address=sender.address, heartbeats=SHM_BEATS)
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
                if then == "a file":
                    with open(f"/dev/shm/{name}", "w") as squat:
                        squat.write("squatted")
                elif then == "a link":
                    os.symlink(victim, f"/dev/shm/{name}")
            with caplog.at_level(logging.WARNING, logger="aiowsync.shm"):
                for _ in range(3):
                    bump(src)
                    result = await sender.send(timeout=10, worker_ids=[0])
                    assert result.worker_ids == (0,) and same(mirror, src)
            # A worker joins afterwards and gets the latest version.
            late = model(7)
            joiner = aiowsync.SharedMemWeightSyncScheme(
                address=sender.address, heartbeats=SHM_BEATS
            )
            joiner.init_on_receiver(model=late, worker_idx=1)
            async with joiner:
                await joiner.connect(timeout=20)
                assert joiner.version == sender.version and same(late, src)
            assert "was removed by another process; made anew" in caplog.text
            assert victim.read_bytes() == b"not a slot\n"
            # Once more, with no send after it: the sender closes with the names taken.
            again = [n for n in os.listdir("/dev/shm") if n.startswith(prefix) and n not in mine]
            for name in again:
                os.unlink(f"/dev/shm/{name}")
                if then == "a file":
                    with open(f"/dev/shm/{name}", "w") as squat:
                        squat.write("squatted")
                elif then == "a link":
                    os.symlink(victim, f"/dev/shm/{name}")
            mine += again
    # Closing, the sender removed its own files only: what another put under their old
    # names is not its to remove.
    try:
        left = {n for n in mine if os.path.lexists(f"/dev/shm/{n}")}
        assert left == (set() if then == "nothing" else set(mine))
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix) and n not in mine]
    finally:
        for name in mine:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")


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
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
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
                address=sender.address, heartbeats=SHM_BEATS, switch="rebind", apply_mode="swap"
            )
            r.init_on_receiver(model=other, worker_idx=1)
            async with r:
                await asyncio.gather(sender.connect(timeout=30), r.connect(timeout=30))
                with torch.no_grad():
                    for p in src.parameters():
                        p.add_(0.5)
                sent = frozen(src)
                await sender.send(timeout=20)
                out, err = await asyncio.wait_for(writer.communicate(), 60)
                # The writer died on its write (SIGSEGV), saying where.
                assert writer.returncode == -signal.SIGSEGV, (writer.returncode, err[-2000:])
                assert b"running version 1" in out and b"wrote into the model" not in out
                assert b"Segmentation fault" in err and b"batchnorm" in err.lower()
                # Nothing changed for the sender or the other worker.
                assert same(other, sent) and same(src, sent)
                assert await eventually(lambda: sender.workers[0].state in ("lost", "gone"), 30)
                with torch.no_grad():
                    for p in src.parameters():
                        p.add_(0.5)
                sent = frozen(src)
                assert (await sender.send(worker_ids=[1], timeout=20)).worker_ids == (1,)
                assert same(other, sent)
        finally:
            if writer.returncode is None:
                writer.kill()
                await writer.wait()


def _bn_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 2))


async def test_a_worker_that_writes_its_swap_mode_model_changes_only_its_own() -> None:
    # Before: slots were mapped read-write and shared, so a worker whose BatchNorm was left in
    # train mode changed the sender's slot and the other worker's running_mean. The slot
    # window maps each version privately (copy-on-write).
    switch = "remap"
    src = _bn_model(0)
    sender = aiowsync.SharedMemWeightSyncScheme(heartbeats=SHM_BEATS)
    sender.init_on_sender(model=src, num_workers=2)
    models = [_bn_model(1), _bn_model(2)]
    async with sender:
        receivers = []
        for i, m in enumerate(models):
            r = aiowsync.SharedMemWeightSyncScheme(
                address=sender.address, heartbeats=SHM_BEATS, switch=switch, apply_mode="swap"
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
                sent = frozen(src)
                await sender.send(timeout=10)
                # Every worker runs exactly what was sent: what worker 0 wrote into the
                # version before is gone, also when the sender reuses that slot.
                assert all(same(m, sent) for m in models), version
                # Worker 0 writes into its model: BatchNorm's running stats in train mode,
                # and noise added to a weight.
                writer = models[0].train()
                with torch.no_grad():
                    writer(torch.randn(32, 8) * 10)
                    writer[0].weight.add_(1.0)
                assert not torch.equal(writer[1].running_mean, sent["1.running_mean"])
                assert not torch.equal(writer[0].weight, sent["0.weight"])
                # ... and changes nothing of the sender's or of the other worker.
                assert same(models[1], sent), version


# -- a sender that cannot see its workers' processes ---------------------------------------------

_TRAINER_IN_OWN_PID_NAMESPACE = """
import asyncio, sys
import torch
import aiowsync
async def main():
    # Without keys: a worker started apart has none (a test of pids, not of keys).
    channels = aiowsync.ZmqChannelFactory(allow_insecure_bind=True)
    scheme = aiowsync.SharedMemWeightSyncScheme(bind=sys.argv[1], channels=channels)
    scheme.init_on_sender(model=torch.nn.Linear(4, 2), num_workers=1)
    async with scheme:
        print(scheme.address, flush=True)
        try:
            await scheme.connect(timeout=60)
            print("connected", flush=True)
        except aiowsync.ConnectFailedError as exc:
            print("refused:", str(exc).replace("\\n", " "), flush=True)
asyncio.run(main())
"""
_WORKER_IN_OWN_PID_NAMESPACE = """
import asyncio, os, sys
import torch
import aiowsync
async def main():
    channels = aiowsync.ZmqChannelFactory(allow_insecure_bind=True)
    scheme = aiowsync.SharedMemWeightSyncScheme(address=sys.argv[1], channels=channels)
    scheme.init_on_receiver(model=torch.nn.Linear(4, 2), worker_idx=0)
    async with scheme:
        try:
            await scheme.connect(timeout=30)
            print("connected as pid", os.getpid(), flush=True)
        except aiowsync.ConnectError as exc:
            print("refused:", str(exc).replace("\\n", " "), flush=True)
asyncio.run(main())
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a pid namespace of its own needs root")
@pytest.mark.parametrize("bind", ["ipc://*", "tcp://127.0.0.1:0"])
async def test_a_worker_whose_process_the_sender_cannot_see_is_refused(bind: str) -> None:
    # Two containers that share /dev/shm but not their pid namespace: the trainer and the
    # worker are each pid 1 of a namespace of its own. Before, over a Unix socket, the kernel
    # named the worker pid 0, the sender fell back to the pid the hello gave (nobody's there)
    # and judged the live worker gone at once, its slot overwritten while its model ran on it;
    # over tcp, the hello's pid 1 named the trainer itself, whose liveness the worker's pins
    # then followed.
    def start(script: str, arg: str) -> subprocess.Popen[str]:
        cmd = ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", script, arg]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    async def line(proc: subprocess.Popen[str]) -> str:
        return await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)  # type: ignore[union-attr]

    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    trainer = start(_TRAINER_IN_OWN_PID_NAMESPACE, bind)
    worker = None
    try:
        address = await line(trainer)
        if not address:
            pytest.skip("unshare --pid --fork could not start the trainer")
        worker = start(_WORKER_IN_OWN_PID_NAMESPACE, address.strip())
        heard = await line(worker)
        assert (heard.startswith("refused:") and "not in this sender's pid namespace" in heard) or (
            "the kernel cannot name its process here" in heard
        ), heard
        assert "one host in one pid namespace" in heard
        told = await line(trainer)
        assert told.startswith("refused:") and "another pid namespace" in told, told
        # Each ends on its own, its files removed (they are named after pid 1, which
        # exists in every namespace: no later sender would sweep them).
        for proc in (trainer, worker):
            assert await asyncio.to_thread(proc.wait, 60) == 0
    finally:
        for proc in (trainer, worker):
            if proc is not None:
                if proc.poll() is None:
                    proc.kill()
                proc.wait(10)
                proc.stdout.close()  # type: ignore[union-attr]
